"""Flow-GRPO: the transition density and KL by hand, the sampler, the rollout's groups and refusals, the objective.

The hand computations write the Flow-GRPO step out in plain Python (no dew code): sigma_t =
a sqrt(t / (1 - t)), mean = x + dt (v + sigma_t^2 / (2t) (x + (1 - t) v)), std = sigma_t
sqrt(-dt), as yifan123/flow_grpo 54809b5 flow_grpo/diffusers_patch/sd3_sde_with_logprob.py has it.
"""

import itertools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import ROOT, finish_workers, launch_workers

from dew import Dataset, Field, InputSpec, Trainer, models, presets
from dew.flow import PatchAutoencoder
from dew.losses.advantages import population_group_advantages
from dew.losses.flow_sde import gaussian_log_density, sde_noise, sde_transition, transition_kl
from dew.objectives import DiffusionObjective
from dew.collection.flow_rollout import FlowRollout
from dew.flow.trajectory import FlowTrajectory, sample_trajectory
from dew.objectives.flow_grpo import FlowGRPOObjective

IMAGE = Field("image", (4, 4, 1))


def tiny_dit(**changes):
    options = dict(output_channels=1, patch_size=2, emb_features=8, num_layers=1, num_heads=2, mlp_ratio=2)
    return models.SimpleDiT(**{**options, **changes})


def brightness(images, batch):
    return images.mean(axis=(1, 2, 3))


def source_batch(rows=2):
    return {"image": np.zeros((rows, 4, 4, 1), np.uint8)}


def nudged(objective, seed=1, scale=0.3):
    """The objective's variables with every weight moved off its zero initialisation (a policy that does something)."""
    variables = objective.init(jax.random.key(0))
    leaves, tree = jax.tree.flatten(variables)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(tree, [leaf + scale * jax.random.normal(k, leaf.shape) for leaf, k in zip(leaves, keys)])


# ----- the math, by hand ---------------------------------------------------------------------------


def test_a_transition_log_density_equals_the_hand_computation():
    a, x, v, t, t_next, drawn = 0.7, 0.5, -0.2, 0.75, 0.5, 0.3
    sigma = a * math.sqrt(t / (1 - t))                       # 0.7 sqrt(3) = 1.2124
    dt = t_next - t                                          # -0.25
    mean = x + dt * (v + sigma**2 / (2 * t) * (x + (1 - t) * v))  # 0.5 - 0.25 (-0.2 + 0.98 * 0.45) = 0.43975
    std = sigma * math.sqrt(-dt)                             # 0.6062
    by_hand = -((drawn - mean) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)
    assert mean == pytest.approx(0.43975, abs=1e-12)

    times = jnp.asarray([1.0, 0.75, 0.5, 0.25, 0.0])
    sigmas = sde_noise(times, a)
    assert float(sigmas[1]) == pytest.approx(sigma, rel=1e-6)
    assert float(sigmas[0]) == pytest.approx(a * math.sqrt(1 / (1 - 0.75)), rel=1e-6)  # t = 1 borrows the grid's 0.75
    got_mean, got_std = sde_transition(jnp.full((1, 2), x), jnp.full((1, 2), v), jnp.asarray([t]), jnp.asarray([t_next]),
                                       sigmas[1:2])
    assert np.asarray(got_mean) == pytest.approx(mean, rel=1e-6) and float(got_std[0]) == pytest.approx(std, rel=1e-6)
    density = gaussian_log_density(jnp.full((1, 2), drawn), got_mean, got_std)
    np.testing.assert_allclose(np.asarray(density), by_hand, rtol=1e-6)
    # with no noise the mean is the ODE step
    ode, ode_std = sde_transition(jnp.full((1, 1), x), jnp.full((1, 1), v), jnp.asarray([t]), jnp.asarray([t_next]),
                                  jnp.zeros(1))
    assert float(ode[0, 0]) == pytest.approx(x + v * dt) and float(ode_std[0]) == 0


def test_transition_kl_is_the_closed_form_gaussian_kl_with_the_elapsed_time_in_the_variance():
    a, t, t_next = 0.7, 0.5, 0.25
    sigma = a * math.sqrt(t / (1 - t))
    rng = np.random.default_rng(0)
    x, v, v_ref = (rng.normal(size=(3, 2, 2, 1)).astype(np.float32) for _ in range(3))
    column = lambda value: jnp.full((3,), value, jnp.float32)  # noqa: E731
    mean, std = sde_transition(jnp.asarray(x), jnp.asarray(v), column(t), column(t_next), column(sigma))
    ref_mean, _ = sde_transition(jnp.asarray(x), jnp.asarray(v_ref), column(t), column(t_next), column(sigma))
    kl = np.asarray(transition_kl(mean, ref_mean, std))
    s = sigma * math.sqrt(t - t_next)  # the transition std: the elapsed time is in the variance
    m1, m2 = np.asarray(mean, np.float64), np.asarray(ref_mean, np.float64)
    # KL(N(m1, s^2) || N(m2, s^2)) = log(s2 / s1) + (s1^2 + (m1 - m2)^2) / (2 s2^2) - 1/2, per coordinate, averaged
    general = (math.log(s / s) + (s**2 + (m1 - m2) ** 2) / (2 * s**2) - 0.5).reshape(3, -1).mean(axis=1)
    np.testing.assert_allclose(kl, general, rtol=1e-5)
    # the paper's velocity form: -dt / 2 (sigma (1 - t) / (2t) + 1 / sigma)^2 mean((v - v_ref)^2)
    dt = t_next - t
    velocity_form = -dt / 2 * (sigma * (1 - t) / (2 * t) + 1 / sigma) ** 2 * ((v - v_ref) ** 2).reshape(3, -1).mean(axis=1)
    np.testing.assert_allclose(kl, velocity_form, rtol=1e-5)
    assert np.all(np.asarray(transition_kl(mean, mean, std)) == 0)


def test_group_advantages_use_the_population_std_in_float64():
    scores = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 5.0, 5.0, 5.0])
    got = population_group_advantages(scores, 4)
    std = math.sqrt(((1 - 2.5) ** 2 + (2 - 2.5) ** 2 + (3 - 2.5) ** 2 + (4 - 2.5) ** 2) / 4)  # ddof 0: 1.1180
    np.testing.assert_allclose(got[:4], [(s - 2.5) / (std + 1e-4) for s in (1, 2, 3, 4)], rtol=1e-15)
    assert np.all(got[4:] == 0) and got.dtype == np.float64
    # differences below float32's resolution still order the samples
    close = np.array([0.5, 0.5 + 1e-12, 0.5 + 2e-12, 0.5 + 3e-12])
    assert np.float32(close[0]) == np.float32(close[3])
    assert np.all(np.diff(population_group_advantages(close, 4)) > 0)
    thirds = np.full(3, 0.1)  # np.mean(thirds) != 0.1: an all-equal group must still give exactly 0
    assert np.all(population_group_advantages(thirds, 3) == 0)
    with pytest.raises(ValueError, match="multiple of groups=4"):
        population_group_advantages(np.zeros(6), 4)


# ----- the sampler ---------------------------------------------------------------------------------


def test_sample_trajectory_records_states_times_joint_densities_and_marks():
    process = presets.Flow()()
    velocity = lambda x, t: -0.5 * x + t.reshape(-1, 1, 1, 1)  # noqa: E731 - any smooth field
    keys = jax.vmap(lambda r: jax.random.fold_in(jax.random.key(3), r))(jnp.arange(3))
    trajectory = sample_trajectory(velocity, process, keys, (2, 2, 1), 5, stochastic=[True, True, False, True])
    assert isinstance(trajectory, FlowTrajectory)
    assert trajectory.states.shape == (3, 5, 2, 2, 1) and trajectory.log_densities.shape == (3, 4)
    np.testing.assert_allclose(np.asarray(trajectory.times), [1, 0.75, 0.5, 0.25, 0])
    assert np.asarray(trajectory.stochastic).tolist() == [True, True, False, True]
    assert np.all(np.asarray(trajectory.log_densities[:, 2]) == 0)  # the deterministic step has no density
    states = np.asarray(trajectory.states, np.float64)
    ode = states[:, 2] + velocity(states[:, 2], np.full(3, 0.5)) * -0.25
    np.testing.assert_allclose(states[:, 3], ode, rtol=1e-5)
    times, sigmas = np.asarray(trajectory.times), np.asarray(trajectory.noise)
    for k in (0, 1, 3):  # each recorded joint density is the sum over coordinates of the step's Gaussian
        t, t_next, s = times[k], times[k + 1], sigmas[k]
        x, v = states[:, k], np.asarray(velocity(states[:, k], np.full(3, t)), np.float64)
        mean = x + (t_next - t) * (v + s**2 / (2 * t) * (x + (1 - t) * v))
        std = s * math.sqrt(t - t_next)
        joint = (-((states[:, k + 1] - mean) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi))
        np.testing.assert_allclose(np.asarray(trajectory.log_densities[:, k]), joint.reshape(3, -1).sum(1), rtol=1e-4)
    # a row's trajectory depends on its key only, not on the rows beside it (up to an ulp of XLA's batching)
    alone = sample_trajectory(velocity, process, keys[1:2], (2, 2, 1), 5, stochastic=[True, True, False, True])
    np.testing.assert_allclose(np.asarray(alone.states[0]), np.asarray(trajectory.states[1]), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="one per transition"):
        sample_trajectory(velocity, process, keys, (2, 2, 1), 5, stochastic=[True])


def test_an_untrained_dit_outputs_zero_and_its_options_are_checked():
    model = tiny_dit()
    variables = model.init(jax.random.key(0), jnp.zeros((1, 4, 4, 1)), jnp.zeros(1))
    assert np.all(np.asarray(model.apply(variables, jnp.ones((2, 4, 4, 1)), jnp.ones(2))) == 0)  # adaLN-Zero
    with pytest.raises(ValueError, match="emb_features"):
        tiny_dit(emb_features=9)
    with pytest.raises(ValueError, match="patch_size"):
        tiny_dit(patch_size=3).init(jax.random.key(0), jnp.zeros((1, 4, 4, 1)), jnp.zeros(1))


# ----- the rollout ---------------------------------------------------------------------------------


def spec_objective(beta=0.01, **changes):
    return FlowGRPOObjective(tiny_dit(), presets.Flow()(), InputSpec(IMAGE), guidance=None, beta=beta, steps=5, **changes)


def test_the_rollout_forms_contiguous_groups_and_selects_the_first_train_steps():
    objective = spec_objective()
    seen = {}

    def reward(images, batch):
        seen["images"], seen["batch"] = images, batch
        return images.mean(axis=(1, 2, 3)).astype(np.float64) + 1e-12 * np.arange(len(images))

    rollout = FlowRollout(objective, reward, groups=4, steps=5, train_steps=2)
    source = {"image": np.zeros((2, 4, 4, 1), np.uint8), "source": np.array([7, 9])}
    out = rollout(source, nudged(objective), 0, jax.random.key(1))
    assert seen["images"].shape == (8, 4, 4, 1) and seen["images"].dtype == np.float32
    assert seen["images"].min() >= -1 and seen["images"].max() <= 1
    assert seen["batch"]["source"].tolist() == [7, 7, 7, 7, 9, 9, 9, 9]  # the repeated source batch
    assert out["states"].shape == out["next_states"].shape == (8, 2, 4, 4, 1)
    np.testing.assert_array_equal(out["next_states"][:, 0], out["states"][:, 1])
    np.testing.assert_allclose(out["times"][0], [1.0, 0.75]) and np.testing.assert_allclose(out["next_times"][0], [0.75, 0.5])
    assert out["rewards"].dtype == np.float64 and out["advantages"].dtype == np.float32
    np.testing.assert_array_equal(out["rewards"], rollout.scores)
    assert json.loads(json.dumps(out["rewards"].tolist())) == out["rewards"].tolist()  # float64 survives JSON
    expected = population_group_advantages(out["rewards"], 4).astype(np.float32)
    np.testing.assert_array_equal(out["advantages"], expected)
    for group in range(2):  # each source row's samples are one group, side by side
        assert abs(float(out["advantages"][group * 4:(group + 1) * 4].sum())) < 1e-5
    assert out["transition_mask"].tolist() == [[1.0, 1.0]] * 8
    # the recorded densities are the policy's own: the first update's ratio is 1
    log_densities, _ = objective.transition_log_densities(nudged(objective), {k: jnp.asarray(v) for k, v in out.items()})
    np.testing.assert_allclose(np.asarray(log_densities), out["log_densities"], atol=2e-5)


def test_zero_advantage_rows_stay_with_their_transition_mask_cleared():
    objective = spec_objective()
    flat_first = lambda images, batch: np.where(np.arange(len(images)) < 4, 0.25, images.mean(axis=(1, 2, 3)))  # noqa: E731
    out = FlowRollout(objective, flat_first, groups=4, steps=5)(source_batch(), nudged(objective), 0, jax.random.key(2))
    assert out["transition_mask"].shape == (8, 4)  # train_steps=None: every transition
    assert np.all(out["transition_mask"][:4] == 0) and np.all(out["advantages"][:4] == 0)
    assert np.all(out["transition_mask"][4:] == 1)


@pytest.mark.parametrize("reward, error, match", [
    (lambda images, batch: np.zeros(3), ValueError, r"one score per sample, shape \(8,\); got shape \(3,\)"),
    (lambda images, batch: np.where(np.arange(8) == 5, np.nan, 0.0), ValueError,
     "nan for sample row 5 \\(source row 1, sample 1\\)"),
    (lambda images, batch: [0.0] * 6 + [np.inf, 0.0], ValueError, "inf for sample row 6"),
    (lambda images, batch: ["good"] * 8, TypeError, "'good' for sample row 0"),
    (lambda images, batch: np.ones(8, bool), TypeError, "True for sample row 0 .source row 0, sample 0.; a score must be a real"),
])
def test_the_rollout_refuses_scores_that_are_not_one_finite_number_per_sample(reward, error, match):
    objective = spec_objective()
    with pytest.raises(error, match=match):
        FlowRollout(objective, reward, groups=4, steps=5)(source_batch(), objective.init(jax.random.key(0)), 0,
                                                          jax.random.key(0))


def test_rollout_and_objective_options_are_checked():
    objective = spec_objective()
    with pytest.raises(ValueError, match="train_steps must be at most the 4 transitions"):
        FlowRollout(objective, brightness, groups=4, steps=5, train_steps=5)
    with pytest.raises(ValueError, match="groups must be an integer >= 2"):
        FlowRollout(objective, brightness, groups=1, steps=5)
    with pytest.raises(ValueError, match="velocity prediction"):
        FlowGRPOObjective(tiny_dit(), presets.Flow(prediction="data")(), InputSpec(IMAGE), beta=0.01, steps=5)
    with pytest.raises(ValueError, match="ema_decay"):
        spec_objective(ema_decay=0.99)
    with pytest.raises(ValueError, match="guidance needs a condition field"):
        FlowGRPOObjective(tiny_dit(), presets.Flow()(), InputSpec(IMAGE), guidance=4.0, steps=5)
    with pytest.raises(KeyError, match="'image'"):
        FlowRollout(objective, brightness, groups=4, steps=5)({"pixels": np.zeros((2, 4, 4, 1), np.uint8)},
                                                              objective.init(jax.random.key(0)), 0, jax.random.key(0))
    assert spec_objective(beta=0.0).ema_decay is None and spec_objective(beta=0.01).ema_decay == 1.0


# ----- the objective in training -------------------------------------------------------------------


def fit(objective, rollout, steps, key=0, batch=None, learning_rate=1e-3):
    batch = source_batch() if batch is None else batch
    data = Dataset(train=lambda partition: itertools.repeat(batch), val=None, records=len(next(iter(batch.values()))),
                   batch=len(next(iter(batch.values()))))
    trainer = Trainer(objective, optax.adam(learning_rate), key=jax.random.key(key), rollout=rollout, progress=False)
    return trainer, trainer.fit(data, steps=steps, log_every=steps)


def test_a_positive_beta_freezes_the_start_and_its_kl_is_transition_kl():
    objective = spec_objective(beta=0.01)
    rollout = FlowRollout(objective, brightness, groups=4, steps=5, train_steps=2)
    trainer, state = fit(objective, rollout, steps=2)
    start = trainer.initial_state()
    for frozen, initial in zip(jax.tree.leaves(state.ema), jax.tree.leaves(start.params), strict=True):
        np.testing.assert_array_equal(np.asarray(frozen), np.asarray(initial))
    assert any(not np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(start.params)))
    # the KL metric on a fresh batch equals transition_kl of the live and frozen means, over the masked transitions
    batch = {k: jnp.asarray(v) for k, v in rollout(source_batch(), state.params, 2, jax.random.key(5)).items()}
    _, metrics = objective.loss(state.params, state.ema, batch, jax.random.key(0))
    _, (x, t, t_next, sigma, _, mean, std) = objective.transition_log_densities(state.params, batch)
    _, (_, _, _, _, _, ref_mean, _) = objective.transition_log_densities(state.ema, batch)
    by_hand = np.asarray(transition_kl(mean, ref_mean, std)).reshape(8, 2)
    mask = np.asarray(batch["transition_mask"])
    assert float(metrics["transition_kl"]) == pytest.approx((by_hand * mask).sum() / mask.sum(), rel=1e-5)
    assert float(metrics["transition_kl"]) > 0
    no_reference = spec_objective(beta=0.0)
    _, state = fit(no_reference, FlowRollout(no_reference, brightness, groups=4, steps=5), steps=1)
    assert state.ema is None


def test_deterministic_and_unselected_transitions_never_reach_the_loss():
    objective = spec_objective(beta=0.0)
    variables = nudged(objective)
    rollout = FlowRollout(objective, brightness, groups=4, steps=5, train_steps=3)
    batch = rollout(source_batch(), variables, 0, jax.random.key(4))
    grad = jax.grad(lambda p, b: objective.loss(p, None, b, jax.random.key(0))[0])
    masked = dict(batch, transition_mask=batch["transition_mask"] * np.array([1.0, 0.0, 1.0], np.float32))
    moved = dict(masked, next_states=masked["next_states"].copy())
    moved["next_states"][:, 1] += 5.0  # a transition with a cleared mark: its draw is irrelevant
    for a, b in zip(jax.tree.leaves(grad(variables, masked)), jax.tree.leaves(grad(variables, moved)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert batch["times"].shape == (8, 3)  # train_steps=3 of the 4 transitions


def test_a_longer_run_raises_the_brightness_of_fresh_samples():
    objective = spec_objective(beta=0.0)
    rollout = FlowRollout(objective, brightness, groups=4, steps=5, train_steps=2)
    trainer, state = fit(objective, rollout, steps=20, batch=source_batch(4), learning_rate=1e-2)
    probe = source_batch(16)
    before = objective.preview(trainer.initial_state().params, probe).mean()
    after = objective.preview(state.params, probe).mean()
    assert after > before + 0.3, (before, after)  # measured: -0.006 -> about 0.99 at 30 updates


def test_diffusion_objective_loss_falls_on_a_toy_set():
    rng = np.random.default_rng(0)
    images = np.where(rng.random((8, 4, 4, 1)) < 0.5, 40, 215).astype(np.uint8)  # two-level pixels
    objective = DiffusionObjective(tiny_dit(emb_features=16), presets.Flow()(), InputSpec(IMAGE), steps=4,
                                   metrics=(lambda samples, batch: {"brightness": samples.mean(axis=(1, 2, 3))},))
    data = Dataset(train=lambda partition: itertools.repeat({"image": images}),
                   val=lambda partition: iter([{"image": images}]), records=8, batch=8)
    trainer = Trainer(objective, optax.adam(3e-3), key=jax.random.key(0), progress=False)
    state = trainer.initial_state()
    first = trainer.evaluate(state, data)
    state = trainer.fit(data, steps=150, log_every=50)
    last = trainer.evaluate(state, data)
    assert last["loss"] < 0.8 * first["loss"], (first, last)
    assert set(last) == {"loss", "samples", "sample/brightness"} and last["samples"] == 8


def test_a_conditioned_run_reads_prompts_with_guidance_and_an_autoencoder():
    vocab = {"bright": 1, "dark": 2, "image": 3}
    inputs = InputSpec(Field("image", (4, 4, 1)), Field("prompt", (3,), "int32"),
                       encoders={"prompt": models.TokenEncoder(vocab_size=4, features=8)},
                       autoencoder=PatchAutoencoder(2), tokenizer=lambda text: [vocab[w] for w in text.split()])
    assert inputs.latent_shape == (2, 2, 4)
    prompts = inputs.tokenize(["bright image", "dark"])
    assert prompts["prompt"].tolist() == [[1, 3, 0], [2, 0, 0]]
    with pytest.raises(ValueError, match="prompt 0 has 4 ids, more than field 'prompt' holds \\(3\\)"):
        inputs.tokenize(["bright bright dark image"])
    model = tiny_dit(output_channels=4, patch_size=1)
    objective = FlowGRPOObjective(model, presets.Flow()(), inputs, guidance=2.0, beta=0.0, steps=4)

    def by_prompt(images, batch):  # "bright" rows want light pixels, the others dark ones
        sign = np.where(batch["prompt"][:, 0] == 1, 1.0, -1.0)
        return sign * images.mean(axis=(1, 2, 3))

    rollout = FlowRollout(objective, by_prompt, groups=2, steps=4)
    out = rollout(prompts, nudged(objective), 0, jax.random.key(0))  # prompt-only: no image field
    assert out["states"].shape == (4, 3, 2, 2, 4) and out["prompt"].tolist() == [[1, 3, 0]] * 2 + [[2, 0, 0]] * 2
    objective.validate(out)
    preview = objective.preview(nudged(objective), prompts)
    assert preview.shape == (2, 4, 4, 1) and preview.min() >= -1 and preview.max() <= 1
    image = np.arange(32, dtype=np.float32).reshape(2, 4, 4, 1)
    np.testing.assert_array_equal(np.asarray(inputs.autoencoder.decode(inputs.autoencoder.encode(image))), image)
    _, state = fit(objective, rollout, steps=2, batch=prompts)
    assert int(state.updates) == 2


@pytest.mark.slow
def test_two_processes_own_their_rows_and_update_as_one_process_holding_two_devices(tmp_path):
    worker = str(ROOT / "tests" / "workers" / "flow_worker.py")
    pair = launch_workers(worker, "pair", tmp_path)
    reference = launch_workers(worker, "reference", tmp_path, processes=(0,),
                               env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
    results = finish_workers(pair + reference)
    for code, output, _ in results:
        assert code == 0, output
    first, second, alone = (json.loads(path.read_text()) for _, _, path in results)
    assert first["calls"] == [8, 8] and second["calls"] == [] and alone["calls"] == [8, 8]  # rewards on rank zero
    for mine, theirs, whole in zip(first["batches"], second["batches"], alone["batches"], strict=True):
        for name, value in whole.items():  # each process holds its own half of the one process's rows
            np.testing.assert_array_equal(np.asarray(mine[name] + theirs[name]), np.asarray(value), err_msg=name)
    # the last batch's scores, float64 bit for bit on both ranks (rank 1's came as bytes), name their source rows
    assert first["score_bits"] + second["score_bits"] == alone["score_bits"]
    assert first["updates"] == second["updates"] == alone["updates"] == 2
    for got in (first, second):
        for a, b in zip(got["params"], alone["params"], strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_validation_samples_with_the_live_policy_and_reports_the_metric_consumers():
    mean_pixel = lambda samples, batch: {"brightness": samples.mean(axis=(1, 2, 3))}  # noqa: E731
    objective = spec_objective(beta=0.01, metrics=(mean_pixel,))
    probe = source_batch(8)
    data = Dataset(train=lambda partition: itertools.repeat(source_batch()), val=lambda partition: iter([probe]),
                   records=2, batch=2)
    trainer = Trainer(objective, optax.adam(1e-2), key=jax.random.key(0), progress=False,
                      rollout=FlowRollout(objective, brightness, groups=4, steps=5, train_steps=2))
    state = trainer.fit(data, steps=3, log_every=3, eval_every=3)
    metrics = trainer.evaluate(state, data)
    assert set(metrics) == {"samples", "sample/brightness"} and metrics["samples"] == 8  # no "ema/": the live policy
    assert metrics["sample/brightness"] == pytest.approx(float(objective.preview(state.params, probe).mean()), abs=1e-6)
    start = objective.preview(trainer.initial_state().params, probe).mean()
    assert metrics["sample/brightness"] != pytest.approx(float(start), abs=1e-6)


def test_a_conditioned_diffusion_objective_trains_with_condition_dropout_and_previews_with_guidance():
    inputs = InputSpec(Field("image", (4, 4, 1)), Field("label", (1,), "int32"),
                       encoders={"label": models.TokenEncoder(vocab_size=3, features=8)})
    objective = DiffusionObjective(tiny_dit(), presets.Flow(time_sampling="logit_normal")(), inputs, steps=3,
                                   guidance=1.5, condition_dropout=0.2)
    images = np.stack([np.full((4, 4, 1), 30, np.uint8), np.full((4, 4, 1), 220, np.uint8)] * 4)
    batch = {"image": images, "label": np.array([[1], [2]] * 4, np.int32)}
    trainer = Trainer(objective, optax.adam(1e-2), key=jax.random.key(0), progress=False)
    state = trainer.fit(Dataset(train=lambda partition: itertools.repeat(batch), batch=8), steps=40, log_every=40)
    dark, light = objective.preview(state.params, {"label": np.array([[1], [2]], np.int32)})
    assert dark.mean() < light.mean()  # the labels steer the samples
    with pytest.raises(KeyError, match="'label'"):
        objective.validate({"image": images})
    with pytest.raises(ValueError, match="condition_dropout needs a condition field"):
        DiffusionObjective(tiny_dit(), presets.Flow()(), InputSpec(IMAGE), condition_dropout=0.1)


def test_the_objective_names_a_missing_misshapen_or_non_finite_batch_field():
    objective = spec_objective()
    batch = FlowRollout(objective, brightness, groups=4, steps=5, train_steps=2)(
        source_batch(), objective.init(jax.random.key(0)), 0, jax.random.key(0))
    objective.validate(batch)
    broken = dict(batch, log_densities=batch["log_densities"].copy())
    broken["log_densities"][3, 1] = np.nan
    with pytest.raises(ValueError, match="'log_densities' holds a non-finite value in row 3"):
        objective.validate(broken)
    with pytest.raises(ValueError, match=r"'next_states' must be \(8, 2, 4, 4, 1\)"):
        objective.validate(dict(batch, next_states=batch["next_states"][:, :1]))
    with pytest.raises(KeyError, match="'advantages'"):
        objective.validate({k: v for k, v in batch.items() if k != "advantages"})
    with pytest.raises(TypeError, match="'image' must be uint8"):
        objective.validate({"image": np.zeros((2, 4, 4, 1), np.float32)})
