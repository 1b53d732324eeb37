"""SandboxFleet: run programs on a pool of threads, one sandboxed process each.

``SandboxFleet(runner, limits=SandboxLimits(...), workers=N)`` hands each program to
``runner.run(program, limits)`` on one of N threads (the thread only waits on its
process, so N is the number of programs running at once) and returns an Outcome per
program. A program that fails, times out or crashes is an Outcome like any other; only
bad arguments raise, and so does a broken runner (bubblewrap that cannot start a
sandbox, say), since scoring that as a failed program would hide it.

Programs die with the fleet's process (see the runners), but a process killed outright
cannot remove their job directories (``dew-job-*`` in the temporary directory).

Backpressure: the fleet holds at most ``workers`` running programs and ``queued``
waiting ones (2 * workers by default); ``submit`` blocks until one finishes rather than
queueing without bound.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

from dew.sandbox.program import Outcome, Program, SandboxLimits
from dew.sandbox.runners import Runner
from dew.validation import integer, positive_int


class SandboxFleet:
    """Runs Programs through ``runner`` on ``workers`` threads; a context manager."""

    def __init__(self, runner: Runner, limits: SandboxLimits = SandboxLimits(), workers: int = 4,
                 queued: int | None = None):
        if not callable(getattr(runner, "run", None)):
            raise TypeError(f"runner must have run(program, limits), got {type(runner).__name__}")
        if not isinstance(limits, SandboxLimits):
            raise TypeError(f"limits must be SandboxLimits, got {type(limits).__name__}")
        positive_int("workers", workers)
        queued = 2 * workers if queued is None else queued
        integer("queued", queued, at_least=0)
        self.runner, self.limits, self.workers, self.queued = runner, limits, workers, queued
        self._slots = threading.Semaphore(workers + queued)
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="dew-sandbox")
        self._closed = False

    def submit(self, program: Program) -> Future[Outcome]:
        """Start ``program`` when a worker is free; blocks while the fleet already holds workers + queued programs."""
        _check(program)
        if self._closed:
            raise RuntimeError("this SandboxFleet is closed")
        self._slots.acquire()
        try:
            future = self._executor.submit(self.runner.run, program, self.limits)
        except BaseException:
            self._slots.release()
            raise
        future.add_done_callback(lambda _: self._slots.release())
        return future

    def run(self, program: Program) -> Outcome:
        """Run one program and wait for its Outcome."""
        return self.submit(program).result()

    def map(self, programs: Iterable[Program]) -> list[Outcome]:
        """Run every program (all checked before any starts) and return their Outcomes in the same order."""
        programs = list(programs)
        for program in programs:
            _check(program)
        return [future.result() for future in [self.submit(program) for program in programs]]

    def close(self) -> None:
        """Wait for every submitted program, then stop the threads; later submits raise."""
        self._closed = True
        self._executor.shutdown(wait=True)

    def __enter__(self) -> SandboxFleet:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check(program) -> None:
    if not isinstance(program, Program):
        raise TypeError(f"the fleet runs Program objects, got {type(program).__name__}")
