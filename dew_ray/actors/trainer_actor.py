"""The trainer as a Ray actor: one JAX process that owns a Trainer, its state, its data and its rollout.

``TrainerHost(build)`` is a plain class; ``TrainerActor`` is the same class as a Ray
actor. ``build()`` runs inside the trainer's process after JAX is set up there and
returns a :class:`TrainJob`: the Trainer (with its rollout, e.g. a RolloutScheduler, so
rollouts are rescored under this process's weights and the data position stays the
trainer's), the Dataset, and what to close at the end. ``build`` must be picklable (a
module-level function or a ``functools.partial`` of one) since it travels to the actor.

A host is driven step by step over the Trainer's own run (:meth:`dew.trainer.Trainer.start`):
``start()`` builds the job and starts the run (restoring the newest checkpoint of the
Trainer's ``output_dir`` when there is one), ``step(n)`` consumes n batches and returns
their metrics, ``snapshot()`` returns the parameters in host memory, ``save()`` writes a
checkpoint with the data position, ``close()`` releases it.

A group of N hosts forms one multi-process JAX job (:func:`start_trainer_group`): the
first actor picks the coordinator address on its node, every actor joins with
``jax.distributed`` (gloo collectives on CPU) and reads only its own data partition, and
the driver calls each step on all of them at once, since every update is a collective.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Callable
from typing import Any

import jax
import ray

from dew.data.dataset import Dataset
from dew.sharding import collective_host, initialize_processes
from dew.trainer import Trainer, TrainingRun, TrainState
from dew.validation import positive_int


@dataclasses.dataclass
class TrainJob:
    """What a trainer process trains: the Trainer, its Dataset, what to close at the end, and
    ``report()``: what the job has to say after each step (its rollout's records, say),
    returned with the step's metrics under ``"report"``; ``servers``: the job's
    :class:`~dew_ray.actors.ServerPool`, which ``add_servers``/``remove_servers`` change."""

    trainer: Trainer
    data: Dataset
    close: Callable[[], Any] | None = None
    report: Callable[[], dict] | None = None
    servers: Any = None  # the job's ServerPool, when its rollout servers may change during the run


def use_cpu_devices(count: int) -> None:
    """Expose ``count`` CPU devices; only effective before JAX creates its backends."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={count}"])


def host_params(state: TrainState):
    """The parameters as numpy arrays, gathered leaf by leaf: a collective when they are sharded over processes."""
    return collective_host(state.params)


class TrainerHost:
    """One trainer process (see the module docstring)."""

    def __init__(self, build: Callable[[], TrainJob]):
        if not callable(build):
            raise TypeError(f"build must be a callable returning a TrainJob, got {build!r}")
        self.build = build
        self.job: TrainJob | None = None
        self.run: TrainingRun | None = None

    def coordinator(self) -> str:
        """An address (this node's IP and a free port) for the group's JAX coordinator."""
        ip = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        with socket.socket() as sock:
            sock.bind(("", 0))
            return f"{ip}:{sock.getsockname()[1]}"

    def start(self, coordinator: str | None = None, processes: int = 1, process: int = 0,
              local_devices: int | None = None) -> dict:
        """Set up JAX (joining the group when ``processes > 1``), build the job and its state."""
        if self.job is not None:
            raise RuntimeError("this trainer has already started")
        if processes > 1:
            if coordinator is None:
                raise ValueError("a trainer group of several processes needs the coordinator address")
            initialize_processes(coordinator, processes, process, local_device_count=local_devices)
        elif local_devices is not None:
            use_cpu_devices(local_devices)
        job = self.build()
        if not isinstance(job, TrainJob):
            raise TypeError(f"build() must return a dew_ray TrainJob, got {type(job).__name__}")
        self.job = job
        self.run = job.trainer.start(job.data)
        return {**self.progress(), "restored": self.run.restored, "process": jax.process_index(),
                "processes": jax.process_count(), "devices": jax.device_count()}

    def progress(self) -> dict:
        run = self._started()
        return {"step": run.steps, "updates": int(run.state.updates)}

    def step(self, count: int = 1) -> list[dict]:
        """Consume ``count`` batches; one metrics dict per batch (with ``step`` and ``updates``)."""
        run = self._started()
        out = []
        for _ in range(count):
            metrics = run.step()
            row = {"step": run.steps, "updates": int(run.state.updates), **metrics}
            if self.job.report is not None:
                row["report"] = self.job.report()
            out.append(row)
        return out

    def add_servers(self, pairs: list) -> int:
        """Rollout servers (``(name, actor)`` pairs) joining the job's pool; each takes draws once it has loaded
        the newest weights the pool published. Returns the pool's size."""
        pool = self._servers()
        for name, actor in pairs:
            pool.add(actor, name)
        return len(pool.live())

    def remove_servers(self, names: list[str], timeout: float) -> int:
        """Take servers out of the job's pool (their draws get ``timeout`` s, then go to the others); returns how
        many draws went to the others."""
        pool = self._servers()
        return sum(pool.remove(name, timeout) for name in names)

    def _servers(self):
        self._started()
        if self.job.servers is None:
            raise RuntimeError("this trainer's job has no rollout-server pool to change (vLLM engines, or a job "
                               "built without servers=)")
        return self.job.servers

    def snapshot(self):
        """The current parameters in host memory (numpy), e.g. for publication or export.

        Every process of the group calls it (sharded parameters are gathered by a collective); process 0
        returns them and the others None, so the object store holds one copy.
        """
        params = host_params(self._started().state)
        return params if jax.process_index() == 0 else None

    def save(self) -> int:
        """Checkpoint the state and data position into the Trainer's output_dir; returns the step."""
        return self._started().save()

    def close(self) -> None:
        if self.run is not None:
            self.run.close()
        if self.job is not None and self.job.close is not None:
            self.job.close()
        if jax.process_count() > 1:
            jax.distributed.shutdown()

    def _started(self) -> TrainingRun:
        if self.run is None:
            raise RuntimeError("call start() before driving the trainer")
        return self.run


TrainerActor = ray.remote(TrainerHost)


def start_trainer_group(build: Callable[[], TrainJob], processes: int = 1, local_devices: int | None = None,
                        num_cpus: float = 1, timeout: float = 600, placement=None,
                        **options) -> tuple[list, list[dict]]:
    """Start ``processes`` TrainerActors as one JAX job; returns the actors and what each ``start`` reported.

    ``placement(i)``, when given, returns actor i's options (its CPUs and placement-group bundle).
    """
    positive_int("processes", processes)
    actors = [TrainerActor.options(**(placement(i) if placement else {"num_cpus": num_cpus}), **options).remote(build)
              for i in range(processes)]
    coordinator = ray.get(actors[0].coordinator.remote(), timeout=timeout) if processes > 1 else None
    started = ray.get([actor.start.remote(coordinator, processes, index, local_devices)
                       for index, actor in enumerate(actors)], timeout=timeout)
    return actors, started


def step_group(actors: list, count: int = 1, timeout: float | None = None) -> list[list[dict]]:
    """Step every process of a group at once (each update is a collective); metrics per process.

    Raises as soon as any process fails (a lost process leaves the others waiting in a collective, so waiting
    for every reply would wait for ever).
    """
    refs = [actor.step.remote(count) for actor in actors]
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=timeout)
        if not done:
            raise TimeoutError(f"the trainer group did not finish {count} update(s) within {timeout:g} s")
        ray.get(done)
    return ray.get(refs)
