import itertools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew import Dataset, Trainer
from dew.data.loading import Loading, RecordStream
from dew.objectives import LMObjective

VOCAB, WIDTH = 16, 9


def random_rows(count, seed=0):
    return {"text": np.random.default_rng(seed).integers(0, VOCAB, (count, WIDTH)).astype(np.int32)}


def repeating(batch, rows=None):
    return Dataset(train=lambda partition: itertools.repeat(batch), val=lambda p: [batch], records=rows, batch=rows)


def changing(rows=4, seed=0):
    """A stream whose batches differ every step and that has no position of its own."""

    def train(partition):
        for index in itertools.count():
            yield random_rows(rows, seed=seed * 1000 + index)

    return Dataset(train=train, val=None, records=None, batch=rows)


def leaves_equal(a, b):
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def objective(model, **options):
    return LMObjective(model, seq_len=WIDTH - 1, **{"ema_decay": None, **options})


def test_step_counts_batches_and_updates_counts_commits(tiny_model):
    trainer = Trainer(objective(tiny_model), optax.adam(1e-2), key=jax.random.key(0), accumulate=3, progress=False)
    state = trainer.fit(changing(), steps=7, log_every=7)
    assert (int(state.step), int(state.updates), int(state.micro)) == (7, 2, 1)


def test_accumulating_two_batches_equals_one_update_on_both(tiny_model):
    # Every row has the same number of targets, so the mean of the two batch means is the mean over both.
    first, second = random_rows(4, seed=1), random_rows(4, seed=2)
    both = {"text": np.concatenate([first["text"], second["text"]])}
    split = Trainer(objective(tiny_model), optax.sgd(0.5), key=jax.random.key(0), accumulate=2, progress=False)
    state = split.initial_state()
    state, _ = split.step(state, first)
    state, _ = split.step(state, second)
    whole = Trainer(objective(tiny_model), optax.sgd(0.5), key=jax.random.key(0), progress=False)
    reference, _ = whole.step(whole.initial_state(), both)
    assert int(state.updates) == 1 and int(state.step) == 2
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(reference.params), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)


def test_rollout_hook_supplies_the_batch_or_skips_the_update(tiny_model):
    calls = []
    train_rows = random_rows(4, seed=3)

    def rollout(batch, variables, version, key):
        calls.append((int(batch["prompt"][0, 0]), version, jax.random.key_data(key).tolist()))
        assert "params" in variables
        if len(calls) % 2 == 0:
            return None  # nothing to train on: the step consumes the batch without an update
        return train_rows

    prompts = Dataset(
        train=lambda partition: ({"prompt": np.full((2, 3), i, np.int32)} for i in itertools.count()), batch=2
    )
    trainer = Trainer(objective(tiny_model), optax.adam(1e-2), key=jax.random.key(0), rollout=rollout, progress=False)
    state = trainer.fit(prompts, steps=5, log_every=5)
    assert (int(state.step), int(state.updates)) == (5, 3)
    assert [c[0] for c in calls] == [0, 1, 2, 3, 4]  # the next data batch each time
    assert [c[1] for c in calls] == [0, 1, 1, 2, 2]  # the policy version: updates committed so far
    assert len({tuple(c[2]) for c in calls}) == 5  # a fresh key each step


def test_moving_ema_follows_its_decay(tiny_model):
    batch = random_rows(4)
    trainer = Trainer(objective(tiny_model, ema_decay=0.25), optax.sgd(0.5), key=jax.random.key(0), progress=False)
    start = jax.device_get(trainer.initial_state().params)
    state, _ = trainer.step(trainer.initial_state(), batch)
    # ema_1 = 0.25 * ema_0 + 0.75 * params_1, with ema_0 = params_0
    expected = jax.tree.map(lambda e, p: 0.25 * e + 0.75 * p, start, jax.device_get(state.params))
    for a, b in zip(jax.tree.leaves(state.ema), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-7, rtol=0)


def test_unit_decay_keeps_a_frozen_copy_and_none_keeps_nothing(tiny_model):
    data = changing()
    frozen = Trainer(objective(tiny_model, ema_decay=1.0), optax.adam(1e-2), key=jax.random.key(0), progress=False)
    start = jax.device_get(frozen.initial_state().params)
    state = frozen.fit(data, steps=3, log_every=3)
    assert leaves_equal(state.ema, start)
    assert not leaves_equal(state.params, start)
    plain = Trainer(objective(tiny_model), optax.adam(1e-2), key=jax.random.key(0), progress=False)
    assert plain.fit(data, steps=1, log_every=1).ema is None


def test_pretrained_tree_stays_usable_after_training(tiny_model):
    pretrained = jax.jit(tiny_model.init)(jax.random.key(5), jnp.zeros((1, 4), jnp.int32))
    copy = jax.device_get(pretrained)
    trainer = Trainer(objective(tiny_model, pretrained=pretrained, ema_decay=1.0), optax.adam(1e-2),
                      key=jax.random.key(0), progress=False)
    state = trainer.fit(changing(), steps=3, log_every=3)
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(pretrained))
    assert leaves_equal(pretrained, copy)
    assert leaves_equal(state.ema, copy)  # the start became the frozen copy


def test_non_finite_loss_names_the_step(tiny_model):
    trainer = Trainer(objective(tiny_model), optax.sgd(float("nan")), key=jax.random.key(0), progress=False)
    with pytest.raises(FloatingPointError, match="loss became nan at step 2"):
        trainer.fit(changing(), steps=5, log_every=1)


@pytest.mark.parametrize("accumulate, stop", [(1, 4), (2, 3)])  # (2, 3): stop inside an accumulation window
def test_resume_from_checkpoint_is_bit_exact(tiny_model, tmp_path, accumulate, stop):
    def trainer(output_dir):
        return Trainer(objective(tiny_model, ema_decay=0.9), optax.adam(1e-2), key=jax.random.key(0),
                       accumulate=accumulate, output_dir=output_dir, checkpoint_every=2 if output_dir else None,
                       progress=False)

    uninterrupted = trainer(None).fit(changing(), steps=7, log_every=7)
    first = trainer(tmp_path).fit(changing(), steps=stop, log_every=7)
    assert int(first.step) == stop
    resumed = trainer(tmp_path).fit(changing(), steps=7, log_every=7)
    assert int(resumed.step) == 7 and int(resumed.updates) == int(uninterrupted.updates)
    assert leaves_equal(resumed.params, uninterrupted.params)
    assert leaves_equal(resumed.opt_state, uninterrupted.opt_state)
    assert leaves_equal(resumed.ema, uninterrupted.ema)


def test_resume_restores_a_stream_position(tiny_model, tmp_path):
    rows = random_rows(32, seed=4)
    data = Dataset(train=lambda partition: RecordStream(rows, 4, 8, Loading(seed=1)), batch=4)

    def fit(output_dir, steps):
        trainer = Trainer(objective(tiny_model), optax.adam(1e-2), key=jax.random.key(0), output_dir=output_dir,
                          progress=False)
        return trainer.fit(data, steps=steps, log_every=steps)

    reference = fit(None, 11)  # crosses an epoch boundary (8 batches per epoch)
    fit(tmp_path, 6)
    position = json.loads((tmp_path / "6" / "data" / "metadata").read_text())
    assert position["stream"] == {"epoch": 0, "batch": 6}
    assert leaves_equal(fit(tmp_path, 11).params, reference.params)


def test_without_output_dir_nothing_is_written(tiny_model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    trainer = Trainer(objective(tiny_model), optax.adam(1e-2), key=jax.random.key(0), progress=False)
    trainer.fit(repeating(random_rows(4), 4), steps=2, log_every=1, eval_every=1)
    assert os.listdir(tmp_path) == []


def test_output_dir_gets_metric_records_and_validation(tiny_model, tmp_path, capsys):
    trainer = Trainer(objective(tiny_model), optax.adam(1e-2), key=jax.random.key(0), output_dir=tmp_path)
    trainer.fit(repeating(random_rows(4), 4), steps=4, log_every=2, eval_every=4)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in records] == [("train", 2), ("train", 4), ("val", 4)]
    assert records[1]["updates"] == 4 and records[1]["loss"] > 0
    assert records[2]["perplexity"] == pytest.approx(np.exp(records[2]["loss"]))
    assert "[train] step 4 | updates 4 | loss" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["4", "metrics.jsonl"]


def test_step_wise_api_with_save_and_restore(tiny_model, tmp_path):
    trainer = Trainer(objective(tiny_model), optax.adam(1e-2), key=jax.random.key(0), progress=False)
    state = trainer.initial_state()
    for index in range(3):
        state, metrics = trainer.step(state, random_rows(4, seed=index))
        assert set(metrics) == {"loss", "target_tokens"}
    trainer.save(state, tmp_path, position={"consumed": 3})
    restored, position = trainer.restore(tmp_path)
    assert position == {"consumed": 3} and int(restored.step) == 3
    assert leaves_equal(restored.params, state.params) and leaves_equal(restored.opt_state, state.opt_state)
    assert np.array_equal(jax.random.key_data(restored.key), jax.random.key_data(state.key))


def test_a_training_run_is_fits_loop_one_batch_at_a_time(tiny_model, tmp_path):
    """Trainer.start: restore-or-start over the stream, step, save; what fit runs and an actor drives."""

    def trainer(output_dir=None):
        return Trainer(objective(tiny_model), optax.adam(1e-2), key=jax.random.key(0), output_dir=output_dir,
                       progress=False)

    reference = trainer().fit(changing(), steps=5, log_every=5)
    with trainer(tmp_path).start(changing()) as run:
        assert not run.restored and run.steps == 0
        for _ in range(3):
            assert set(run.step()) == {"loss", "target_tokens"}
        assert run.save() == 3
    with trainer(tmp_path).start(changing()) as run:  # resumes at the checkpoint, stream position included
        assert run.restored and run.steps == 3 and run.stream.consumed == 3
        run.step()
        run.step()
        assert run.steps == 5 and leaves_equal(run.state.params, reference.params)
    resumed = trainer(tmp_path).fit(changing(), steps=5, log_every=5)  # fit restores the same run's checkpoint
    assert leaves_equal(resumed.params, reference.params)
    with trainer().start(changing()) as run, pytest.raises(ValueError, match="no output_dir to save checkpoints"):
        run.save()
    with pytest.raises(TypeError, match="a training run needs a dew.Dataset"):
        trainer().start([random_rows(4)])


def test_bad_inputs_to_fit_raise(tiny_model):
    trainer = Trainer(objective(tiny_model), optax.adam(1e-2), key=jax.random.key(0), progress=False)
    with pytest.raises(ValueError, match="yielded 4 rows on each of 1 process\\(es\\), but Dataset.batch is 8"):
        trainer.fit(repeating(random_rows(4), 8), steps=1, log_every=1)
    with pytest.raises(TypeError, match="fit needs a dew.Dataset"):
        trainer.fit(itertools.repeat(random_rows(4)), steps=1, log_every=1)
    with pytest.raises(ValueError, match="steps must be a positive integer"):
        trainer.fit(repeating(random_rows(4), 4), steps=0, log_every=1)
    with pytest.raises(RuntimeError, match="ended after 2 batches, before fit reached its step count"):
        trainer.fit(Dataset(train=lambda p: iter([random_rows(4)] * 2)), steps=3, log_every=1)
    with pytest.raises(ValueError, match="has width 5, expected seq_len \\+ 1 = 9"):
        trainer.fit(repeating({"text": np.zeros((4, 5), np.int32)}), steps=1, log_every=1)
    with pytest.raises(TypeError, match="key must be a JAX PRNG key"):
        Trainer(objective(tiny_model), optax.adam(1e-2), key=0)
    with pytest.raises(ValueError, match="accumulate must be a positive integer"):
        Trainer(objective(tiny_model), optax.adam(1e-2), key=jax.random.key(0), accumulate=0)


def test_bfloat16_compute_trains_float32_master_weights():
    from dew import models

    def fit(dtype):
        model = models.build("causal_transformer", vocab_size=VOCAB, emb_features=16, num_layers=1, num_heads=2,
                             mlp_features=32, max_seq_len=16, dtype=dtype)
        trainer = Trainer(objective(model), optax.adam(1e-2), key=jax.random.key(0), progress=False)
        state = trainer.initial_state()
        losses = []
        for index in range(4):
            state, metrics = trainer.step(state, random_rows(4, seed=index))
            losses.append(metrics["loss"])
        return state, losses

    half, half_losses = fit(jnp.bfloat16)
    full, full_losses = fit(jnp.float32)
    assert {leaf.dtype for leaf in jax.tree.leaves(half.params)} == {jnp.dtype(jnp.float32)}
    np.testing.assert_allclose(half_losses, full_losses, atol=2e-2, rtol=0)
