"""Packed GRPO equals GRPO over the unmerged chains, one call per row, gradients included."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew import models
from dew.objectives.grpo import GRPOObjective
from dew.records.session_packing import pack
from dew.records.session_records import Call, Session, Status, Task

WIDTH = 24


@pytest.fixture(scope="module")
def decoder():
    model = models.build("causal_transformer", vocab_size=32, emb_features=32, num_layers=2, num_heads=4,
                         num_kv_heads=2, mlp_features=64, max_seq_len=32)
    variables = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    reference = jax.tree.map(lambda x: x + 0.05 * jnp.sin(jnp.arange(x.size).reshape(x.shape)), variables)
    return model, variables, reference


def _sessions():
    rng = np.random.default_rng(0)

    def call(prompt, sampled):
        behavior = (-rng.uniform(0.1, 3.0, len(sampled))).tolist()
        old = (np.asarray(behavior) + rng.normal(0, 0.3, len(sampled))).clip(max=0).tolist()
        return Call(prompt, sampled, behavior, "stop", 0, old_log_probs=old)

    a1 = call([1, 2, 3], [4, 5, 6])
    a2 = call([1, 2, 3, 4, 5, 6, 7, 8], [9, 10])  # merges: the prompt holds the whole chain
    b1 = call([11, 12], [13, 14, 15, 16])
    c1 = call([1, 2, 3], [20, 21])
    c2 = call([1, 2, 3, 22], [23, 24, 25])  # a prompt-only prefix: a chain of its own
    d1 = call([5, 6, 7, 8, 9], [26])
    return [
        Session(Task("x"), 0, 0, 0, [a1, a2], Status.COMPLETED, reward=1.0),
        Session(Task("x"), 0, 1, 0, [b1], Status.COMPLETED, reward=0.0),
        Session(Task("x"), 0, 2, 0, [c1, c2], Status.AGENT_ERROR, reward=0.5),
        Session(Task("y"), 0, 0, 0, [d1], Status.COMPLETED, reward=2.0),
        Session(Task("y"), 0, 1, 0, [call([5, 6], [7, 8])], Status.COMPLETED, reward=-1.0),
    ]


def _unmerged(sessions, packed):
    """One call per row: its prompt then its sampled ids, with the session's advantage."""
    advantage = {int(s): float(a) for s, a in zip(packed["session_index"][packed["response_mask"] == 1],
                                                 packed["advantages"][packed["response_mask"] == 1])}
    rows = [(number, index, c) for number, s in enumerate(sessions) for index, c in enumerate(s.calls)]
    batch = {name: np.zeros((len(rows), WIDTH), packed[name].dtype) for name in packed}
    for name in ("versions", "session_index", "call_index"):
        batch[name][:] = -1
    for row, (number, index, c) in enumerate(rows):
        ids = list(c.prompt_ids) + list(c.sampled_ids)
        span, sampled = slice(0, len(ids)), slice(len(c.prompt_ids), len(ids))
        batch["input_ids"][row, span] = ids
        batch["text_segment_ids"][row, span] = 1
        batch["text_positions"][row, span] = np.arange(len(ids))
        batch["response_mask"][row, sampled] = 1
        batch["behavior_log_probs"][row, sampled] = c.behavior_log_probs
        batch["old_log_probs"][row, sampled] = c.old_log_probs
        batch["versions"][row, sampled] = 0
        batch["session_index"][row, sampled] = number
        batch["call_index"][row, sampled] = index
        batch["advantages"][row, span] = advantage[number]
        total = sum(len(x.sampled_ids) for x in sessions[number].calls)
        batch["session_weights"][row, sampled] = 1 / total
    return batch


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(aggregation="session-mean", beta=0.1),
        dict(policy_loss="cispo", epsilon_high=0.28),
        dict(behavior_importance=2.0, beta=0.05),
        dict(behavior_importance=(0.5, 2.0), aggregation="session-mean"),
    ],
    ids=["ppo", "session-mean+kl", "cispo", "tis+kl", "icepop"],
)
def test_packed_equals_unmerged_with_gradients(decoder, options):
    model, variables, reference = decoder
    sessions = _sessions()
    packed = pack(sessions, WIDTH)
    assert packed["input_ids"].shape[0] < sum(len(s.calls) for s in sessions)  # chains did merge and share rows
    assert (packed["text_segment_ids"].max(axis=1) > 1).any()
    unmerged = _unmerged(sessions, packed)
    objective = GRPOObjective(model, seq_len=WIDTH - 1, **options)
    for batch in (packed, unmerged):
        objective.validate(batch)

    def loss(params, batch):
        return objective.loss(params, reference, batch, None)

    value_and_grad = jax.jit(jax.value_and_grad(loss, has_aux=True))
    (packed_loss, packed_metrics), packed_grad = value_and_grad(variables, packed)
    (plain_loss, plain_metrics), plain_grad = value_and_grad(variables, unmerged)
    assert float(packed_metrics["tokens"]) == float(plain_metrics["tokens"]) == 17
    np.testing.assert_allclose(packed_loss, plain_loss, rtol=1e-5, atol=1e-6)
    for name in ("mismatch/kl", "mismatch/k3_kl", "mismatch/ess"):
        np.testing.assert_allclose(packed_metrics[name], plain_metrics[name], rtol=1e-5, atol=1e-6)
    largest = max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(packed_grad), jax.tree.leaves(plain_grad)))
    scale = max(float(jnp.abs(a).max()) for a in jax.tree.leaves(plain_grad))
    assert scale > 1e-4 and largest <= 1e-5 * max(scale, 1.0), (largest, scale)


def test_packed_log_probs_score_each_chain_against_its_own_prefix(decoder):
    model, variables, _ = decoder
    packed = pack(_sessions(), WIDTH)
    objective = GRPOObjective(model, seq_len=WIDTH - 1)
    scores = np.asarray(jax.jit(objective.packed_log_probs)(variables, packed))
    apply = jax.jit(model.apply)
    for row in range(packed["input_ids"].shape[0]):
        for segment in range(1, packed["text_segment_ids"][row].max() + 1):
            columns = np.flatnonzero(packed["text_segment_ids"][row] == segment)
            ids = packed["input_ids"][row, columns]
            logits = apply(variables, jnp.asarray(ids[None, :-1]))
            alone = jax.nn.log_softmax(logits[0], axis=-1)[np.arange(len(ids) - 1), ids[1:]]
            np.testing.assert_allclose(scores[row, columns[1:]], alone, atol=1e-5)
            assert scores[row, columns[0]] == 0  # a chain's first id has no prefix


def test_sampling_temperature_scores_over_the_recorded_support(decoder):
    model, variables, _ = decoder
    support = [[4, 9, 17], [5, 4, -1], [6, 30, 2]]  # the ids the sampler kept for each sampled id
    session = Session(Task("x"), 0, 0, 0, [Call([1, 2, 3], [4, 5, 6], [-0.5] * 3, "stop", 0, support=support)],
                      Status.COMPLETED, reward=1.0)
    batch = pack([session], WIDTH, support_capacity=12)
    objective = GRPOObjective(model, seq_len=WIDTH - 1, sampling_temperature=0.7)
    with_support = np.asarray(jax.jit(objective.packed_log_probs)(variables, batch))
    plain = {k: v for k, v in batch.items() if not k.startswith("support")}
    without = np.asarray(jax.jit(objective.packed_log_probs)(variables, plain))
    logits = np.asarray(jax.jit(model.apply)(variables, jnp.asarray([[1, 2, 3, 4, 5]])))[0] / 0.7
    for column, (sampled, kept) in enumerate(zip([4, 5, 6], support, strict=True), start=3):
        row = logits[column - 1]
        full = row[sampled] - np.log(np.exp(row - row.max()).sum()) - row.max()
        kept = [i for i in kept if i >= 0]
        restricted = row[sampled] - np.log(np.exp(row[kept] - row[kept].max()).sum()) - row[kept].max()
        np.testing.assert_allclose(without[0, column], full, atol=1e-5)
        np.testing.assert_allclose(with_support[0, column], restricted, atol=1e-5)


def test_a_registered_policy_loss_trains_without_editing_the_objective(decoder):
    """A surrogate registered by name (verl's register_policy_loss) is what GRPOObjective(policy_loss=name) runs."""
    from dew.losses.policy import POLICY_LOSSES, register_policy_loss

    @register_policy_loss("reinforce-test")
    def reinforce(inputs):  # plain REINFORCE: -A log pi, no ratio and no clip
        return -inputs.advantages * inputs.log_probs, {"mean_log_prob": (inputs.log_probs * inputs.mask).sum()
                                                       / inputs.mask.sum()}

    try:
        model, variables, reference = decoder
        packed = pack(_sessions(), WIDTH)
        objective = GRPOObjective(model, seq_len=WIDTH - 1, policy_loss="reinforce-test")
        objective.validate(packed)
        (loss, metrics), grads = jax.jit(jax.value_and_grad(
            lambda params: objective.loss(params, reference, packed, None), has_aux=True))(variables)
        # Token-mean of -A log pi over the 17 sampled ids, from the objective's own per-id scores.
        current = np.asarray(objective.packed_log_probs(variables, packed))[:, 1:]
        mask = packed["response_mask"][:, 1:] != 0
        expected = -(packed["advantages"][:, 1:] * current)[mask].sum() / mask.sum()
        np.testing.assert_allclose(loss, expected, rtol=1e-5)
        np.testing.assert_allclose(metrics["policy/mean_log_prob"], current[mask].mean(), rtol=1e-5)
        assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads)) > 1e-4
        # the name is taken now: another function under it, or under "ppo", is refused by name
        with pytest.raises(ValueError, match="'reinforce-test' is already registered"):
            register_policy_loss("reinforce-test")(lambda inputs: None)
        with pytest.raises(ValueError, match="'ppo' is already registered"):
            register_policy_loss("ppo")(reinforce)
    finally:
        POLICY_LOSSES.pop("reinforce-test", None)
    with pytest.raises(ValueError, match=r"registered surrogates \['cispo', 'gspo', 'ppo'\], got 'reinforce-test'"):
        GRPOObjective(model, seq_len=WIDTH - 1, policy_loss="reinforce-test")
