"""GRPOObjective options and checks, SampledRollout's batch and bad input, and evidence of learning."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew import Dataset, Trainer
from dew.data.prompts import utf8_column
from dew.collection.sampled_rollout import SampledRollout
from dew.objectives.grpo import GRPOObjective
from dew.collection.sampled_rollout import token_text
from dew.sampling import Sampling


def prompt_batch(prompts, ground_truth="7", width=None):
    width = width or max(len(p) for p in prompts)
    ids = np.zeros((len(prompts), width), np.int32)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = p
    return {
        "prompt": ids,
        "prompt_length": np.array([len(p) for p in prompts], np.int32),
        "data_source": utf8_column(["toy"] * len(prompts)),
        "ground_truth": utf8_column([ground_truth] * len(prompts)),
        "extra_info": np.zeros((len(prompts), 0), np.int32),
    }


@pytest.fixture
def variables(tiny_model):
    return jax.jit(tiny_model.init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))


def test_options_are_checked(tiny_model, variables):
    assert GRPOObjective(tiny_model, seq_len=8).ema_decay is None  # beta 0 keeps no reference
    assert GRPOObjective(tiny_model, seq_len=8, beta=0.01).ema_decay == 1.0
    bad = [
        (dict(beta=-1), "beta must be a finite number >= 0"),
        (dict(policy_loss="grpo"), "policy_loss must be one of"),
        (dict(aggregation="seq-mean"), "aggregation must be one of"),
        (dict(dual_clip=1.0), "dual_clip must be a finite number > 1"),
        (dict(behavior_importance=(2.0, 0.5)), "0 < low < high"),
        (dict(sequence_mask=(0.5,)), "sequence_mask must be a \\(low, high\\) pair"),
        (dict(sampling_temperature=0), "sampling_temperature must be a finite number > 0"),
        (dict(ema_decay=0.99), "keeps its reference in the EMA slot"),
        (dict(pretrained={"w": 1}), "full Flax variables mapping"),
    ]
    for options, message in bad:
        with pytest.raises(ValueError, match=message):
            GRPOObjective(tiny_model, seq_len=8, **options)
    with pytest.raises(ValueError, match="exceeds the model's max_seq_len"):
        GRPOObjective(tiny_model, seq_len=64)


def test_rollout_batch_layout(tiny_model, variables):
    objective = GRPOObjective(tiny_model, seq_len=9)
    seen = []

    def reward(data_source, completion, ground_truth, extra_info):
        seen.append((data_source, completion, ground_truth, extra_info))
        return float(ground_truth in completion.split())

    rollout = SampledRollout(objective, reward=reward, groups=3, max_new_tokens=4,
                             sampling=Sampling(eos_id=(1, 2), temperature=1.0))
    batch = rollout(prompt_batch([[3, 4, 5], [6, 7, 8, 9, 10, 11]]), variables, 5, jax.random.key(1))
    assert batch["input_ids"].shape == (6, 10)
    objective.validate(batch)
    for name in ("response_mask", "old_log_probs", "behavior_log_probs", "advantages", "versions", "session_index",
                 "call_index", "text_segment_ids", "text_positions"):
        assert batch[name].shape == (6, 10), name
    assert len(seen) == 6 and all(s[0] == "toy" and s[2] == "7" and s[3] == "" for s in seen)
    for index, (data_source, completion, _, _) in enumerate(seen):
        columns = np.flatnonzero(batch["session_index"] == index)
        row = columns // 10
        assert len(set(row)) == 1
        sampled = batch["input_ids"].ravel()[columns].tolist()
        text_ids = sampled[:-1] if sampled[-1] in (1, 2) else sampled
        assert completion == token_text(text_ids)  # EOS and padding left out of the reward's text
        prompt = [3, 4, 5] if index < 3 else [6, 7, 8, 9, 10, 11]
        r = int(row[0])
        assert batch["input_ids"][r, : len(prompt)].tolist() == prompt  # the prompt without its padding
        assert (batch["versions"].ravel()[columns] == 5).all()
    assert (batch["behavior_log_probs"][batch["response_mask"] == 1] <= 0).all()
    assert set(rollout.metrics) == {"reward/mean", "reward/std", "reward/equal_group_share", "response/length_mean",
                                    "response/length_max", "response/truncated_share", "reward/share_positive",
                                    "response/eos_share", "reward/source/toy"}
    assert rollout.metrics["response/truncated_share"] == pytest.approx(1 - rollout.metrics["response/eos_share"])
    rewards = [float(truth in completion.split()) for _, completion, truth, _ in seen]
    assert rollout.metrics["reward/source/toy"] == rollout.metrics["reward/mean"] == pytest.approx(np.mean(rewards))
    assert rollout.metrics["reward/equal_group_share"] == np.mean([len(set(rewards[:3])) == 1, len(set(rewards[3:])) == 1])
    lengths = [len(np.flatnonzero(batch["session_index"] == i)) for i in range(6)]  # sampled ids of each completion
    assert rollout.metrics["response/length_max"] == max(lengths)


def test_rollout_refuses_bad_input(tiny_model, variables):
    objective = GRPOObjective(tiny_model, seq_len=9)
    good = lambda *args: 1.0  # noqa: E731
    with pytest.raises(ValueError, match="groups must be an integer >= 2"):
        SampledRollout(objective, reward=good, groups=1, max_new_tokens=4)
    with pytest.raises(ValueError, match="needs seq_len >= 10"):
        SampledRollout(objective, reward=good, groups=2, max_new_tokens=5)(
            prompt_batch([[3, 4, 5, 6, 7, 8]]), variables, 0, jax.random.key(0))

    def nan_on_second_row(data_source, completion, ground_truth, extra_info):
        nan_on_second_row.calls += 1
        return float("nan") if nan_on_second_row.calls > 2 else 0.0

    nan_on_second_row.calls = 0
    with pytest.raises(ValueError, match="prompt row 1"):
        SampledRollout(objective, reward=nan_on_second_row, groups=2, max_new_tokens=3)(
            prompt_batch([[3, 4], [5, 6]]), variables, 0, jax.random.key(0))

    def raises(*args):
        raise RuntimeError("verifier down")

    with pytest.raises(ValueError, match="verifier down.*prompt row 0"):
        SampledRollout(objective, reward=raises, groups=2, max_new_tokens=3)(
            prompt_batch([[3, 4]]), variables, 0, jax.random.key(0))

    def bad_decode(ids):
        raise KeyError(ids[0])

    with pytest.raises(ValueError, match="decode failed.*prompt row 0"):
        SampledRollout(objective, reward=good, groups=2, max_new_tokens=3, decode=bad_decode)(
            prompt_batch([[3, 4]]), variables, 0, jax.random.key(0))


def test_missing_or_misaligned_behavior_is_refused(tiny_model, variables):
    objective = GRPOObjective(tiny_model, seq_len=9)
    rollout = SampledRollout(objective, reward=lambda *a: 1.0, groups=2, max_new_tokens=4)
    batch = rollout(prompt_batch([[3, 4, 5]]), variables, 0, jax.random.key(1))
    without = {k: v for k, v in batch.items() if k != "behavior_log_probs"}
    with pytest.raises(KeyError, match="behavior_log_probs"):
        objective.validate(without)
    shifted = dict(batch, behavior_log_probs=np.roll(batch["behavior_log_probs"], 1, axis=1))
    with pytest.raises(ValueError, match="behavior_log_probs is missing or misaligned at row 0"):
        objective.validate(shifted)
    capped = GRPOObjective(tiny_model, seq_len=9, behavior_importance=2.0)
    capped.validate(batch)  # with old_log_probs the cap applies
    bypass = {k: v for k, v in batch.items() if k != "old_log_probs"}
    with pytest.raises(ValueError, match="needs old_log_probs"):
        capped.validate(bypass)
    GRPOObjective(tiny_model, seq_len=9, behavior_importance=(0.5, 2.0)).validate(bypass)  # the band only masks


def test_session_mean_needs_session_index(tiny_model, variables):
    """The session-mean aggregation counts sessions by session_index: a batch without it is refused on the host,
    by name, not as a KeyError inside the jitted loss."""
    session_mean = GRPOObjective(tiny_model, seq_len=9, aggregation="session-mean")
    batch = SampledRollout(session_mean, reward=lambda *a: 1.0, groups=2, max_new_tokens=4)(
        prompt_batch([[3, 4, 5]]), variables, 0, jax.random.key(1))
    session_mean.validate(batch)
    without = {k: v for k, v in batch.items() if k != "session_index"}
    with pytest.raises(ValueError, match="aggregation='session-mean' needs the batch field 'session_index'"):
        session_mean.validate(without)
    GRPOObjective(tiny_model, seq_len=9).validate(without)  # token-mean does not read it


def test_bypass_mode_uses_behavior_as_the_old_policy(tiny_model, variables):
    objective = GRPOObjective(tiny_model, seq_len=9, behavior_importance=(0.8, 1.25), sequence_mask=(0.5, 2.0))
    rollout = SampledRollout(objective, reward=lambda d, c, g, e: float(len(c)), groups=2, max_new_tokens=4)
    batch = rollout(prompt_batch([[3, 4, 5], [6, 7]]), variables, 0, jax.random.key(1))
    bypass = {k: jnp.asarray(v) for k, v in batch.items() if k != "old_log_probs"}
    as_old = dict(bypass, old_log_probs=bypass["behavior_log_probs"])
    plain = GRPOObjective(tiny_model, seq_len=9)
    # Without corrections, bypass mode is the loss with behaviour standing in for old_log_probs.
    np.testing.assert_allclose(plain.loss(variables, None, bypass, None)[0],
                               plain.loss(variables, None, as_old, None)[0], rtol=1e-6)
    _, metrics = objective.loss(variables, None, bypass, None)
    for name in ("removed/behavior_importance", "removed/sequence_mask", "mismatch/kl", "mismatch/k3_kl", "mismatch/ess"):
        assert np.isfinite(float(metrics[name])), name
    # The current policy sampled these ids (temperature 1, no filter), so nothing leaves the band.
    assert float(metrics["removed/behavior_importance"]) == 0.0


def test_validation_scores_prompt_perplexity(tiny_model, variables):
    objective = GRPOObjective(tiny_model, seq_len=9)
    batch = prompt_batch([[3, 4, 5], [6, 7, 8, 9]])
    totals = jax.device_get(jax.jit(objective.evaluate)(variables, batch))
    assert float(totals["prompt_tokens"]) == 2 + 3  # real next-token transitions only
    expected = 0.0
    apply = jax.jit(tiny_model.apply)
    for p in ([3, 4, 5], [6, 7, 8, 9]):
        logits = apply(variables, jnp.asarray([p[:-1]]))
        expected -= float(jax.nn.log_softmax(logits[0])[np.arange(len(p) - 1), p[1:]].sum())
    np.testing.assert_allclose(float(totals["nll_sum"]), expected, rtol=1e-5)
    summary = objective.summarize(totals)
    assert summary["prompt_perplexity"] == pytest.approx(np.exp(expected / 5), rel=1e-5)


@pytest.mark.slow
def test_grpo_raises_the_share_of_rewarded_completions(tiny_model, variables):
    """A toy task: reward completions that contain id 7. The share of sampled completions
    that earn it must rise by at least 0.3 after 30 updates (seeded)."""
    objective = GRPOObjective(tiny_model, seq_len=9, beta=0.01, pretrained=variables)
    rollout = SampledRollout(objective, reward=lambda d, c, g, e: float(g in c.split()), groups=4,
                             max_new_tokens=4, sampling=Sampling(temperature=1.0))
    batch = prompt_batch([[3, 4, 5, 6]] * 8)

    def share(params, seed):
        measured = SampledRollout(objective, reward=rollout.reward, groups=16, max_new_tokens=4)
        measured(batch, params, 0, jax.random.key(seed))
        return measured.metrics["reward/share_positive"]

    data = Dataset(train=lambda partition: itertools.repeat(batch), val=None, records=8, batch=8)
    before = share(variables, 100)
    state = Trainer(objective, optax.adam(3e-2), key=jax.random.key(3), rollout=rollout, progress=False).fit(
        data, steps=30, log_every=30)
    after = share(state.params, 100)
    print(f"share of rewarded completions: {before:.3f} before, {after:.3f} after 30 updates")
    assert after >= before + 0.3, (before, after)
