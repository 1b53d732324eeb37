"""verl interop: verl's own rows import, re-export unchanged and pack as verl maps them; dew's round trip.

The fixtures come from tools/verl_interop_reference.py (verl 0.9.1's ToolAgentLoop, its
AgentLoopOutput.as_dict() and AgentLoopWorker batching, and the gsm8k tool-agent parquet
layout); this file never imports torch or verl.
"""

import copy
import json
import math
from pathlib import Path

import numpy as np
import pytest
from conftest import import_from
from hypothesis import given, settings
from hypothesis import strategies as st

from dew.data import Prompts
from dew.data.dataset import Partition
from dew.data.prompts import utf8_text
from dew.records.session_packing import pack
from dew.records.session_records import Call, Session, Status, Task
from dew.records.verl_rows import from_verl, to_verl, VerlTrajectory

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
ROWS = json.loads((FIXTURES / "verl_rows.json").read_text())
TENSORS = np.load(FIXTURES / "verl_rows.npz")
PARQUET = FIXTURES / "verl_gsm8k_tool_agent_loop.parquet"
LOOP = ROWS["tool_loop"]


def runs(mask):
    """(start, end) of each run of ones."""
    out, start = [], None
    for position, flag in enumerate(list(mask) + [0]):
        if flag and start is None:
            start = position
        elif not flag and start is not None:
            out.append((start, position))
            start = None
    return out


def test_the_fixture_comes_from_verl_and_says_which():
    meta = ROWS["meta"]
    assert meta["verl"] == "0.9.1" and "12ebe0cb4d300c58449fb6c675379e8700015c51" in meta["revision"]
    assert "not installable" in meta["revision"] and "substituted" in meta["video"]
    assert len(LOOP) == 4 and meta["samples"] == 2


def test_verls_tool_loop_rows_import_as_calls_and_re_export_unchanged():
    trajectories = from_verl(LOOP, samples=2)
    assert [(t.session.task.id, t.session.sample) for t in trajectories] == [("0", 0), ("0", 1), ("1", 0), ("1", 1)]
    for row, trajectory in zip(LOOP, trajectories, strict=True):
        session = trajectory.session
        ids = row["prompt_ids"] + row["response_ids"]
        spans = runs([0] * len(row["prompt_ids"]) + row["response_mask"])
        assert len(session.calls) == len(spans) >= 2  # one call per run of sampled ids, tool turns between them
        for call, (start, end) in zip(session.calls, spans, strict=True):
            assert call.prompt_ids == ids[:start] and call.sampled_ids == ids[start:end]
            offset = len(row["prompt_ids"])
            assert call.behavior_log_probs == row["response_logprobs"][start - offset:end - offset]
            assert call.version == row["extra_fields"]["min_global_steps"]
            assert call.finish_reason == "unrecorded"
            np.testing.assert_array_equal(call.routed_experts, np.asarray(row["routed_experts"])[:end])
        assert session.status is Status.COMPLETED and session.reward == row["reward_score"]
        assert trajectory.extras[0] == row["extra_fields"] and not trajectory.described
    assert to_verl(trajectories) == LOOP  # verl's fields and extra_fields written back as verl wrote them
    assert to_verl(from_verl(json.loads(json.dumps(LOOP)), samples=2)) == LOOP


def test_packing_verls_rows_matches_verls_own_tensor_mapping():
    trajectories = from_verl(LOOP, samples=2)
    width = max(len(row["prompt_ids"]) + len(row["response_ids"]) for row in LOOP)
    batch = pack([t.session for t in trajectories], width, rows=len(LOOP))
    attention = TENSORS["batch_attention_mask"].astype(bool)
    for index, row in enumerate(LOOP):
        mapped = {key: TENSORS[f"tool_loop_{index}_{key}"] for key in
                  ("prompts", "responses", "response_mask", "rollout_log_probs", "routed_experts", "rm_scores")}
        prompt, total = len(mapped["prompts"]), len(mapped["prompts"]) + len(mapped["responses"])
        (row_of,) = set(np.nonzero(batch["session_index"] == index)[0].tolist())  # each chain is one row here
        assert (batch["text_segment_ids"][row_of, :total] == 1).all() and (batch["text_segment_ids"][row_of, total:] == 0).all()
        np.testing.assert_array_equal(batch["input_ids"][row_of, :total],
                                      np.concatenate([mapped["prompts"], mapped["responses"]]))
        np.testing.assert_array_equal(batch["response_mask"][row_of, :prompt], 0)
        np.testing.assert_array_equal(batch["response_mask"][row_of, prompt:total], mapped["response_mask"])
        # verl's rollout_log_probs: float32, 0.0 on tool ids, as dew's behaviour column
        np.testing.assert_array_equal(batch["behavior_log_probs"][row_of, prompt:total], mapped["rollout_log_probs"])
        # as_dict aligns routing to every id, zero where the engine recorded nothing; dew marks coverage in routed
        np.testing.assert_array_equal(batch["routed_experts"][row_of, :total], mapped["routed_experts"])
        assert batch["routed"][row_of, : len(row["routed_experts"])].all()
        assert mapped["rm_scores"][-1] == row["reward_score"] and not mapped["rm_scores"][:-1].any()
        # AgentLoopWorker's padded batch: left-padded prompt, right-padded response, positions over real ids
        valid = attention[index]
        np.testing.assert_array_equal(TENSORS["batch_input_ids"][index][valid], batch["input_ids"][row_of, :total])
        np.testing.assert_array_equal(TENSORS["batch_position_ids"][index][valid], batch["text_positions"][row_of, :total])
        np.testing.assert_array_equal(TENSORS["batch_routed_experts"][index][valid], batch["routed_experts"][row_of, :total])
        responses = TENSORS["batch_response_mask"][index]
        assert responses.sum() == batch["response_mask"][row_of].sum()
        np.testing.assert_array_equal(TENSORS["batch_rollout_log_probs"][index][: total - prompt],
                                      batch["behavior_log_probs"][row_of, prompt:total])
        assert TENSORS["batch_rm_scores"][index].sum() == row["reward_score"]
    # one task's two samples share a group: their advantages are opposite when their rewards differ
    rewards = [row["reward_score"] for row in LOOP[:2]]
    advantage = [batch["advantages"][batch["session_index"] == s][0] for s in (0, 1)]
    assert rewards[0] != rewards[1] and math.isclose(advantage[0], -advantage[1], rel_tol=1e-6)


def call(prompt, sampled, version, **extra):
    return Call(prompt_ids=list(prompt), sampled_ids=list(sampled),
                behavior_log_probs=[-0.25 - 0.125 * i for i in range(len(sampled))],
                finish_reason=extra.pop("finish_reason", "stop"), version=version, **extra)


def routing(ids, seed=0):
    return np.random.default_rng(seed).integers(0, 8, (ids, 2, 2)).astype(np.int32)


def dew_sessions():
    shared = routing(40)
    agent = Session(
        task=Task("17", {"task_id": 17, "prompt_ids": [1, 2, 3]}), group=2, sample=1, attempt=1, status=Status.COMPLETED,
        reward=0.75, components={"format": 1.0, "answer": 0.5}, detail="two chains",
        calls=[
            call([1, 2, 3], [4, 5], 3, old_log_probs=[-0.3, -0.4], routed_experts=shared[:5],
                 support=[[4, 9, -1], [5, 6, 7]]),
            call([1, 2, 3, 4, 5, 6, 7], [], 4, finish_reason="cancelled", routed_experts=shared[:7]),  # aborted
            call([1, 2, 3, 4, 5, 6, 7, 8], [9, 10], 4, routed_experts=shared[:10]),
            call([1, 2, 3, 11], [12], 5, finish_reason="length", routed_experts=routing(5, seed=1)),  # a new chain
        ])
    partly_routed = Session(task=Task("18"), group=0, sample=0, attempt=0, status=Status.AGENT_ERROR, reward=-1.0,
                            calls=[call([5, 6], [7], 1, routed_experts=routing(3, seed=2)),
                                   call([5, 6, 7, 8], [9], 2)])
    truncated = Session(task=Task("19"), group=0, sample=1, attempt=0, status=Status.TRUNCATED, reward=None,
                        calls=[call([5, 6], [7, 7, 7], 2, finish_reason="length")])
    cancelled = Session(task=Task("20"), group=0, sample=0, attempt=2, status=Status.CANCELLED,
                        calls=[call([3], [], 0, finish_reason="cancelled")])
    return [agent, partly_routed, truncated, cancelled]


def assert_same_session(restored: Session, original: Session):
    for name in ("task", "group", "sample", "attempt", "status", "reward", "components", "detail"):
        assert getattr(restored, name) == getattr(original, name), name
    assert len(restored.calls) == len(original.calls)
    for ours, theirs in zip(restored.calls, original.calls, strict=True):
        for name in ("prompt_ids", "sampled_ids", "behavior_log_probs", "finish_reason", "version", "old_log_probs",
                     "support"):
            assert getattr(ours, name) == getattr(theirs, name), name
        if theirs.routed_experts is None:
            assert ours.routed_experts is None
        else:
            assert ours.routed_experts.dtype == theirs.routed_experts.dtype
            np.testing.assert_array_equal(ours.routed_experts, theirs.routed_experts)


def test_dew_sessions_round_trip_exactly_through_json_rows():
    sessions = dew_sessions()
    rows = to_verl(sessions)
    assert len(rows) == 5  # the agent session splits into two strict chains; one row per chain
    first, second = rows[0], rows[1]
    assert first["prompt_ids"] == [1, 2, 3] and first["response_ids"] == [4, 5, 6, 7, 8, 9, 10]
    assert first["response_mask"] == [1, 1, 0, 0, 0, 1, 1]
    assert first["response_logprobs"] == [-0.25, -0.375, 0.0, 0.0, 0.0, -0.25, -0.375]
    assert (first["extra_fields"]["min_global_steps"], first["extra_fields"]["max_global_steps"]) == (3, 4)
    assert np.asarray(first["routed_experts"]).shape == (10, 2, 2) and first["reward_score"] == 0.75
    assert second["prompt_ids"] == [1, 2, 3, 11] and second["response_ids"] == [12]
    assert [c["index"] for c in first["extra_fields"]["dew"]["calls"]] == [0, 1, 2]  # the aborted call keeps its place
    assert rows[2]["routed_experts"] is None  # only one of its calls recorded routing
    restored = from_verl(json.loads(json.dumps(rows)))
    assert len(restored) == len(sessions) and all(t.described for t in restored)
    for trajectory, original in zip(restored, sessions, strict=True):
        assert_same_session(trajectory.session, original)
    assert to_verl(restored) == json.loads(json.dumps(rows))
    # what trains is the same either way
    live, back = (pack(s, 16, rows=6, support_capacity=8) for s in (sessions, [t.session for t in restored]))
    assert live.keys() == back.keys() and all(np.array_equal(live[k], back[k]) for k in live)


def test_a_session_without_calls_or_with_unwritable_data_is_refused_by_name():
    empty = Session(task=Task("9"), group=0, sample=3, attempt=0, calls=[], status=Status.INFRA_ERROR)
    with pytest.raises(ValueError, match=r"session \(task '9', group 0, sample 3, attempt 0\) has no calls"):
        to_verl([empty])
    odd = Session(task=Task("9", {"ids": (1, 2)}), group=0, sample=0, attempt=0, calls=[call([1], [2], 0)],
                  status=Status.COMPLETED, reward=1.0)
    with pytest.raises(ValueError, match="task data does not survive JSON unchanged"):
        to_verl([odd])
    with pytest.raises(TypeError, match="to_verl takes Session or VerlTrajectory records, got dict"):
        to_verl([LOOP[0]])


def test_media_rows_are_refused_unless_imported_for_a_round_trip():
    video = ROWS["video"]
    assert video[0]["mm_processor_output"][0]["format"] == "processor_output"  # verl's SGLang video payload
    with pytest.raises(ValueError, match="verl row 0: field 'multi_modal_data' carries media"):
        from_verl(video)
    (trajectory,) = from_verl(video, media=True)
    assert isinstance(trajectory, VerlTrajectory) and trajectory.media
    with pytest.raises(ValueError, match=r"verl rows \[0\] carry media .* round trip only"):
        trajectory.session
    assert to_verl([trajectory]) == video
    np.testing.assert_array_equal(TENSORS["video_0_responses"], video[0]["response_ids"])


def broken(change):
    rows = copy.deepcopy(LOOP)
    change(rows[2])
    return rows


def drop(name):
    return lambda row: row.pop(name)


def setter(name, value):
    return lambda row: row.__setitem__(name, value)


@pytest.mark.parametrize("change, message", [
    (drop("response_logprobs"), "verl row 2: field 'response_logprobs' is missing"),
    (setter("response_logprobs", None), "verl row 2: field 'response_logprobs' is missing"),
    (lambda row: row["extra_fields"].pop("min_global_steps"), "verl row 2: extra_fields.min_global_steps must be"),
    (setter("reward_score", None), "verl row 2: field 'reward_score' is missing"),
    (setter("reward_score", float("nan")), "verl row 2: reward_score must be a finite number"),
    (lambda row: row["response_ids"].__setitem__(4, -3), r"verl row 2: response_ids\[4\] must be a non-negative"),
    (lambda row: row["response_ids"].__setitem__(4, True), r"verl row 2: response_ids\[4\] must be a non-negative"),
    (lambda row: row["response_mask"].pop(), "verl row 2: response_mask must be one 0 or 1 per response id"),
    (lambda row: row["response_mask"].__setitem__(0, 2), "verl row 2: response_mask must be one 0 or 1"),
    (lambda row: row["response_logprobs"].__setitem__(0, float("nan")), r"verl row 2: response_logprobs\[0\] must be"),
    (lambda row: row["response_logprobs"].__setitem__(0, 0.5), "verl row 2, call 0: behavior_log_probs must be finite"),
    (setter("prompt_ids", []), "verl row 2: prompt_ids must hold at least one token id"),
    (setter("responses", [1]), "verl row 2: field 'responses' is AgentLoopOutput.as_dict\\(\\)'s"),
    (setter("tokens", [1]), "verl row 2: field 'tokens' is not an AgentLoopOutput field"),
    (lambda row: row["routed_experts"].append([[0, 0], [0, 0]]), "verl row 2: routed_experts must be integer"),
    (lambda row: row["routed_experts"].__setitem__(0, [[0, 70000], [0, 0]]), "verl row 2: routed_experts holds"),
    (setter("multi_modal_data", {"images": [[0]]}), "verl row 2: field 'multi_modal_data' carries media"),
    (setter("extra_fields", ["min_global_steps"]), "verl row 2: extra_fields must be a mapping"),
])
def test_bad_rows_are_refused_naming_the_row_and_the_field(change, message):
    rows = broken(change)
    with pytest.raises(ValueError, match=message):
        from_verl(rows, samples=2)
    assert len(from_verl(LOOP, samples=2)) == 4  # nothing half-read stays behind


def test_bad_dew_entries_and_groupings_are_refused():
    rows = to_verl(dew_sessions())
    with pytest.raises(ValueError, match=r"3 verl rows do not split into groups of samples=2"):
        from_verl(LOOP[:3], samples=2)
    lost = [rows[0]] + rows[2:]  # the agent session's second chain is missing
    with pytest.raises(ValueError, match=r"verl row 0: extra_fields.dew gives chains \[0\] of 2"):
        from_verl(lost)
    moved = copy.deepcopy(rows)
    moved[0]["extra_fields"]["dew"]["calls"][2]["start"] = 7
    with pytest.raises(ValueError, match="verl row 0: extra_fields.dew.calls do not match response_mask"):
        from_verl(moved)
    disagree = copy.deepcopy(rows)
    disagree[1]["extra_fields"]["dew"]["reward"] = 0.5
    with pytest.raises(ValueError, match="verl row 1: extra_fields.dew.reward disagrees with row 0"):
        from_verl(disagree)
    status = copy.deepcopy(rows)
    status[4]["extra_fields"]["dew"]["status"] = "lost"
    with pytest.raises(ValueError, match="verl row 4: extra_fields.dew.status must be one of"):
        from_verl(status)
    unrewarded = copy.deepcopy(rows)
    unrewarded[2]["reward_score"] = None
    with pytest.raises(ValueError, match="verl row 2: field 'reward_score' is missing"):
        from_verl(unrewarded)  # an AGENT_ERROR session trains on its reward
    with pytest.raises(ValueError, match="samples must be a positive integer"):
        from_verl(LOOP, samples=0)


@pytest.fixture(scope="module")
def qwen3():
    return import_from("tools", "qwen3_vocab").qwen3_tokenizer()


def test_prompts_reads_verls_gsm8k_tool_agent_parquet(qwen3):
    import pyarrow.parquet as pq

    records = pq.read_table(PARQUET).to_pylist()
    assert [r["agent_name"] for r in records] == ["tool_agent"] * 4 and records[0]["ability"] == "math"
    prompts = Prompts(path=PARQUET, tokenizer=qwen3, max_prompt_len=512)
    batch = next(iter(prompts.load(batch=4).train(Partition())))
    assert set(batch) == {"prompt", "prompt_length", "data_source", "ground_truth", "extra_info"}  # ability, agent_name dropped
    by_truth = {utf8_text(batch["ground_truth"][row]): row for row in range(4)}
    assert set(by_truth) == {"72", "10", "5", "624"}
    for record in records:
        row = by_truth[record["reward_model"]["ground_truth"]]
        extra = json.loads(utf8_text(batch["extra_info"][row]))
        assert extra["tools_kwargs"] == {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": record["reward_model"]["ground_truth"]}}}
        assert utf8_text(batch["data_source"][row]) == "openai/gsm8k"
        expected = qwen3.apply_chat_template(record["prompt"], add_generation_prompt=True, tokenize=True)
        expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
        length = int(batch["prompt_length"][row])
        assert batch["prompt"][row, 512 - length:].tolist() == list(expected)


# ----- any session structure round-trips (hypothesis) --------------------------------------------

IDS = st.integers(0, 40)
LOG_PROB = st.floats(-20.0, 0.0, allow_nan=False, width=32)


@st.composite
def sessions_of_any_shape(draw):
    """1-5 calls, each extending the chain (with in-between ids) or starting a new one, possibly sampling nothing;
    optional raw log-probs, supports and router records (consistent over a prefix or not); any status."""
    calls, chain = [], []
    table = np.asarray(draw(st.lists(st.integers(0, 7), min_size=4 * 40, max_size=4 * 40)), np.int16).reshape(40, 2, 2)
    version = draw(st.integers(0, 5))
    for _ in range(draw(st.integers(1, 5))):
        if chain and draw(st.booleans()):
            prompt = chain + draw(st.lists(IDS, max_size=3))
        else:
            prompt = draw(st.lists(IDS, min_size=1, max_size=4))
        sampled = draw(st.lists(IDS, max_size=4))
        extra = {}
        if draw(st.booleans()):
            extra["old_log_probs"] = draw(st.lists(st.floats(-20.0, 0.0, width=32), min_size=len(sampled),
                                                   max_size=len(sampled)))
        if draw(st.booleans()):
            extra["support"] = [draw(st.lists(st.integers(-1, 40), max_size=3)) for _ in sampled]
        routing = draw(st.sampled_from(["none", "shared", "own"]))
        covered = draw(st.integers(0, len(prompt) + len(sampled)))
        if routing == "shared":
            extra["routed_experts"] = table[:covered]
        elif routing == "own":
            extra["routed_experts"] = np.asarray(draw(st.lists(st.integers(0, 7), min_size=4 * covered,
                                                               max_size=4 * covered)), np.int32).reshape(covered, 2, 2)
        version += draw(st.integers(0, 1))
        calls.append(Call(prompt_ids=prompt, sampled_ids=sampled,
                          behavior_log_probs=draw(st.lists(LOG_PROB, min_size=len(sampled), max_size=len(sampled))),
                          finish_reason=draw(st.sampled_from(["stop", "length", "cancelled", "tool_calls"])),
                          version=version, **extra))
        chain = prompt + sampled
    status = draw(st.sampled_from(list(Status)))
    unscored = status in (Status.TRUNCATED, Status.INFRA_ERROR, Status.CANCELLED)
    reward = draw(st.none() | st.floats(-5, 5)) if unscored else draw(st.floats(-5, 5))
    return Session(task=Task(draw(st.text(max_size=6)), {"task_id": draw(st.integers(0, 99))}),
                   group=draw(st.integers(0, 3)), sample=draw(st.integers(0, 3)), attempt=draw(st.integers(0, 2)),
                   calls=calls, status=status, reward=reward,
                   components=draw(st.dictionaries(st.sampled_from(["a", "b"]), st.floats(-1, 1))),
                   detail=draw(st.text(max_size=8)))


@settings(max_examples=300, deadline=None)
@given(st.lists(sessions_of_any_shape(), min_size=1, max_size=3, unique_by=lambda s: (s.task.id, s.group, s.sample,
                                                                                       s.attempt)))
def test_any_session_round_trips_exactly_and_each_sampled_id_is_written_once(sessions):
    rows = to_verl(sessions)
    for row in rows:  # every sampled id once, with its own likelihood; observation ids carry none
        calls = row["extra_fields"]["dew"]["calls"]
        ids = row["prompt_ids"] + row["response_ids"]
        sampled = sum(entry["sampled"] for entry in calls)
        assert sum(row["response_mask"]) == sampled and len(row["response_logprobs"]) == len(row["response_ids"])
        offset = len(row["prompt_ids"])
        for entry in calls:
            call = _owner(sessions, row).calls[entry["index"]]
            span = slice(entry["start"] - offset, entry["start"] - offset + entry["sampled"])
            assert ids[entry["start"]:entry["start"] + entry["sampled"]] == list(call.sampled_ids)
            assert row["response_logprobs"][span] == [float(x) for x in call.behavior_log_probs]
        assert all(lp == 0.0 for lp, m in zip(row["response_logprobs"], row["response_mask"]) if not m)
    restored = from_verl(json.loads(json.dumps(rows)))
    assert len(restored) == len(sessions)
    for trajectory, original in zip(restored, sessions, strict=True):
        assert_same_session(trajectory.session, original)
    assert to_verl(restored) == json.loads(json.dumps(rows))


def _owner(sessions, row) -> Session:
    """The session a dew-written row belongs to."""
    dew = row["extra_fields"]["dew"]
    (owner,) = [s for s in sessions if (s.task.id, s.group, s.sample, s.attempt) ==
                (dew["task"]["id"], dew["group"], dew["sample"], dew["attempt"])]
    return owner
