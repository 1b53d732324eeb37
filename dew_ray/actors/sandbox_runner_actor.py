"""Sandbox runners as Ray actors, and a fleet that spreads programs over them.

``SandboxRunnerActor`` hosts a :class:`~dew.sandbox.SandboxFleet` in a Ray worker
process (create it with ``max_concurrency`` at least its ``workers``, which
:func:`start_sandbox_runners` does). :class:`RemoteFleet` has the fleet's interface
(``submit``, ``run``, ``map``), so CodeReward scores on a pool of actors exactly as it
does on a local fleet. The program goes to the live actor with the fewest programs in
flight (a :class:`~dew.inference.replica_pool.ReplicaPool`); ``submit`` blocks once every actor's workers are busy and ``queued`` more are
waiting (backpressure, as the local fleet). A program whose actor dies runs again on
another actor, up to ``retries`` times (an actor Ray restarts takes programs again once its
new incarnation answers); a program's own failure is an Outcome, never retried.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import ray

from dew.sandbox import Outcome, Program, SandboxFleet, SandboxLimits, default_runner
from dew_ray.actors.actor_replicas import ActorReplicas
from dew.validation import positive_int
from dew_ray.actor_loss import ACTOR_GONE


class SandboxRunnerHost:
    """A SandboxFleet in its own process; ``SandboxRunnerActor`` is this class as a Ray actor."""

    def __init__(self, runner=None, limits: SandboxLimits = SandboxLimits(), workers: int = 2):
        self.fleet = SandboxFleet(runner if runner is not None else default_runner(), limits=limits, workers=workers)

    def run(self, program: Program) -> Outcome:
        return self.fleet.run(program)

    def close(self) -> None:
        self.fleet.close()


SandboxRunnerActor = ray.remote(SandboxRunnerHost)


def start_sandbox_runners(count: int, runner=None, limits: SandboxLimits = SandboxLimits(), workers: int = 2,
                          num_cpus: float = 0.5, placement=None, **options) -> list:
    """``count`` SandboxRunnerActors, each running ``workers`` programs at once.

    ``placement(i)``, when given, returns actor i's options (its CPUs and placement-group bundle).
    """
    positive_int("count", count)
    return [SandboxRunnerActor.options(max_concurrency=workers, **(placement(i) if placement else {"num_cpus": num_cpus}),
                                       **options).remote(runner, limits, workers) for i in range(count)]


class RemoteFleet:
    """The SandboxFleet interface over SandboxRunnerActors (see the module docstring)."""

    def __init__(self, actors: Sequence, workers: int = 2, queued: int | None = None, retries: int = 2):
        self.actors = list(actors)
        if not self.actors:
            raise ValueError("RemoteFleet needs at least one SandboxRunnerActor")
        positive_int("workers", workers, why="the actors' worker count")
        queued = 2 * workers * len(self.actors) if queued is None else queued
        self.retries = retries
        self._slots = threading.Semaphore(workers * len(self.actors) + queued)
        self._lock = threading.Lock()
        self.replicas = ActorReplicas(self.actors, "sandbox runner", "programs")
        self._reruns = ThreadPoolExecutor(2, thread_name_prefix="dew-fleet-rerun")
        self.reruns = 0  # programs run again because their actor died

    def submit(self, program: Program) -> Future:
        """Run ``program`` on the least busy live actor; blocks while the pool is full."""
        if not isinstance(program, Program):
            raise TypeError(f"RemoteFleet runs dew.sandbox.Program objects, got {type(program).__name__}")
        self._slots.acquire()
        future: Future = Future()
        future.add_done_callback(lambda _: self._slots.release())
        try:
            self._start(program, future, attempt=0)
        except BaseException as error:
            future.set_exception(error)
        return future

    def _start(self, program: Program, future: Future, attempt: int) -> None:
        index, done = self.replicas.call(lambda index, actor: actor.run.remote(program))
        done.add_done_callback(lambda done: self._finish(program, future, attempt, index, done))

    def _finish(self, program: Program, future: Future, attempt: int, index: int, done: Future) -> None:
        error = done.exception()
        if error is None:
            future.set_result(done.result())
            return
        if isinstance(error, ACTOR_GONE):  # the runner died or cannot be placed again: another runs it
            if attempt < self.retries:
                with self._lock:
                    self.reruns += 1
                # on a thread of the fleet's: the choice may wait for a restarting runner, which must not hold
                # up the thread that settles Ray's replies
                self._reruns.submit(self._rerun, program, future, attempt + 1)
                return
            error = RuntimeError(f"sandbox runner {index} died and the program's {self.retries} retries are spent")
        future.set_exception(error)

    def _rerun(self, program: Program, future: Future, attempt: int) -> None:
        try:
            self._start(program, future, attempt)
        except BaseException as failure:  # no runner came back in time
            future.set_exception(failure)

    def run(self, program: Program) -> Outcome:
        return self.submit(program).result()

    def map(self, programs: Iterable[Program]) -> list[Outcome]:
        """Run every program and return their Outcomes in order."""
        programs = list(programs)
        return [future.result() for future in [self.submit(program) for program in programs]]

    @property
    def live(self) -> int:
        """How many runners still take programs."""
        return len(self.replicas.live())
