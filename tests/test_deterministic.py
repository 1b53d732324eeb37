"""RolloutScheduler(deterministic=True) over Server(batch_invariant=True): two asynchronous runs of one seed train the
same batches to the same parameters, bit for bit, although their draws finish in a different order each time (the
reward sleeps a random while before it answers). The records (dew.update_record) are compared digest by digest."""

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import jax
import optax
import pytest
from conftest import ROOT

from dew import Dataset, Trainer
from dew.collection.scheduler import RolloutScheduler
from dew.collection.sources import PromptSource
from dew.collection.tasks import prompt_tasks
from dew.inference import NativeRolloutServer, Server, ServingTask
from dew.objectives.grpo import GRPOObjective
from dew.sampling import Sampling
from dew.update_record import UpdateRecord
from test_rollout_scheduler import toy_prompts

WIDTH = 16
STEPS = 5
jitter = random.Random()  # unseeded: each run's draws finish in their own order


def reward(data_source, text, ground_truth, extra) -> float:
    time.sleep(jitter.random() * 0.02)
    return float(len(text.split()) % 2)


def run(model, served, record, deterministic: bool = True):
    serving = ServingTask(model, served, Sampling(eos_id=tuple(range(16)), temperature=1.0, top_k=8),
                          batch_invariant=deterministic)
    with NativeRolloutServer(Server.from_task(serving, slots=4, capacity=64), version=-1) as server, \
            PromptSource(server, reward, max_new_tokens=4, eos_ids=tuple(range(16)), workers=3) as source:
        objective = GRPOObjective(model, seq_len=WIDTH - 1, pretrained=served, behavior_importance=2.0)
        scheduler = RolloutScheduler(objective, source, server, width=WIDTH, rows=4, tasks=prompt_tasks, groups=2,
                                     max_lag=1, ahead=1, deterministic=deterministic)
        trainer = Trainer(objective, optax.adam(3e-3), key=jax.random.key(0), rollout=scheduler, progress=False,
                          record=record)
        trainer.fit(scheduler.tasks(Dataset(train=lambda partition: toy_prompts())), steps=STEPS, log_every=STEPS)
        scheduler.close()
    return [(step.step, step.updates, step.batch is None, step.params_digest,
             None if step.batch is None else {name: value.tobytes() for name, value in step.batch.items()})
            for step in UpdateRecord(record).steps()]


def test_two_deterministic_asynchronous_runs_train_the_same_bits(sharp_decoder, tmp_path):
    model, served = sharp_decoder
    first, second = run(model, served, tmp_path / "a"), run(model, served, tmp_path / "b")
    assert len(first) == STEPS and any(not skipped for _, _, skipped, _, _ in first)
    for one, other in zip(first, second, strict=True):
        assert one == other, f"step {one[0]} differs"


# How long, never what; and "verdicts", the sandbox verdicts returned since the previous update, which counts how many
# of the next batch's programs (drawn ahead) had finished by the time this update ended; "train/record/bytes", the size
# of a step's record, whose metadata writes that step's timings as JSON numbers (0.5 and 0.123456 differ in length).
TIMING = ("wall", "waited", "rollout/latency/", "train/record/seconds", "train/record/bytes", "train/seconds/",
          "scheduler/push_seconds", "verdicts")


@pytest.mark.ray
@pytest.mark.slow
def test_dew_ray_rlvr_with_deterministic_runs_twice_to_the_same_metrics_policy_and_record(tmp_path):
    """`dew-ray rlvr --set deterministic=true`, asynchronous (a batch drawn ahead under the older weights), twice
    from nothing (warm start included): the same metrics.jsonl but for how long things took, the same held-out
    curve, the same record digest by digest and the same final policy, byte for byte."""
    options = ["steps=4", "sft_steps=80", "sft_errors=0", "tasks_per_step=2", "samples=4", "max_new_tokens=40",
               "eval_tasks=4", "eval_samples=1", "train_tasks=100", "runner=process", "progress=false",
               "deterministic=true"]
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    runs = [tmp_path / "first", tmp_path / "second"]
    for run_dir in runs:
        ran = subprocess.run([str(Path(sys.executable).parent / "dew-ray"), "rlvr", f"--run-dir={run_dir}",
                              *[f"--set={item}" for item in options]], env=env, cwd=ROOT, capture_output=True,
                             text=True, timeout=600)
        assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]

    def rows(run_dir):
        return [{key: value for key, value in json.loads(line).items() if not key.startswith(TIMING)}
                for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

    first, second = (rows(run_dir) for run_dir in runs)
    assert len(first) == 4 and any(row["train/loss"] != 0 for row in first)  # the updates moved the policy
    assert any(row["scheduler/oldest_version"] < row["scheduler/version"] for row in first)  # drawn ahead
    assert first == second
    held = [(run_dir / "held_out.jsonl").read_text() for run_dir in runs]
    assert held[0] == held[1]
    records = [[(s.step, s.params_digest, None if s.batch is None else sorted((k, v.tobytes()) for k, v in
                                                                               s.batch.items()))
                for s in UpdateRecord(run_dir / "record").steps()] for run_dir in runs]
    assert records[0] == records[1]
    policies = [(run_dir / "policy" / "model.safetensors").read_bytes() for run_dir in runs]
    assert policies[0] == policies[1]
