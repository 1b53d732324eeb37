"""PPO with a critic: verl parity of GAE, the losses and parameter gradients; the objective, the rollout, learning.

The fixture comes from tools/parity_ppo.py (verl 0.9.1's compute_gae_advantage_return,
compute_policy_loss_vanilla, compute_value_loss and low_var_kl, torch autograd through a
linear policy and critic); this file never imports torch or verl. ``TokenFeatures`` is
the critic backbone the spec's PPO example imports.
"""

import itertools
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import ROOT
from test_tool_episodes import EOS, SAMPLING, VOCAB, Harness, Scripted, ToolPolicy, square_then_answer, tasks, verify

from dew import Trainer
from dew.collection.ppo_rollout import episode_gae
from dew.data import Dataset
from dew.inference.generation import Generation
from dew.losses import policy as losses
from dew.losses.gae import gae, masked_whiten
from dew.losses.value_loss import clipped_value_loss
from dew.collection.episode_rollout import EpisodeRollout
from dew.collection.ppo_rollout import PPORollout
from dew.objectives.ppo import PPOObjective, ValueHead
from dew.replay import replay
from dew.update_record import UpdateRecord, params_digest

FIXTURE = np.load(ROOT / "tests" / "fixtures" / "verl_ppo.npz")
META = json.loads(str(FIXTURE["meta"]))


class TokenFeatures(nn.Module):
    """Trainable features of each id: the critic's backbone in the spec's example (no attention, no context)."""

    features: int = 8

    @nn.compact
    def __call__(self, ids, segment_ids=None, positions=None):
        return nn.Embed(VOCAB, self.features, name="features")(ids)


def objective(**options):
    return PPOObjective(ToolPolicy(), seq_len=10, critic=ValueHead(TokenFeatures()), **options)


# ----- verl parity -------------------------------------------------------------------------------


def composite(policy_weights, critic_weights, value_coefficient=META["value_coefficient"], beta=META["beta"],
              clip=(META["clip_ratio_low"], META["clip_ratio_high"])):
    f = {k: jnp.asarray(FIXTURE[k]) for k in ("features", "actions", "old_log_prob", "ref_log_prob", "values",
                                               "rewards", "mask")}
    raw, returns = gae(f["rewards"], f["values"], f["mask"], META["gamma"], META["lam"])
    advantages = masked_whiten(raw, f["mask"])
    log_prob = jnp.take_along_axis(jax.nn.log_softmax(f["features"] @ policy_weights), f["actions"][..., None], -1)[..., 0]
    per_token, _ = losses.ppo_surrogate(log_prob, f["old_log_prob"], advantages, f["mask"], clip[0], clip[1],
                                        META["clip_ratio_c"])
    pg = losses.aggregate(per_token, f["mask"], "token-mean")
    vf, clipfrac = clipped_value_loss(f["features"] @ critic_weights, returns, f["values"], f["mask"],
                                      META["value_clip"])
    kl = losses.aggregate(losses.k3_kl(log_prob, f["ref_log_prob"]), f["mask"], "token-mean")
    return pg + value_coefficient * vf + beta * kl, {"pg": pg, "vf": vf, "clipfrac": clipfrac, "kl": kl,
                                                     "advantages": advantages, "returns": returns}


def test_gae_losses_and_parameter_gradients_equal_verls():
    assert META["verl"] == "0.9.1" and "d040717" in META["revision"]
    weights, critic = jnp.asarray(FIXTURE["policy_weights"]), jnp.asarray(FIXTURE["critic_weights"])
    (loss, parts), (grad_policy, grad_critic) = jax.value_and_grad(composite, argnums=(0, 1), has_aux=True)(
        weights, critic)
    mask = FIXTURE["mask"] != 0
    differences = {
        "GAE advantages": float(np.abs(np.asarray(parts["advantages"]) - FIXTURE["advantages"])[mask].max()),
        "returns": float(np.abs(np.asarray(parts["returns"]) - FIXTURE["returns"])[mask].max()),
        "policy loss": abs(float(parts["pg"]) - float(FIXTURE["pg_loss"])),
        "value loss": abs(float(parts["vf"]) - float(FIXTURE["vf_loss"])),
        "kl": abs(float(parts["kl"]) - float(FIXTURE["kl"])),
        "composite loss": abs(float(loss) - float(FIXTURE["composite"])),
        "parameter gradients": max(float(np.abs(np.asarray(grad_policy) - FIXTURE["grad_policy"]).max()),
                                   float(np.abs(np.asarray(grad_critic) - FIXTURE["grad_critic"]).max())),
    }
    print(json.dumps(differences, indent=1))
    assert all(value < 1e-6 for value in differences.values()), differences
    assert float(parts["clipfrac"]) == pytest.approx(float(FIXTURE["vf_clipfrac"]), abs=1e-7)


@pytest.mark.parametrize("removed", ["critic", "kl", "clipping"])
def test_removing_a_term_breaks_the_composite_comparison(removed):
    weights, critic = jnp.asarray(FIXTURE["policy_weights"]), jnp.asarray(FIXTURE["critic_weights"])
    options = {"critic": {"value_coefficient": 0.0}, "kl": {"beta": 0.0}, "clipping": {"clip": (1e6, 1e6)}}[removed]
    loss, _ = composite(weights, critic, **options)
    assert abs(float(loss) - float(FIXTURE["composite"])) > 100 * 1e-6  # far outside the 1e-6 comparison


def test_gae_skips_observation_ids_and_whitening_needs_two_tokens():
    rewards = jnp.array([[0.0, 0.0, 0.0, 1.0]])
    values = jnp.array([[0.5, 9.0, 0.25, 0.75]])
    mask = jnp.array([[1.0, 0.0, 1.0, 1.0]])  # id 1 is the tool's: its value and TD error never enter
    advantages, returns = gae(rewards, values, mask, 0.9, 0.8)
    last = 1.0 - 0.75
    middle = 0.9 * 0.75 - 0.25 + 0.9 * 0.8 * last
    first = 0.9 * 0.25 - 0.5 + 0.9 * 0.8 * middle
    np.testing.assert_allclose(np.asarray(advantages)[0, [0, 2, 3]], [first, middle, last], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(returns), np.asarray(advantages + values), rtol=1e-6)


# ----- the objective -----------------------------------------------------------------------------


def test_two_subtrees_a_separate_critic_and_a_reference_of_the_policy_only():
    ppo = objective(beta=0.03)
    variables = ppo.init(jax.random.key(0))
    assert set(variables) == {"policy", "critic"}
    assert ppo.reference(variables) is variables["policy"] and ppo.ema_decay == 1.0
    alone = ToolPolicy().init(jax.random.split(jax.random.key(0))[0], jnp.zeros((1, 10), jnp.int32))
    np.testing.assert_array_equal(alone["params"]["embed_tokens"]["embedding"],
                                  variables["policy"]["params"]["embed_tokens"]["embedding"])
    bound = ppo.policy().bind(variables)
    assert bound.variables is variables["policy"]
    with pytest.raises(ValueError, match="a PPO policy binds a tree with a 'policy' subtree"):
        ppo.policy().bind(variables["policy"])


def test_bad_options_critics_and_targets_are_named():
    with pytest.raises(ValueError, match="keeps token-mean aggregation"):
        objective(aggregation="session-mean")
    with pytest.raises(ValueError, match="refuses sequence_mask"):
        objective(sequence_mask=(0.5, 2.0))
    with pytest.raises(TypeError, match="critic must be a Flax module"):
        PPOObjective(ToolPolicy(), seq_len=10, critic=lambda ids: ids)
    ppo = objective()
    episodes = rollout(ppo, Scripted(square_then_answer))
    for name, value in (("gamma", 1.5), ("lam", -0.1)):
        with pytest.raises(ValueError, match=name):
            PPORollout(ppo, episodes, **{name: value})

    class Wide(nn.Module):
        @nn.compact
        def __call__(self, ids, segment_ids=None, positions=None):
            return nn.Dense(2)(nn.Embed(VOCAB, 4)(ids))  # two values per position

    wide = PPOObjective(ToolPolicy(), seq_len=10, critic=Wide())
    batch = prepared(ppo)
    with pytest.raises(ValueError, match="the critic returned values of shape"):
        wide.values(wide.init(jax.random.key(0))["critic"], {k: jnp.asarray(v) for k, v in batch.items()})
    broken = dict(batch)
    broken["returns"] = batch["returns"].copy()
    broken["returns"][0, 2] = np.nan
    with pytest.raises(ValueError, match="returns holds a non-finite value at row 0, column 2"):
        ppo.validate(broken)


def rollout(ppo, policy=None, verifier=verify, **options):
    settings = {"max_prompt_tokens": 8, "max_new_tokens": 3, "max_turns": 3, "groups": 4, "sampling": SAMPLING}
    return EpisodeRollout(policy or ppo.policy(), Harness(), verifier, **{**settings, **options})


def prepared(ppo, variables=None, policy=None, verifier=verify):
    """A PPORollout batch of tasks 0 and 1 (four episodes each) under ``variables`` (default: the start)."""
    variables = ppo.init(jax.random.key(0)) if variables is None else variables
    episodes = rollout(ppo, policy or Scripted(square_then_answer), verifier)
    return PPORollout(ppo, episodes, gamma=0.97, lam=0.9)(tasks(0, 1), variables, 0, jax.random.key(1))


def test_the_prepared_batch_runs_gae_over_each_episode_across_tool_turns():
    ppo = objective()
    variables = ppo.init(jax.random.key(0))
    rewards = iter([1.0, 0.0, 1.0, 0.5, 0.0, 1.0, 1.0, 0.0])
    batch = prepared(ppo, variables, verifier=lambda episode: next(rewards))
    for field in ("old_log_probs", "behavior_log_probs", "response_mask", "old_values", "advantages", "returns"):
        assert batch[field].shape == batch["input_ids"].shape, field
    mask = batch["response_mask"] != 0
    values = np.asarray(ppo.values(variables["critic"], {k: jnp.asarray(v) for k, v in batch.items()}))
    np.testing.assert_allclose(batch["old_values"][mask], values[mask], rtol=1e-6)
    # episode 0: call (SQUARE, EOS), the tool's ids, answer (NUM, EOS): one GAE sequence of four actions
    places = np.argwhere((batch["session_index"] == 0) & mask)
    assert len(places) == 4
    sequence = values[tuple(places.T)]
    raw, returns = gae(jnp.array([[0, 0, 0, 1.0]]), jnp.asarray(sequence)[None], jnp.ones((1, 4)), 0.97, 0.9)
    np.testing.assert_allclose(batch["returns"][tuple(places.T)], np.asarray(returns)[0], rtol=1e-5)
    all_raw, _ = episode_gae(batch, values, {s: r for s, r in zip(range(8), [1.0, 0.0, 1.0, 0.5, 0.0, 1.0, 1.0, 0.0])},
                             0.97, 0.9)
    np.testing.assert_allclose(all_raw[tuple(places.T)], np.asarray(raw)[0], rtol=1e-5)
    whitened = batch["advantages"][mask]
    assert abs(whitened.mean()) < 1e-5 and whitened.std(ddof=1) == pytest.approx(1.0, rel=1e-4)
    assert not batch["advantages"][~mask].any() and not batch["returns"][~mask].any()


def test_cohorts_without_or_with_a_single_trainable_token_make_no_update():
    ppo = objective()
    variables = ppo.init(jax.random.key(0))
    truncating = Scripted(lambda n, c: [2, 2, 2], eos=False)
    assert PPORollout(ppo, rollout(ppo, truncating))(tasks(0), variables, 0, jax.random.key(0)) is None

    class OneToken:
        """Slot 0 answers with a lone EOS; every other slot spends its budget: one action token in all."""

        def bind(self, variables):
            return self

        def __call__(self, contexts, budget, key, sampling):
            rows = len(contexts)
            ids, lengths, eos = np.full((rows, budget), 2, np.int32), np.full(rows, budget, np.int32), np.zeros(rows, bool)
            ids[0, 0], lengths[0], eos[0] = EOS, 1, True
            old = np.where(np.arange(budget)[None] < lengths[:, None], -0.5, 0.0).astype(np.float32)
            return Generation(ids=ids, old_log_probs=old, behavior_log_probs=old, lengths=lengths, eos=eos)

    with pytest.raises(ValueError, match="exactly one trainable action token"):
        PPORollout(ppo, rollout(ppo, OneToken(), max_turns=1))(tasks(0), variables, 0, jax.random.key(0))


def test_two_updates_move_policy_and_critic_lower_the_critic_error_and_keep_the_reference():
    ppo = objective(beta=0.03)
    episodes = rollout(ppo)
    trainer = Trainer(ppo, optax.adam(3e-2), key=jax.random.key(3), rollout=PPORollout(ppo, episodes), progress=False)
    state = trainer.initial_state()
    start = jax.tree.map(np.asarray, state.params)
    reference = jax.tree.map(np.asarray, state.ema)
    data = itertools.repeat(tasks(0, 1, 2))
    errors = []
    for _ in range(2):
        state, metrics = trainer.step(state, next(data))
        assert metrics, "every step of this seed trains"
        errors.append(metrics["value_loss"])
    moved = {name: max(float(np.abs(np.asarray(a) - b).max()) for a, b in
                       zip(jax.tree.leaves(state.params[name]), jax.tree.leaves(start[name])))
             for name in ("policy", "critic")}
    assert moved["policy"] > 0 and moved["critic"] > 0
    for a, b in zip(jax.tree.leaves(state.ema), jax.tree.leaves(reference)):
        np.testing.assert_array_equal(np.asarray(a), b)  # the reference is the start's policy, bit for bit
    # the critic error on one fixed prepared batch falls with the critic's training
    batch = prepared(ppo, start, policy=Scripted(square_then_answer))
    before = value_error(ppo, start["critic"], batch)
    critic = start["critic"]
    gradient = jax.jit(jax.grad(lambda c: value_error(ppo, c, batch)))
    for _ in range(20):
        critic = jax.tree.map(lambda p, g: p - 0.1 * g, critic, gradient(critic))
    assert value_error(ppo, critic, batch) < before


def test_a_recorded_ppo_run_of_tool_episodes_replays_bit_for_bit_without_its_episodes(tmp_path):
    """PPO with a critic over tool episodes, recorded (Trainer(record=...)): dew.replay trains the recorded batches
    again on a Trainer without a rollout and reaches each update's parameters and the checkpoints bit for bit."""
    ppo = objective(beta=0.03)
    trainer = Trainer(ppo, optax.adam(3e-2), key=jax.random.key(3), rollout=PPORollout(ppo, rollout(ppo)),
                      progress=False, output_dir=tmp_path / "out", checkpoint_every=2, record=tmp_path / "record")
    state = trainer.fit(Dataset(train=lambda partition: itertools.repeat(tasks(0, 1, 2))), steps=3, log_every=1)
    recorded = list(UpdateRecord(tmp_path / "record").steps())
    assert {"returns", "old_values", "advantages", "behavior_log_probs"} <= set(recorded[0].batch), sorted(recorded[0].batch)
    assert recorded[-1].params_digest == params_digest(state.params)
    bare = Trainer(ppo, optax.adam(3e-2), key=jax.random.key(3), progress=False)
    report = replay(bare, tmp_path / "record", checkpoints=tmp_path / "out")
    assert report.identical and report.updates == 3 and report.checkpoints == {2: True, 3: True}, report.describe()


def value_error(ppo, critic, batch):
    values = ppo.values(critic, {k: jnp.asarray(v) for k, v in batch.items()})
    mask = jnp.asarray(batch["response_mask"] != 0, jnp.float32)
    return ((values - batch["returns"]) ** 2 * mask).sum() / mask.sum()


def test_targets_kept_as_a_dataset_train_several_ppo_epochs_without_sampling_again():
    ppo = objective()
    variables = ppo.init(jax.random.key(0))
    batch = PPORollout(ppo, rollout(ppo))(tasks(0, 1, 2), variables, 0, jax.random.key(4))
    epochs = Dataset(train=lambda partition: itertools.repeat(batch), val=None, records=None,
                     batch=batch["input_ids"].shape[0])
    trainer = Trainer(ppo, optax.adam(1e-2), key=jax.random.key(0), progress=False)
    state = trainer.fit(epochs, steps=3, log_every=3)
    assert int(state.updates) == 3  # three PPO epochs over one collection's targets


def final_answer_success(ppo, params, key) -> float:
    """The share of 96 sampled episodes (three tasks, 32 each) whose final answer is the right square."""
    probe = EpisodeRollout(ppo.policy(), Harness(), verify, max_prompt_tokens=8, max_new_tokens=3, max_turns=3,
                           groups=32, sampling=SAMPLING)
    return float(np.mean([r.reward or 0.0 for r in probe.collect(tasks(0, 1, 2), params, 0, key)]))


@pytest.mark.slow
def test_ppo_raises_the_final_answer_reward_on_the_square_task():
    """Seeded: 60 PPO updates (adam 5e-3, beta 0.03, 3 tasks x 8 episodes) take the success rate from about 2% up."""
    ppo = objective(beta=0.03)
    episodes = EpisodeRollout(ppo.policy(), Harness(), verify, max_prompt_tokens=8, max_new_tokens=3, max_turns=3,
                              groups=8, sampling=SAMPLING)
    trainer = Trainer(ppo, optax.adam(5e-3), key=jax.random.key(0), rollout=PPORollout(ppo, episodes, lam=0.95),
                      progress=False)
    state = trainer.initial_state()
    before = final_answer_success(ppo, jax.device_get(state.params), jax.random.key(100))
    data = itertools.repeat(tasks(0, 1, 2))
    for _ in range(60):
        state, _ = trainer.step(state, next(data))
    after = final_answer_success(ppo, jax.device_get(state.params), jax.random.key(100))
    print(f"final-answer success {before:.3f} -> {after:.3f} after {int(state.updates)} updates")
    assert before < 0.05 and after > before + 0.15


def test_the_objective_loss_is_the_verl_composite_of_its_parts_on_a_packed_batch():
    ppo = objective(beta=0.03)
    variables = ppo.init(jax.random.key(0))
    batch = {k: jnp.asarray(v) for k, v in prepared(ppo, variables).items()}
    batch["old_log_probs"] = batch["old_log_probs"] + 0.05 * batch["response_mask"]  # some ratios off 1
    reference = jax.tree.map(lambda x: x * 1.01, ppo.reference(variables))
    loss, metrics = ppo.loss(variables, reference, batch, jax.random.key(0))
    mask = (batch["response_mask"][:, 1:] != 0).astype(jnp.float32)
    current = ppo.packed_log_probs(variables["policy"], batch)[:, 1:]
    per_token, _ = losses.ppo_surrogate(current, batch["old_log_probs"][:, 1:], batch["advantages"][:, 1:], mask,
                                        0.2, 0.2, 3.0)
    pg = losses.aggregate(per_token, mask, "token-mean")
    kl = losses.aggregate(losses.k3_kl(current, ppo.packed_log_probs(reference, batch)[:, 1:]), mask, "token-mean")
    vf, _ = clipped_value_loss(ppo.values(variables["critic"], batch)[:, 1:], batch["returns"][:, 1:],
                               batch["old_values"][:, 1:], mask, 0.2)
    np.testing.assert_allclose(float(loss), float(pg + 0.03 * kl + 0.5 * vf), rtol=1e-6)
    assert float(metrics["value_loss"]) == pytest.approx(float(vf), rel=1e-6) and float(kl) > 0
