"""The off-policy arithmetic of asynchronous GRPO, pinned on a two-version history with a model computable by hand.

The model is a bigram table (the logits of the next id are row ``table[id]``), so every
likelihood is ``log_softmax(table[previous])[next]``, written out below in numpy. Rollouts
sampled under version 0 (table T0) and version 1 (T1) reach a trainer holding version 1's
weights, then version 2's. The scheduler must rescore ``old_log_probs`` under the trainer's
weights (the proximal policy, AReaL), keep the engine's ``behavior_log_probs``, write each id's
lag, discard what is more than ``max_lag`` behind; the objective's TIS weight is
``min(exp(old - behavior), cap)`` and ``max_token_lag`` drops the stale ids.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_rollout_scheduler import FakeWeights, ids_batch, make

from dew.losses.policy import lag_shares, token_tis_weights
from dew.objectives.grpo import GRPOObjective
from dew.records.session_records import Call, Session, Status

VOCAB, WIDTH = 6, 8
T0 = np.array([[0, 0, 0, 0, 0, 0], [0, 1, 2, 0, 0, 0], [0, 0, 0, 2, 1, 0], [0, 0, 0, 0, 3, 1],
               [1, 0, 0, 0, 0, 2], [0, 0, 0, 0, 0, 0]], np.float32)
T1 = T0 + np.array([[0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0], [0, 0, 0, 1, -1, 0], [0, 0, 0, 0, 2, -1],
                    [0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]], np.float32)
T2 = T1 * 0.5


class Bigram(nn.Module):
    @nn.compact
    def __call__(self, ids, segment_ids=None, positions=None):
        table = self.param("table", nn.initializers.zeros, (VOCAB, VOCAB))
        return table[ids]


def weights_of(table):
    return {"params": {"table": jnp.asarray(table)}}


def by_hand(table, previous, following):
    """log p(following | previous) = table[p, f] - log(sum_j exp(table[p, j])), in float64."""
    row = np.asarray(table, np.float64)[previous]
    return float(row[following] - np.log(np.exp(row).sum()))


def draw(table, version):
    """One session as an engine holding ``table`` at ``version`` reports it: prompt [1, 2], sampled [3, 4]."""
    behavior = [by_hand(table, 2, 3), by_hand(table, 3, 4)]
    return Call(prompt_ids=[1, 2], sampled_ids=[3, 4], behavior_log_probs=behavior, finish_reason="stop",
                version=version)


def test_rescoring_tis_weights_lags_and_staleness_on_a_two_version_history():
    objective = GRPOObjective(Bigram(), seq_len=WIDTH - 1, behavior_importance=1.5, max_token_lag=0)
    weights = FakeWeights(version=1)
    # task 7's rollouts were drawn under version 0 (one update behind), task 8's under version 1
    history = {"7": (T0, 0), "8": (T1, 1)}

    def plan(task, group, n):
        table, version = history[task.id]
        return Session(task=task, group=group, sample=0, attempt=0, calls=[draw(table, version)],
                       status=Status.COMPLETED, reward=float(n % 2))

    scheduler, _, records = make(objective, plan, weights=weights, max_lag=1)
    batch = scheduler(ids_batch(7, 8), weights_of(T1), 1, None)
    record = records[-1]
    assert record.resubmissions == {} and record.oldest_version == 0 and record.lag == 1
    sampled = np.argwhere(batch["response_mask"] == 1)
    assert len(sampled) == 8  # four sessions (two per task), two sampled ids each
    tis = np.asarray(token_tis_weights(jnp.asarray(batch["old_log_probs"]), jnp.asarray(batch["behavior_log_probs"]),
                                       1.5))
    for row, column in sampled:
        previous, following = batch["input_ids"][row, column - 1], batch["input_ids"][row, column]
        table, version = history[record.sessions[batch["session_index"][row, column]].task.id]
        # old: under the trainer's weights (T1) whatever the rollout was drawn under; behavior: the engine's
        assert batch["old_log_probs"][row, column] == pytest.approx(by_hand(T1, previous, following), abs=1e-6)
        assert batch["behavior_log_probs"][row, column] == pytest.approx(by_hand(table, previous, following), abs=1e-6)
        assert batch["lags"][row, column] == 1 - version
        # TIS: min(exp(old - behavior), cap), by hand
        expected = min(np.exp(by_hand(T1, previous, following) - by_hand(table, previous, following)), 1.5)
        assert tis[row, column] == pytest.approx(expected, abs=1e-5)
    # version 0's first id (2 -> 3) is past the cap; its second (3 -> 4) is not; version 1's ratios are 1
    assert np.exp(by_hand(T1, 2, 3) - by_hand(T0, 2, 3)) > 1.5 > np.exp(by_hand(T1, 3, 4) - by_hand(T0, 3, 4)) > 1
    _, metrics = objective.loss(weights_of(T1), None, {k: jnp.asarray(v) for k, v in batch.items()}, jax.random.key(0))
    assert float(metrics["lag/share_1"]) == pytest.approx(0.5) and float(metrics["lag/share_0"]) == pytest.approx(0.5)
    # the same shares from the host batch, as the RLVR job records them for the bench (4 of 8 ids one behind)
    host = lag_shares(batch["lags"][:, 1:], batch["response_mask"][:, 1:] != 0)
    assert {name: float(share) for name, share in host.items()} == {"0": 0.5, "1": 0.5, "2plus": 0.0}
    assert float(metrics["removed/max_token_lag"]) == pytest.approx(0.5)  # max_token_lag=0 drops task 7's ids
    assert float(metrics["tokens"]) == 4  # two sessions of task 8, two sampled ids each

    # one more update: the trainer holds version 2's weights; version-0 rollouts are 2 > max_lag behind and are
    # discarded and drawn again under the served version
    weights.served = 2
    history["7"] = (T0, 0)

    def replan(task, group, n):
        table, version = history[task.id] if n < 2 else (T2, 2)
        return Session(task=task, group=group, sample=0, attempt=0, calls=[draw(table, version)],
                       status=Status.COMPLETED, reward=float(n % 2))

    scheduler, _, records = make(objective, replan, weights=weights, max_lag=1)
    batch = scheduler(ids_batch(7), weights_of(T2), 2, None)
    assert records[-1].resubmissions == {"stale": 2} and records[-1].oldest_version == 2
    sampled = batch["response_mask"] == 1
    np.testing.assert_allclose(batch["old_log_probs"][sampled], [by_hand(T2, 2, 3), by_hand(T2, 3, 4)] * 2, atol=1e-6)
    np.testing.assert_allclose(batch["behavior_log_probs"][sampled], [by_hand(T2, 2, 3), by_hand(T2, 3, 4)] * 2,
                               atol=1e-6)  # the replacements were drawn under version 2
    assert (batch["lags"][sampled] == 0).all()


def test_token_lag_options_are_checked():
    with pytest.raises(ValueError, match="stale_token_weight needs max_token_lag"):
        GRPOObjective(Bigram(), seq_len=WIDTH - 1, stale_token_weight=0.5)
    with pytest.raises(ValueError, match="max_token_lag must be a non-negative integer"):
        GRPOObjective(Bigram(), seq_len=WIDTH - 1, max_token_lag=-1)
    objective = GRPOObjective(Bigram(), seq_len=WIDTH - 1, max_token_lag=1)
    with pytest.raises(ValueError, match="needs the batch field 'lags'"):
        objective.validate({"input_ids": np.zeros((1, WIDTH), np.int32)})


def test_a_batch_the_token_bound_empties_leaves_the_weights_where_they_are():
    """max_token_lag past every id: zero gradient. Adam would still coast on its momentum; skip_empty_updates holds."""
    import optax

    from dew.optimizers import skip_empty_updates

    objective = GRPOObjective(Bigram(), seq_len=WIDTH - 1, behavior_importance=1.5, max_token_lag=0)
    weights = FakeWeights(version=1)

    def plan(task, group, n):  # every rollout drawn one update behind the trainer's weights
        return Session(task=task, group=group, sample=0, attempt=0, calls=[draw(T0, 0)], status=Status.COMPLETED,
                       reward=float(n % 2))

    scheduler, _, _ = make(objective, plan, weights=weights, max_lag=1)
    batch = {k: jnp.asarray(v) for k, v in scheduler(ids_batch(7, 8), weights_of(T1), 1, None).items()}
    grads, metrics = jax.grad(objective.loss, has_aux=True)(weights_of(T1), None, batch, jax.random.key(0))
    assert float(metrics["removed/max_token_lag"]) == 1.0 and float(metrics["tokens"]) == 0
    assert float(optax.tree.norm(grads)) == 0.0

    params = weights_of(T1)
    real = jax.tree.map(jnp.ones_like, params)  # an earlier update's gradient, which fills Adam's momentum
    for optimizer, moves in ((optax.adam(0.1), True), (skip_empty_updates(optax.adam(0.1)), False)):
        state = optimizer.init(params)
        _, state = optimizer.update(real, state, params)
        updates, after = optimizer.update(grads, state, params)
        # Adam's step on a zero gradient: -lr * m_hat / (sqrt(v_hat) + eps) with m = 0.9 * 0.1 = 0.09, v = 0.999e-3
        coast = -0.1 * (0.09 / (1 - 0.9**2)) / (np.sqrt(0.999e-3 / (1 - 0.999**2)) + 1e-8)
        # rtol: optax's bias correction 1 - 0.999^2 in float32 carries a relative error near 3e-5
        np.testing.assert_allclose(updates["params"]["table"], coast if moves else 0.0, rtol=1e-4)
        if not moves:  # nor does the optimizer state move: the momentum waits for the next real gradient
            for held, before in zip(jax.tree.leaves(after), jax.tree.leaves(state)):
                np.testing.assert_array_equal(held, before)
    # a gradient that is not zero goes through the wrapper exactly as through Adam
    wrapped, plain = skip_empty_updates(optax.adam(0.1)), optax.adam(0.1)
    np.testing.assert_array_equal(wrapped.update(real, wrapped.init(params), params)[0]["params"]["table"],
                                  plain.update(real, plain.init(params), params)[0]["params"]["table"])
