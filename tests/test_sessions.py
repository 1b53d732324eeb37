"""pack: merging calls into chains, first-fit rows, status rules, advantages, optional columns."""

import numpy as np
import pytest

from dew.records.session_metrics import session_metrics
from dew.records.session_packing import chain_lengths, pack, rows_needed
from dew.records.session_records import Call, Session, Status, Task


def call(prompt, sampled, version=0, **extra):
    return Call(prompt_ids=prompt, sampled_ids=sampled, behavior_log_probs=[-0.5] * len(sampled),
                finish_reason="stop", version=version, **extra)


def session(calls, task="t", group=0, sample=0, status=Status.COMPLETED, reward=1.0, **extra):
    return Session(task=Task(task), group=group, sample=sample, attempt=0, calls=calls, status=status,
                   reward=reward, **extra)


def test_a_call_joins_the_chain_only_when_its_prompt_holds_the_whole_chain():
    first = call([1, 2, 3], [4, 5], version=3)
    extends = call([1, 2, 3, 4, 5, 6, 7], [8], version=4)  # the chain so far, an observation, one sampled id
    prompt_only = call([1, 2, 3, 9], [10], version=5)  # starts with the prompt but not the sampled ids
    batch = pack([session([first, extends, prompt_only])], width=12)
    assert chain_lengths([session([first, extends, prompt_only])], 12) == [8, 5]
    np.testing.assert_array_equal(batch["input_ids"], [[1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 0], [1, 2, 3, 9, 10, 0, 0, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(batch["response_mask"][0], [0, 0, 0, 1, 1, 0, 0, 1, 0, 0, 0, 0])
    np.testing.assert_array_equal(batch["versions"][0], [-1, -1, -1, 3, 3, -1, -1, 4, -1, -1, -1, -1])
    np.testing.assert_array_equal(batch["call_index"][0], [-1, -1, -1, 0, 0, -1, -1, 1, -1, -1, -1, -1])
    np.testing.assert_array_equal(batch["call_index"][1, :5], [-1, -1, -1, -1, 2])
    np.testing.assert_array_equal(batch["text_positions"][0, :8], np.arange(8))
    np.testing.assert_array_equal(batch["text_segment_ids"][:, :9], [[1] * 8 + [0], [1] * 5 + [0] * 4])
    np.testing.assert_array_equal(batch["session_index"][0, 3:5], [0, 0])
    assert (batch["session_index"][batch["response_mask"] == 0] == -1).all()
    assert batch["behavior_log_probs"][batch["response_mask"] == 1].tolist() == [-0.5] * 4
    assert (batch["behavior_log_probs"][batch["response_mask"] == 0] == 0).all()
    np.testing.assert_allclose(batch["session_weights"][batch["response_mask"] == 1], 0.25)
    assert "old_log_probs" not in batch  # no call reported raw log-probabilities


def test_chains_pack_first_fit_and_rows_are_checked():
    sessions = [session([call([1] * 5, [2])], sample=0), session([call([1] * 2, [2])], sample=1),
                session([call([1] * 3, [2])], sample=2)]
    lengths = chain_lengths(sessions, 8)
    assert lengths == [6, 3, 4] and rows_needed(lengths, 8) == 2
    batch = pack(sessions, width=8)
    assert batch["input_ids"].shape == (2, 8)
    np.testing.assert_array_equal(batch["text_segment_ids"], [[1] * 6 + [0, 0], [1] * 3 + [2] * 4 + [0]])
    np.testing.assert_array_equal(batch["text_positions"][1], [0, 1, 2, 0, 1, 2, 3, 0])
    assert pack(sessions, width=8, rows=4)["input_ids"].shape == (4, 8)
    with pytest.raises(ValueError, match="need 2 rows of width 8; rows=1 is too few"):
        pack(sessions, width=8, rows=1)
    with pytest.raises(ValueError, match="chain of 6 ids, longer than the row width 5"):
        pack(sessions, width=5)


def test_status_rules_and_group_relative_advantages():
    def group(truncated_reward):
        return [
            session([call([1, 2], [3])], sample=0, reward=1.0),
            session([call([1, 2], [4])], sample=1, reward=0.0, status=Status.AGENT_ERROR),
            session([call([1, 2], [5])], sample=2, reward=1.0, status=Status.TRUNCATED),
            session([call([1, 2], [6])], sample=3, reward=None, status=Status.INFRA_ERROR),
            session([call([1, 2], [7])], sample=4, reward=5.0, status=Status.CANCELLED),
        ]

    masked = pack(group(1.0), width=4, truncation="mask")
    assert masked["input_ids"][:, 2].tolist() == [3, 4]  # completed and agent error train; the rest take no rows
    a, b = masked["advantages"][:, 2]
    assert a == pytest.approx(-b) and a > 0  # a two-member group: +-1/sqrt(2)*... centred and scaled
    scored = pack(group(1.0), width=4, truncation="score")
    assert scored["input_ids"][:, 2].tolist() == [3, 4, 5]
    zero = pack(group(1.0), width=4, truncation="zero")
    assert zero["advantages"][2, 2] < 0 < scored["advantages"][2, 2]  # reward 0 instead of the verifier's 1
    means = pack(group(1.0), width=4, truncation="score", estimator="mean")
    np.testing.assert_allclose(means["advantages"][:, 2], [1 / 3, -2 / 3, 1 / 3], atol=1e-6)
    rloo = pack(group(1.0), width=4, truncation="score", estimator="rloo")
    np.testing.assert_allclose(rloo["advantages"][:, 2], [0.5, -1.0, 0.5], atol=1e-6)
    # the advantage covers the whole chain, prompt included
    assert (means["advantages"][0, :3] == means["advantages"][0, 2]).all()


def test_advantages_are_relative_within_task_and_group():
    sessions = [
        session([call([1], [2])], task="a", reward=1.0), session([call([1], [3])], task="a", reward=0.0),
        session([call([1], [4])], task="b", reward=10.0), session([call([1], [5])], task="b", reward=10.0),
        session([call([1], [6])], task="a", group=1, reward=3.0), session([call([1], [7])], task="a", group=1, reward=1.0),
    ]
    advantages = pack(sessions, width=2, estimator="mean")["advantages"][:, 1]
    np.testing.assert_allclose(advantages, [0.5, -0.5, 0.0, 0.0, 1.0, -1.0], atol=1e-6)


def test_old_log_probs_routed_experts_and_support_columns():
    record = np.arange(5 * 2 * 3, dtype=np.int16).reshape(5, 2, 3)
    first = Call([1, 2], [3], [-0.1], "stop", 0, old_log_probs=[-0.2], routed_experts=record[:3],
                 support=[[3, 9, -1]])
    second = Call([1, 2, 3, 4], [5], [-0.3], "stop", 0, old_log_probs=[-0.4], routed_experts=record,
                  support=[[5, 6]])
    batch = pack([session([first, second])], width=6, support_capacity=8)
    np.testing.assert_allclose(batch["old_log_probs"][0], [0, 0, -0.2, 0, -0.4, 0], atol=1e-7)
    assert batch["routed_experts"].shape == (1, 6, 2, 3) and batch["routed_experts"].dtype == np.int16
    np.testing.assert_array_equal(batch["routed_experts"][0, :5], record)  # the later record covers the chain
    assert batch["routed"][0].tolist() == [True] * 5 + [False]
    assert batch["support_ids"][0].tolist() == [3, 9, 5, 6, -1, -1, -1, -1]
    assert batch["support_columns"][0].tolist() == [2, 2, 4, 4, -1, -1, -1, -1]
    with pytest.raises(ValueError, match="support_capacity must be a positive integer"):
        pack([session([first, second])], width=6)
    with pytest.raises(ValueError, match="more than support_capacity=3"):
        pack([session([first, second])], width=6, support_capacity=3)


@pytest.mark.parametrize(
    "bad, message",
    [
        (Call([1, 2], [3, 4], [-0.1], "stop", 0), "1 behavior_log_probs for 2 sampled ids"),
        (Call([], [3], [-0.1], "stop", 0), "prompt_ids must hold at least one token id"),
        (Call([1], [3], [float("nan")], "stop", 0), "finite log-probabilities"),
        (Call([1], [3], [0.5], "stop", 0), "finite log-probabilities"),
        # the one action validator: booleans and negative ids are not token ids, likelihoods must line up
        (Call([1], [True], [-0.1], "stop", 0), r"sampled_ids\[0\] must be a non-negative integer token id \(not a bool\)"),
        (Call([1, -3], [3], [-0.1], "stop", 0), r"prompt_ids\[1\] must be a non-negative integer token id"),
        (Call([1], [3], [-0.1], "stop", 0, old_log_probs=[-0.1, -0.2]), "2 old_log_probs for 1 sampled ids"),
        (Call([1], [3], [-0.1], "stop", 0, old_log_probs=[float("inf")]), "old_log_probs must be finite"),
        (Call([1], [3], ["x"], "stop", 0), r"behavior_log_probs\[0\] must be a number"),
    ],
)
def test_bad_calls_name_the_session(bad, message):
    with pytest.raises(ValueError, match=message) as error:
        pack([session([bad], task="math-7", sample=2)], width=4)
    assert "task 'math-7'" in str(error.value) and "sample 2" in str(error.value)


def test_bad_rewards_and_options_are_refused():
    with pytest.raises(ValueError, match="COMPLETED but its reward is None"):
        pack([session([call([1], [2])], reward=None)], width=4)
    with pytest.raises(ValueError, match="non-finite reward"):
        pack([session([call([1], [2])], reward=float("inf"))], width=4)
    with pytest.raises(ValueError, match="estimator must be one of"):
        pack([], width=4, estimator="ppo")
    with pytest.raises(ValueError, match="truncation must be one of"):
        pack([], width=4, truncation="drop")


def test_session_metrics():
    sessions = [
        session([call([1, 2], [3, 4]), call([1, 2, 3, 4, 5], [6])], reward=1.0, components={"format": 1.0}),
        session([call([1, 2], [7, 8, 9])], sample=1, reward=0.0, components={"format": 0.0}),
        session([call([1, 2], [7])], sample=2, status=Status.INFRA_ERROR, reward=None),
        session([call([1, 2], [7, 7])], sample=3, status=Status.TRUNCATED, reward=1.0),
    ]
    batch = pack(sessions, width=8)
    metrics = session_metrics(sessions, batch, latencies=[1.0, 2.0, 3.0, 10.0], version=2)
    assert metrics["sessions/calls_per_chain"] == 1.5
    assert metrics["masked_share/infra_error"] == pytest.approx(1 / 9)
    assert metrics["masked_share/truncated"] == pytest.approx(2 / 9)
    assert metrics["masked_share/completed"] == 0
    assert metrics["reward/mean"] == 0.5 and metrics["reward/format"] == 0.5
    assert metrics["latency/max"] == 10.0 and metrics["latency/p50"] == 2.5
    assert metrics["version_lag/mean"] == 2.0 and metrics["version_lag/max"] == 2.0


def test_the_action_validator_checks_eos_for_callers_that_know_it():
    from dew.records.actions import check_action

    assert check_action("turn", [1, 2], [3, 0], [-0.1, -0.2], eos=True, eos_ids=(0,)) == ((1, 2), (3, 0))
    with pytest.raises(ValueError, match="sampled id 0 is an EOS id \\(0\\) with 1 id\\(s\\) after it"):
        check_action("turn", [1], [0, 3], [-0.1, -0.2], eos_ids=(0,))
    with pytest.raises(ValueError, match="says eos=False but the sampled ids end with an EOS id"):
        check_action("turn", [1], [3, 0], [-0.1, -0.2], eos=False, eos_ids=(0,))
    with pytest.raises(ValueError, match="says eos=True but the sampled ids do not end"):
        check_action("turn", [1], [3], [-0.1], eos=True, eos_ids=(0,))
    with pytest.raises(ValueError, match="the termination flag must be a bool"):
        check_action("turn", [1], [3], [-0.1], eos=1, eos_ids=(0,))
