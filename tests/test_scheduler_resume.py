"""RolloutScheduler with the Trainer: resuming after a crash mid-batch, and multi-turn environments."""

import itertools
import zlib
from concurrent.futures import Future

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew.inference import WeightPublisher
from test_rollout_sources import EOS, Harness

from dew import Dataset, Trainer
from dew.inference import NativeRolloutServer, Server, ServingTask
from dew.collection.sources import EnvironmentSource
from dew.objectives.grpo import GRPOObjective
from dew.collection.scheduler import RolloutScheduler
from dew.collection.tasks import task_ids
from dew.records.session_records import Call, Session, SessionSource, Status, Task
from dew.sampling import Sampling

WIDTH = 8


class Replayable(SessionSource):
    """Sessions fixed by (task, sample): a rerun of the same tasks gets the same rollouts.

    Each call carries the version ``weights`` serves when it is submitted, as a server would.
    """

    def __init__(self, weights):
        self.weights = weights
        self.submitted: list[str] = []

    def submit(self, task, group, samples):
        futures = []
        for sample in range(samples):
            self.submitted.append(task.id)
            seed = zlib.crc32(f"{task.id}/{sample}".encode())
            ids = [1 + seed % 13, 1 + (seed >> 4) % 13]
            call = Call(prompt_ids=[1, 2], sampled_ids=ids, behavior_log_probs=[-1.5, -2.0], finish_reason="stop",
                        version=self.weights.version)
            future = Future()
            future.set_result(Session(task=task, group=group, sample=sample, attempt=0, calls=[call],
                                      status=Status.COMPLETED, reward=float(seed % 3)))
            futures.append(future)
        return futures

    def cancel(self, future):
        pass


class Weights(WeightPublisher):
    def __init__(self):
        self.served = -1

    @property
    def version(self):
        return self.served

    def load(self, params, version):
        self.served = version


class Crash(Exception):
    """The driver dying after a batch's rollouts were collected and before its update."""


def data():
    return Dataset(train=lambda partition: ({"task_id": np.array([2 * i, 2 * i + 1])} for i in itertools.count()))


def run(model, output_dir, steps, crash_at=None):
    """Train to ``steps`` from ``output_dir``; returns (params, task ids per scheduler call, source)."""
    objective = GRPOObjective(model, seq_len=WIDTH - 1, behavior_importance=2.0)
    weights = Weights()
    source = Replayable(weights)
    calls: list[list[str]] = []

    def log(record):
        if crash_at is not None and len(calls) == crash_at:
            raise Crash(f"killed during scheduler call {crash_at}")

    class Recording(RolloutScheduler):
        def __call__(self, batch, variables, version, key=None):
            out = super().__call__(batch, variables, version, key)
            calls.append([task.id for task in task_ids(batch)])
            return out

    scheduler = Recording(objective, source, weights, width=WIDTH, rows=4, groups=2, max_lag=1, ahead=1, log=log)
    trainer = Trainer(objective, optax.adam(1e-2), key=jax.random.key(0), rollout=scheduler, output_dir=output_dir,
                      checkpoint_every=1, progress=False)
    try:
        state = trainer.fit(scheduler.tasks(data()), steps=steps)
    finally:
        scheduler.close()
    return state.params, calls, source


@pytest.mark.slow
def test_resume_after_a_crash_mid_batch_trains_the_same_groups(tiny_model, tmp_path):
    reference, reference_calls, _ = run(tiny_model, tmp_path / "straight", steps=4)
    assert reference_calls == [["0", "1"], ["2", "3"], ["4", "5"], ["6", "7"]]

    with pytest.raises(Crash, match="killed during scheduler call 2"):
        run(tiny_model, tmp_path / "crashed", steps=4, crash_at=2)
    # The third batch's rollouts were collected and batch 4 was running ahead: neither was trained.
    params, calls, source = run(tiny_model, tmp_path / "crashed", steps=4)
    assert calls == [["4", "5"], ["6", "7"]]  # the resumed run trains on the batches the crash interrupted
    assert source.submitted[:4] == ["4", "4", "5", "5"]  # resubmitted, two samples per group, then batch 4 ahead
    assert min(int(task) for task in source.submitted) == 4  # nothing already trained was drawn again
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(reference), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-6)


def counting_tasks(batch):
    """Each task id is a CountingTool episode of two or three turns over its own prompt."""
    return [Task(str(i), {"prompt_ids": [20 + i % 7, 21, 22], "turns": 2 + i % 2}) for i in batch["task_id"]]


@pytest.mark.slow
def test_trainer_through_multi_turn_environments_on_the_native_server(sharp_decoder):
    model, served = sharp_decoder
    width = 32
    objective = GRPOObjective(model, seq_len=width - 1, behavior_importance=2.0, pretrained=served)
    serving = ServingTask(model, served, Sampling(eos_id=EOS, temperature=1.0, top_k=8))
    harness = Harness()
    records = []
    with NativeRolloutServer(Server.from_task(serving, slots=4, capacity=64), version=-1) as server, \
            EnvironmentSource(server, harness.environment, harness.verifier, max_prompt_tokens=40, max_new_tokens=4,
                              max_turns=4, workers=4, eos_ids=EOS) as environments:
        scheduler = RolloutScheduler(objective, environments, server, width=width, rows=8, tasks=counting_tasks,
                                     groups=4, max_lag=1, ahead=1, truncation="score", log=records.append)
        trainer = Trainer(objective, optax.adam(1e-3), key=jax.random.key(0), rollout=scheduler, progress=False)
        state = trainer.fit(scheduler.tasks(data()), steps=3)
        scheduler.close()
        assert server.version == 2  # pushed before each call: -1 -> 0, 1, 2
    assert len(records) == 3 and all(r.admitted_groups == 2 and r.lag <= 1 for r in records)
    assert int(state.updates) == 3
    # multi-turn sessions trained: a completed session of task i made 2 + i % 2 model calls
    turns = [len(e.transitions) for e in harness.seen if e.status.name == "COMPLETED"]
    assert turns and set(turns) <= {2, 3} and 3 in turns
    assert all(env.released for _, env in harness.opened)  # every environment entered was released
    # budget-hit sessions score -1 beside completed ones, so groups have advantages and the policy moves
    assert any(r.metrics["sessions/calls_per_chain"] > 1 for r in records)
    moved = [jnp.abs(a - b).max() for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(served["params"]))]
    assert float(max(moved)) > 0
