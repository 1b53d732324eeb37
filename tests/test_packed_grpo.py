"""Packed GRPO equals GRPO over the unmerged chains, one call per row, gradients included."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew import models
from dew.models.packed_attention import SharedPromptRows
from dew.objectives.grpo import GRPOObjective
from dew.records.session_packing import chain_lengths, fitted_layout, pack
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


def _groups():
    """Two tasks, three samples each, every sample of a task drawn from its task's prompt; one sample with a
    second call that extends its chain; and a group whose prompt is a single id (nothing to share)."""
    rng = np.random.default_rng(1)

    def call(prompt, sampled):
        behavior = (-rng.uniform(0.1, 3.0, len(sampled))).tolist()
        old = (np.asarray(behavior) + rng.normal(0, 0.3, len(sampled))).clip(max=0).tolist()
        return Call(prompt, sampled, behavior, "stop", 0, old_log_probs=old)

    x, y = [1, 2, 3, 4, 5], [6, 7, 8]
    first = call(x, [9, 10])
    return [
        Session(Task("x"), 0, 0, 0, [first, call(x + [9, 10, 11], [12, 13])], Status.COMPLETED, reward=1.0),
        Session(Task("x"), 0, 1, 0, [call(x, [14, 15, 16])], Status.COMPLETED, reward=0.0),
        Session(Task("x"), 0, 2, 0, [call(x, [17])], Status.AGENT_ERROR, reward=0.5),
        Session(Task("y"), 1, 0, 0, [call(y, [18, 19, 20, 21])], Status.COMPLETED, reward=2.0),
        Session(Task("y"), 1, 1, 0, [call(y, [22, 23])], Status.COMPLETED, reward=-1.0),
        Session(Task("z"), 2, 0, 0, [call([24], [25, 26])], Status.COMPLETED, reward=1.0),
        Session(Task("z"), 2, 1, 0, [call([24], [27])], Status.COMPLETED, reward=0.0),
    ]


def _by_sampled_id(batch, values):
    """values at the sampled ids, keyed by (session, order of the id within its session)."""
    out, seen = {}, {}
    for row, column in zip(*np.nonzero(batch["response_mask"])):
        session = int(batch["session_index"][row, column])
        order = seen.get(session, 0)
        seen[session] = order + 1
        out[(session, order)] = float(values[row, column])
    return out


def _trains_alike(variables, reference, shared_objective, shared, objective, plain, sampled: int):
    """Every sampled id's log-probability, the loss and its gradients are the same in both batches."""
    mine = _by_sampled_id(shared, np.asarray(jax.jit(shared_objective.packed_log_probs)(variables, shared)))
    theirs = _by_sampled_id(plain, np.asarray(jax.jit(objective.packed_log_probs)(variables, plain)))
    assert mine.keys() == theirs.keys() and len(mine) == sampled
    np.testing.assert_allclose([mine[k] for k in sorted(mine)], [theirs[k] for k in sorted(mine)], atol=1e-5)

    def value_and_grad(objective, batch):
        return jax.jit(jax.value_and_grad(lambda p: objective.loss(p, reference, batch, None), has_aux=True))(variables)

    (shared_loss, shared_metrics), shared_grad = value_and_grad(shared_objective, shared)
    (plain_loss, plain_metrics), plain_grad = value_and_grad(objective, plain)
    assert float(shared_metrics["tokens"]) == float(plain_metrics["tokens"]) == sampled
    np.testing.assert_allclose(shared_loss, plain_loss, rtol=1e-5, atol=1e-6)
    largest = max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(shared_grad), jax.tree.leaves(plain_grad)))
    scale = max(float(jnp.abs(a).max()) for a in jax.tree.leaves(plain_grad))
    assert scale > 1e-4 and largest <= 1e-5 * max(scale, 1.0), (largest, scale)


@pytest.mark.parametrize("options", [dict(), dict(beta=0.1, behavior_importance=2.0),
                                     dict(aggregation="session-mean", policy_loss="cispo")],
                         ids=["ppo", "tis+kl", "session-mean+cispo"])
def test_shared_prompts_score_and_train_exactly_as_the_plain_layout(decoder, options):
    model, variables, reference = decoder
    sessions = _groups()
    layout = SharedPromptRows(prompt=4, continuations=3, length=6)  # x's longest chain: 10 ids, 4 of them shared
    plain = pack(sessions, WIDTH)
    shared = pack(sessions, layout.width, layout=layout)
    # x's three samples share 4 prompt ids (the prompt but its last id), y's two share 2, z's single-id prompt none:
    # a row for x, one for y, and one for each z chain
    assert shared["input_ids"].shape == (4, layout.width)
    assert (shared["text_segment_ids"] > 0).sum() == (plain["text_segment_ids"] > 0).sum() - (2 * 4 + 1 * 2)
    assert shared["text_prefix_segments"].max() > 0
    objective = GRPOObjective(model, seq_len=WIDTH - 1, **options)
    shared_objective = GRPOObjective(model, seq_len=layout.width - 1, layout=layout, **options)
    objective.validate(plain)
    shared_objective.validate(shared)
    _trains_alike(variables, reference, shared_objective, shared, objective, plain, sampled=17)


def test_a_group_whose_samples_overflow_the_slots_takes_another_row_with_its_prompt_again():
    sessions = _groups()[:3]  # x: chains of 10, 8 and 6 ids after a 5-id prompt
    layout = SharedPromptRows(prompt=4, continuations=1, length=6)
    assert chain_lengths(sessions, layout.width, layout=layout) == [layout.width] * 2  # a row each
    batch = pack(sessions, layout.width, layout=layout)
    assert batch["input_ids"].shape == (2, layout.width)
    assert (batch["input_ids"][:, :4] == [1, 2, 3, 4]).all()  # the prompt but its last id, in both rows
    assert (batch["text_prefix_segments"] > 0).sum() == (10 - 4) + (8 - 4) + (6 - 4)
    # the longest continuation fills the first row's slot; the other two share the second row's
    assert sorted(len(set(row[4:][row[4:] > 0])) for row in batch["text_segment_ids"]) == [1, 2]
    with pytest.raises(ValueError, match="a chain of 10 ids .4 of them in a shared prompt., which a slot of 5 ids"):
        pack(sessions, 14, layout=SharedPromptRows(prompt=4, continuations=2, length=5))
    with pytest.raises(ValueError, match="not the shared-prompt layout's width 10"):
        pack(sessions, WIDTH, layout=layout)


def test_proximal_current_equals_a_rescore_under_the_trained_weights(decoder):
    """With one update per batch the rescored old policy is the trained one: skipping the rescore changes nothing."""
    model, variables, reference = decoder
    packed = pack(_sessions(), WIDTH)
    batch = {k: v for k, v in packed.items() if k != "old_log_probs"}
    rescoring = GRPOObjective(model, seq_len=WIDTH - 1, beta=0.05, behavior_importance=2.0)
    current = GRPOObjective(model, seq_len=WIDTH - 1, beta=0.05, behavior_importance=2.0, proximal="current")
    rescored = dict(batch, old_log_probs=np.where(
        batch["response_mask"] != 0, np.asarray(jax.jit(rescoring.packed_log_probs)(variables, batch)), 0.0))
    current.validate(batch)  # a TIS cap without old_log_probs is fine when the proximal policy is the current one
    with pytest.raises(ValueError, match="needs old_log_probs"):
        rescoring.validate(batch)
    results = [jax.jit(jax.value_and_grad(lambda p, b, o=o: o.loss(p, reference, b, None), has_aux=True))(variables, b)
               for o, b in ((rescoring, rescored), (current, batch))]
    ((loss_a, metrics_a), grad_a), ((loss_b, metrics_b), grad_b) = results
    np.testing.assert_allclose(loss_a, loss_b, rtol=1e-6, atol=1e-7)
    for name in ("mismatch/kl", "policy/clipfrac", "kl"):
        np.testing.assert_allclose(metrics_a[name], metrics_b[name], rtol=1e-5, atol=1e-7)
    largest = max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(grad_a), jax.tree.leaves(grad_b)))
    assert largest <= 1e-6 * max(float(jnp.abs(a).max()) for a in jax.tree.leaves(grad_a))
    with pytest.raises(ValueError, match="proximal must be one of"):
        GRPOObjective(model, seq_len=WIDTH - 1, proximal="rescored")


def test_shared_prompts_keep_each_sampled_ids_support(decoder):
    model, variables, _ = decoder
    support = [[[4, 9, 17], [5, 4, -1], [6, 30, 2]], [[7, 8, -1], [2, 3, 5]]]
    sessions = [Session(Task("x"), 0, sample, 0, [Call([1, 2, 3], sampled, [-0.5] * len(sampled), "stop", 0,
                                                       support=kept)], Status.COMPLETED, reward=float(sample))
                for sample, (sampled, kept) in enumerate(zip([[4, 5, 6], [7, 2]], support))]
    objective = GRPOObjective(model, seq_len=WIDTH - 1, sampling_temperature=0.7)
    scores = jax.jit(objective.packed_log_probs)
    layout = SharedPromptRows(prompt=2, continuations=2, length=4)
    plain = pack(sessions, WIDTH, support_capacity=24)
    shared = pack(sessions, layout.width, support_capacity=24, layout=layout)
    assert shared["input_ids"].shape[0] == 1 and (shared["text_prefix_segments"] > 0).any()
    shared_objective = GRPOObjective(model, seq_len=layout.width - 1, sampling_temperature=0.7, layout=layout)
    mine = _by_sampled_id(shared, np.asarray(jax.jit(shared_objective.packed_log_probs)(variables, shared)))
    theirs = _by_sampled_id(plain, np.asarray(scores(variables, plain)))
    np.testing.assert_allclose([mine[k] for k in sorted(theirs)], [theirs[k] for k in sorted(theirs)], atol=1e-5)
    # the recorded support did restrict the normalisation (it is not the full-vocabulary score)
    full = _by_sampled_id(plain, np.asarray(scores(variables, {k: v for k, v in plain.items()
                                                                if not k.startswith("support")})))
    assert max(abs(full[k] - theirs[k]) for k in theirs) > 1e-3


def test_a_batch_of_short_responses_trains_on_shorter_slots_with_the_same_numbers(decoder):
    model, variables, reference = decoder
    model = model.clone(max_seq_len=128)  # rows of the full layout are wider than the fixture's 32 positions
    sessions = _groups()
    full = SharedPromptRows(prompt=4, continuations=3, length=40)  # room for 39 sampled ids after the prompt
    fitted = fitted_layout(sessions, full)
    # x's three continuations (6, 4 and 2 ids: the prompt's last id and the sampled ids) fill one slot of 16, y's two
    # (5 and 3) another; z's prompt is a single id, nothing to share: a row for each of its chains, as in full's rows
    assert fitted == SharedPromptRows(prompt=4, continuations=1, length=16) and fitted.width < full.width
    assert full.with_width(full.width) == full and full.narrower()[-1] == full
    # the layout's 3 slots at 40, 32 or 16 ids, or 1 slot of a multiple of 16 ids: at 48 and 96 ids the same widths
    # as 3 slots of 16 and of 32, which those widths name
    assert [narrower.width for narrower in full.narrower()] == [20, 36, 52, 68, 84, 100, 116, 124]
    assert full.with_width(52) == SharedPromptRows(prompt=4, continuations=3, length=16)
    with pytest.raises(ValueError, match="rows of 23 ids are not 4 prompt ids and 3 slots of at most 40 ids, nor "
                                         "1 slots of a multiple of 16 ids"):
        full.with_width(23)
    objective = GRPOObjective(model, seq_len=full.width - 1, layout=full, beta=0.1, behavior_importance=2.0)
    short, plain = pack(sessions, fitted.width, layout=fitted), pack(sessions, WIDTH)
    objective.validate(short)  # a fitted batch is one of the layout's
    with pytest.raises(ValueError, match="rows of 23 ids are not 4 prompt ids and 3 slots of at most 40 ids"):
        objective.validate(pack(sessions, WIDTH - 1))
    plain_objective = GRPOObjective(model, seq_len=WIDTH - 1, beta=0.1, behavior_importance=2.0)
    mine = _by_sampled_id(short, np.asarray(jax.jit(objective.packed_log_probs)(variables, short)))
    theirs = _by_sampled_id(plain, np.asarray(jax.jit(plain_objective.packed_log_probs)(variables, plain)))
    np.testing.assert_allclose([mine[k] for k in sorted(theirs)], [theirs[k] for k in sorted(theirs)], atol=1e-5)
    loss = lambda o, b: o.loss(variables, reference, b, None)[0]  # noqa: E731
    np.testing.assert_allclose(loss(objective, short), loss(plain_objective, plain), rtol=1e-5, atol=1e-6)


def test_short_continuations_share_longer_slots_in_half_as_many_with_the_same_numbers(decoder):
    model, variables, reference = decoder
    model = model.clone(max_seq_len=256)  # rows of the full layout are wider than the fixture's 32 positions
    rng = np.random.default_rng(2)
    prompt = [1, 2, 3, 4, 5]
    sessions = []
    for sample, sampled in enumerate([39, 20, 10, 5]):
        ids = rng.integers(6, 32, sampled).tolist()
        behavior = -rng.uniform(0.1, 3.0, sampled)
        old = (behavior + rng.normal(0, 0.3, sampled)).clip(max=0).tolist()
        sessions.append(Session(Task("x"), 0, sample, 0, [Call(prompt, ids, behavior.tolist(), "stop", 0,
                                                                old_log_probs=old)], Status.COMPLETED,
                                reward=float(sample % 2)))
    full = SharedPromptRows(prompt=4, continuations=4, length=48)
    fitted = fitted_layout(sessions, full)
    # continuations of 40, 21, 11 and 6 ids (the prompt's last id and the sampled ids): slots of 32 are too short
    # for the first; half the slots, 2 of 48, hold all four (40 + 6 and 21 + 11), narrower than 4 slots of 48
    assert fitted == SharedPromptRows(prompt=4, continuations=2, length=48) and full.with_width(100) == fitted
    short, plain = pack(sessions, fitted.width, layout=fitted), pack(sessions, 48)
    assert short["input_ids"].shape == (1, 100)
    assert [len(set(short["text_segment_ids"][0, 4 + 48 * slot:4 + 48 * (slot + 1)]) - {0}) for slot in (0, 1)] == [2, 2]
    options = dict(beta=0.1, behavior_importance=2.0)
    objective = GRPOObjective(model, seq_len=full.width - 1, layout=full, **options)
    plain_objective = GRPOObjective(model, seq_len=47, **options)
    objective.validate(short)
    _trains_alike(variables, reference, objective, short, plain_objective, plain, sampled=74)
