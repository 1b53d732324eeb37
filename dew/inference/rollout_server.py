"""The RolloutServer interface and the native server behind it.

``RolloutServer`` is what rollout sources talk to, whatever engine draws the tokens:

- ``submit(prompt_ids, max_new_tokens, seed=...)`` returns a ``concurrent.futures.Future``
  of a :class:`Draw`: the sampled ids, their behaviour log-probabilities, the raw-policy
  log-probabilities when the backend has them, whether EOS ended the draw, why it
  ended, and the policy version it was submitted under;
- ``cancel(future)`` stops a draw, also mid-draw: its slot is freed at the next step
  and the future resolves with ``finish_reason="cancelled"``;
- ``load(variables, version)`` pushes new weights; generation continues across a
  push, and a draw's version is the one it was submitted under, the oldest weights
  that may have produced any of its tokens;
- ``version`` is the version being served.

``NativeRolloutServer(Server.from_task(task, slots=..., capacity=...))`` drives dew's
continuous-batching :class:`~dew.inference.server.Server` on a background thread. With
``landing=LandingCheck(model, served_dtype=..., published_dtype=...)`` every load scores the
probe on the served copy and fails (the version staying) unless it matches the trainer's.
"""

from __future__ import annotations

import abc
import dataclasses
import queue
import threading
from collections.abc import Sequence
from concurrent.futures import Future, InvalidStateError

import numpy as np

from dew.inference.landing import LandingCheck, LandingError
from dew.inference.publisher import WeightPublisher
from dew.inference.server import Server
from dew.sampling import Sampling


@dataclasses.dataclass(frozen=True)
class Draw:
    """One finished draw."""

    ids: list[int]
    behavior_log_probs: list[float]
    old_log_probs: list[float] | None
    eos: bool
    version: int
    finish_reason: str
    support: list[list[int]] | None = None  # per sampled id, the ids the sampler kept (engines that report them)
    routed_experts: np.ndarray | None = None  # a mixture-of-experts router record, as the engine reported it


class ServerDied(RuntimeError):
    """A draw's server died, or stopped answering and was set aside, before answering; the same draw can be
    submitted again elsewhere."""


class DrawFuture(Future):
    """The future of a :class:`Draw`; ``request`` is the server's number for it."""

    request: int = -1


def settle(future: Future, result=None, error: BaseException | None = None) -> bool:
    """Resolve ``future`` with ``error`` or ``result``, unless it is resolved already: a cancel or a pool that
    abandoned the draw got there first, and the first word stands. Returns whether this word was the first."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        return False
    return True


class RolloutServer(WeightPublisher):
    """Where rollouts get their tokens (see the module docstring); it publishes its own weights."""

    @abc.abstractmethod
    def submit(self, prompt_ids: Sequence[int], max_new_tokens: int, seed: int = 0) -> DrawFuture: ...

    @abc.abstractmethod
    def cancel(self, draw: DrawFuture) -> None: ...

    def close(self) -> None:
        """Release the server's resources; the default holds none."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class NativeRolloutServer(RolloutServer):
    """A :class:`Server` stepped on a background thread.

    Submissions are checked in the caller's thread (a bad request raises there and
    disturbs no slot); the thread admits, steps, applies loads between steps and
    resolves futures. ``load`` returns once the new weights are in place.
    """

    def __init__(self, server: Server, version: int = 0, landing: LandingCheck | None = None):
        self.server = server
        self._version = version
        self.landing = landing
        self._lock = threading.Lock()
        self._commands: queue.Queue = queue.Queue()
        self._cancels: queue.Queue = queue.Queue()  # the thread holds the lock while it steps; a cancel must not wait
        self._futures: dict[int, tuple[Future, int]] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="dew-native-rollout", daemon=True)
        self._thread.start()

    @property
    def version(self) -> int:
        return self._version

    def submit(self, prompt_ids: Sequence[int], max_new_tokens: int, seed: int = 0,
               sampling: Sampling | None = None) -> DrawFuture:
        """As RolloutServer.submit; ``sampling`` gives this draw its own controls (``Server.submit``)."""
        self._check_running()
        future = DrawFuture()
        with self._lock:
            future.request = self.server.submit(prompt_ids, max_new_tokens, seed, sampling)
            self._futures[future.request] = (future, self._version)
        self._wake.set()
        return future

    def cancel(self, draw: DrawFuture) -> None:
        self._cancels.put(draw.request)
        self._wake.set()

    def load(self, variables, version: int) -> None:
        self._check_running()
        done, failure = threading.Event(), []
        self._commands.put((variables, version, done, failure))
        self._wake.set()
        while not done.wait(0.05):
            self._check_running()
        if failure:
            raise failure[0]

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=30)
        with self._lock:
            for future, _ in self._futures.values():
                if not future.done():
                    future.set_exception(RuntimeError("the rollout server was closed before this draw finished"))
            self._futures.clear()

    def _land(self, variables) -> None:
        if self.landing is not None:
            served = self.landing.served(self.server.model, self.server.variables)
            self.landing.compare("the native server", served, self.landing.expected(variables))

    def _check_running(self) -> None:
        if self._error is not None:
            raise RuntimeError("the rollout server's thread failed") from self._error
        if self._stop.is_set():
            raise RuntimeError("the rollout server is closed")

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                while not self._commands.empty():
                    variables, version, done, failure = self._commands.get()
                    self.server.reload(variables)
                    try:
                        self._land(variables)
                        self._version = version
                    except LandingError as error:  # the load raises it; the version stays
                        failure.append(error)
                    done.set()
                with self._lock:
                    while not self._cancels.empty():
                        self.server.cancel(self._cancels.get())
                    busy = self.server.busy
                    finished = self.server.step() if busy else []
                    resolved = [(self._futures.pop(f.request), f) for f in finished]
                for (future, version), result in resolved:
                    future.set_result(Draw(
                        ids=result.ids, behavior_log_probs=result.behavior_log_probs,
                        old_log_probs=result.old_log_probs, eos=result.eos, version=version,
                        finish_reason=result.finish_reason,
                    ))
                if not busy:
                    self._wake.wait(0.05)
                    self._wake.clear()
        except BaseException as error:  # surface the failure to every waiting caller
            self._error = error
            with self._lock:
                for future, _ in self._futures.values():
                    if not future.done():
                        future.set_exception(error)
