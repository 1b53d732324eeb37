"""One trainer process of tests/test_scheduler_processes.py: GRPO through a RolloutScheduler.

``scheduler_worker.py SCENARIO PROCESS PORT OUT`` joins a two-process CPU job (gloo)
unless SCENARIO is "reference", which trains alone on the devices XLA_FLAGS gives it.
Every scenario but "native" reads the same global data, task ids [4k .. 4k + 3] at step
k, of which each process reads its partition's rows; each writes a JSON summary to OUT:

- "parity" / "reference": a deterministic scripted source; tasks 6 and 7 (process 1's
  rows at step 1) and 8 .. 11 (every row of step 2) come back TRUNCATED, which trains
  nothing under truncation="mask": at step 1 process 1 has no trainable row, at step 2
  no process has one. push="one": only process 0's weights are loaded;
- "admission": process 1's source fails task 2 (its rows at step 0);
- "push": process 0's weights.load raises at the first push (version 0);
- "stuck": push="each", and process 1's weights never move from their launch version -1;
- "native": push="each", each process draws from its own NativeRolloutServer through a
  PromptSource, for two steps.

A failure ends the worker as tests/workers/jobs.py says.
"""

import functools
import hashlib
import itertools
import json
from concurrent.futures import Future

from jobs import run_job, task_rows


def main(scenario: str, process: int, port: str, out: str) -> None:
    if scenario != "reference":
        from dew.sharding import initialize_processes

        partition = initialize_processes(f"127.0.0.1:{port}", 2, process, local_device_count=1)
        assert (partition.index, partition.count, __import__("jax").device_count()) == (process, 2, 2)

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from dew import Dataset, Trainer, models
    from dew.objectives.grpo import GRPOObjective
    from dew.collection.scheduler import RolloutScheduler
    from dew.inference import WeightPublisher
    from dew.collection.tasks import task_ids
    from dew.records.session_records import Call, Session, SessionSource, Status

    width = 8  # seq_len 7: a group's two sessions (3 and 4 ids) share one row, and no other group fits beside
    model = models.build("causal_transformer", vocab_size=16, emb_features=16, num_layers=1, num_heads=2,
                         mlp_features=32, max_seq_len=16)
    objective = GRPOObjective(model, seq_len=width - 1, behavior_importance=2.0, aggregation="session-mean")

    def checksum(tree) -> str:
        leaves = [np.ascontiguousarray(np.asarray(leaf, np.float32)) for leaf in jax.tree.leaves(tree)]
        return hashlib.sha256(b"".join(leaf.tobytes() for leaf in leaves)).hexdigest()

    class Weights(WeightPublisher):
        """Records each load; ``fail_at`` raises on that version, ``stuck_at`` stops moving past it."""

        def __init__(self, fail_at=None, stuck_at=None):
            self.served, self.loads, self.fail_at, self.stuck_at = -1, [], fail_at, stuck_at

        @property
        def version(self):
            return self.served

        def load(self, params, version):
            self.loads.append([version, checksum(params)])
            if version == self.fail_at:
                raise ConnectionError(f"engine unreachable while loading version {version}")
            if self.stuck_at is None or version <= self.stuck_at:
                self.served = version

    class Scripted(SessionSource):
        """Completed sessions fixed by (task, sample); calls carry the version served at submission."""

        def __init__(self, served, masked=(), failing=()):
            self.served, self.masked, self.failing = served, set(masked), set(failing)

        def submit(self, task, group, samples):
            futures = []
            t = task.data["task_id"]
            for s in range(samples):
                future = Future()
                if t in self.failing:
                    future.set_exception(RuntimeError(f"harness crashed on task {t}"))
                else:
                    # One or two sampled ids, unequal between the processes' sessions of the same index, so
                    # session-mean would change if their session_index collided in the global batch.
                    sampled = 1 + (t // 2 + s) % 2
                    call = Call(prompt_ids=[1 + t % 5, 2], sampled_ids=[3 + (t + s) % 4, 9 + s][:sampled],
                                behavior_log_probs=[-1.0 - 0.1 * s, -0.5][:sampled], finish_reason="stop",
                                version=self.served())
                    status = Status.TRUNCATED if t in self.masked else Status.COMPLETED
                    future.set_result(Session(task=task, group=group, sample=s, attempt=0, calls=[call],
                                              status=status, reward=float((t + s) % 2)))
                futures.append(future)
            return futures

    records = []
    options = {"width": width, "rows": 4 if scenario == "reference" else 2, "tasks": task_ids, "groups": 2,
               "max_lag": 1, "ahead": 1, "log": records.append}
    server = None
    if scenario == "native":
        from dew.data.prompts import utf8_column
        from dew.inference import NativeRolloutServer, Server, ServingTask
        from dew.collection.sources import PromptSource
        from dew.collection.tasks import prompt_tasks
        from dew.sampling import Sampling

        served = jax.jit(model.init)(jax.random.key(1), jnp.zeros((1, 4), jnp.int32))
        eos = tuple(range(8))
        serving = ServingTask(model, served, Sampling(eos_id=eos, temperature=1.0, top_k=8))
        class Recorded(NativeRolloutServer):
            loads = []

            def load(self, variables, version):
                self.loads.append([version, checksum(variables)])
                super().load(variables, version)

        server = Recorded(Server.from_task(serving, slots=4, capacity=32), version=-1)
        weights = server
        source = PromptSource(server, lambda ds, text, gt, extra: float(len(text.split()) % 2), max_new_tokens=3,
                              eos_ids=eos, workers=2)

        def prompt_rows(partition):
            for step in itertools.count():
                rows = [[8 + (step + process) % 5, 9, 10], [11, 12, 13 + step % 3]]
                yield {"prompt": np.array(rows, np.int32), "prompt_length": np.array([3, 3], np.int32),
                       "data_source": utf8_column(["toy"] * 2), "ground_truth": utf8_column(["x"] * 2),
                       "extra_info": np.zeros((2, 0), np.int32)}

        options.update(tasks=prompt_tasks, rows=4, push="each")
        data = prompt_rows
    else:
        weights = Weights(fail_at=0 if scenario == "push" and process == 0 else None,
                          stuck_at=-1 if scenario == "stuck" and process == 1 else None)
        failing = (2,) if scenario == "admission" and process == 1 else ()
        if scenario == "stuck":
            options["push"] = "each"
        source = Scripted(lambda: scheduler.served_version, masked=range(6, 12), failing=failing)
        data = functools.partial(task_rows, dtype=np.int64)
    scheduler = RolloutScheduler(objective, source, weights, **options)
    trainer = Trainer(objective, optax.adam(1e-2), key=jax.random.key(0), rollout=scheduler, progress=False)
    state = trainer.fit(scheduler.tasks(Dataset(train=data, batch=4)), steps=2 if scenario == "native" else 4)
    scheduler.close()
    if scenario == "native":
        source.close()
        server.close()
    summary = {
        "params": [np.asarray(leaf.addressable_data(0)).tolist() for leaf in jax.tree.leaves(state.params)],
        "updates": int(state.updates),
        "served_version": scheduler.served_version,
        "weights_version": int(weights.version),
        "loads": getattr(weights, "loads", None),
        "pushed": [r.pushed for r in records],
        "admitted": [r.admitted_groups for r in records],
    }
    with open(out, "w") as handle:
        json.dump(summary, handle)


if __name__ == "__main__":
    run_job(main)
