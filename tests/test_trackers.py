"""Experiment trackers: TensorBoard event files and offline W&B runs, read back from disk."""

import json
import shutil
from types import SimpleNamespace

import jax
import numpy as np
import optax
import pytest
import wandb
from tensorboardX import event_file_writer

from dew import Trainer
from dew.experiment_trackers import MetricWriters, TensorBoard, WandB, scalars, trackers_of
from test_trainer import objective, random_rows, repeating
from tracker_files import tensorboard_scalars, wandb_history


def test_fit_writes_tensorboard_events_and_a_wandb_history_beside_metrics_jsonl(tiny_model, tmp_path):
    trainer = Trainer(objective(tiny_model), optax.adam(1e-2), key=jax.random.key(0), output_dir=tmp_path,
                      trackers=["tensorboard", WandB(project="dew-tests", mode="offline")], progress=False)
    trainer.fit(repeating(random_rows(4), 4), steps=4, log_every=2, eval_every=4)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]

    events = tensorboard_scalars(tmp_path / "tensorboard")
    assert events["train/loss"] == [(r["step"], pytest.approx(r["loss"])) for r in train]
    assert events["train/updates"] == [(2, 2.0), (4, 4.0)]
    assert [step for step, _ in events["val/perplexity"]] == [4]

    # wandb-core buffers the run's log in 32 KiB blocks and closes it after finish() returns (finish only informs its
    # service); teardown waits for the service to end, so every record is on disk when the file is read
    wandb.teardown()
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    history = wandb_history(run_file)
    assert [row["_step"] for row in history] == [2, 4]
    assert [row["train/loss"] for row in history] == pytest.approx([r["loss"] for r in train])
    assert history[-1]["val/loss"] == pytest.approx(records[-1]["loss"])
    assert (tmp_path / "wandb-run-id").read_text() in run_file.name


def test_a_resumed_fit_purges_the_tensorboard_points_it_trains_again(tiny_model, tmp_path, monkeypatch):
    # both runs open their event file within one second, as a quick resume does: tensorboardX's own file name
    # (the second and the host) is then the same for both
    monkeypatch.setattr(event_file_writer, "time", SimpleNamespace(time=lambda: 1_800_000_000.25))

    def fit(steps, **options):
        trainer = Trainer(objective(tiny_model), optax.adam(1e-2), key=jax.random.key(0), output_dir=tmp_path,
                          trackers=["tensorboard"], progress=False, **options)
        trainer.fit(repeating(random_rows(4), 4), steps=steps, log_every=1)

    fit(3, checkpoint_every=2)  # checkpoints at 2 and 3
    shutil.rmtree(tmp_path / "3")  # without the last checkpoint the next run resumes at 2 and trains 3 again
    fit(5)
    steps = [step for step, _ in tensorboard_scalars(tmp_path / "tensorboard")["train/loss"]]
    assert steps == [1, 2, 3, 4, 5]
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.1800000000.*"))) == 2


def test_scalars_keep_numbers_and_flatten_mappings():
    record = {"loss": np.float32(0.5), "ok": True, "tasks": [1, 2], "note": "x", "none": None,
              "verdicts": {"correct": 3, "wrong": 1}, "steps": 7}
    assert scalars(record, "train/") == {"train/loss": 0.5, "train/ok": 1.0, "train/verdicts/correct": 3.0,
                                        "train/verdicts/wrong": 1.0, "train/steps": 7.0}


def test_tracker_settings_are_checked(tiny_model, tmp_path):
    with pytest.raises(ValueError, match="unknown tracker 'mlflow'"):
        trackers_of(["mlflow"])
    with pytest.raises(TypeError, match="got the single 'tensorboard': write \\['tensorboard'\\]"):
        trackers_of("tensorboard")
    with pytest.raises(ValueError, match="WandB mode must be 'offline', 'online' or 'disabled', got 'cloud'"):
        WandB(mode="cloud")
    with pytest.raises(ValueError, match="need an output_dir"):
        Trainer(objective(tiny_model), optax.adam(1e-2), key=jax.random.key(0), trackers=["tensorboard"])


def test_a_tracker_that_fails_to_open_closes_the_ones_already_open(tmp_path):
    class Broken:
        def open(self, directory, start_step, config=None):
            raise OSError("no room")

    with pytest.raises(OSError, match="no room"):
        MetricWriters([TensorBoard(), Broken()], tmp_path)
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))  # opened, then closed: the file stays
