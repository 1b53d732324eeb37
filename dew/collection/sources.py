"""Two :class:`~dew.records.session_records.SessionSource` s on a :class:`~dew.inference.RolloutServer`.

``PromptSource(server, reward, decode=..., max_new_tokens=R)`` is single-turn RLVR: one
draw per sample, scored by ``reward(data_source, completion, ground_truth, extra_info)``
on a thread pool as the draw finishes (never on the server's thread), so verification
overlaps generation.

``EnvironmentSource(server, environment, verifier, max_prompt_tokens=P,
max_new_tokens=R, max_turns=T, workers=N)`` runs the in-process
:class:`~dew.records.episode_protocol.Environment` protocol, one session per sample on a
worker thread. Each turn submits the observation's exact context to the server, so
turns of different sessions share the engine's batch; each call keeps the version it
was submitted under.

Statuses (both sources; neither raises for a failed sample, so one failure never loses
the others):

======================================================  ======================================
what happened                                           status (``reward``)
======================================================  ======================================
draw ended on EOS; reward / verifier scored it          COMPLETED (scored)
draw spent its budget without EOS                       TRUNCATED (scored; not sent to a tool)
environment reported "truncated"                        TRUNCATED (verified)
context over ``max_prompt_tokens``; over ``max_turns``  TRUNCATED (None: the verifier never ran)
environment reported "cancelled"; ``cancel(future)``    CANCELLED
failed draw; reward or verifier raised or non-finite    INFRA_ERROR (None; ``detail`` says why)
environment raised, reported "error" or failed release  INFRA_ERROR
======================================================  ======================================

A TRUNCATED session's reward is for the scheduler's ``truncation`` option to use or not.
An environment session's ``episode_metrics`` hold ``turns`` (model calls), ``truncated`` (1.0
for a TRUNCATED session) and what the environment's optional ``metrics()`` reports (tool
calls, tool errors), read inside its context after the verifier; a ``metrics()`` that raises
or reports a non-number makes the session an INFRA_ERROR.

``cancel(future)`` stops a session at its next turn, also mid-draw (the in-flight
draw is cancelled); work already inside a reward, an environment step or a verifier
is not interrupted. ``close()`` (or leaving a ``with`` block) cancels what is still
running and shuts the pool down. Sessions are always attempt 0; a scheduler relabels.
"""

from __future__ import annotations

import dataclasses
import threading
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from dew.collection.episode_driver import EpisodeDriver, NotAnObservation
from dew.collection.scoring import finite_score, score_completion, token_text
from dew.inference.rollout_server import Draw, DrawFuture, RolloutServer
from dew.records.episode_protocol import Action, Environment, Episode, EpisodeId, EpisodeStatus, Observation, Transition
from dew.records.session_records import Call, Session, SessionSource, Status, Task
from dew.validation import positive_int


def _seed(*parts: Any) -> int:
    """A draw's seed, fixed by the parts it names (task id, group, sample, turn)."""
    return zlib.crc32("/".join(str(p) for p in parts).encode())


def _call(prompt: Sequence[int], draw: Draw) -> Call:
    return Call(prompt_ids=list(prompt), sampled_ids=draw.ids, behavior_log_probs=draw.behavior_log_probs,
                old_log_probs=draw.old_log_probs, finish_reason=draw.finish_reason, version=draw.version,
                support=draw.support, routed_experts=draw.routed_experts)


@dataclasses.dataclass
class _Live:
    """A running session: whether it was cancelled and the draw it waits on."""

    cancelled: bool = False
    draw: DrawFuture | None = None


class _PooledSource(SessionSource):
    """What both sources share: a worker pool, the running sessions, ``cancel`` and ``close``."""

    def __init__(self, server: RolloutServer, workers: int, name: str):
        if not isinstance(server, RolloutServer):
            raise TypeError(f"server must be a dew.inference.RolloutServer, got {type(server).__name__}")
        self.server = server
        self._pool = ThreadPoolExecutor(positive_int("workers", workers), thread_name_prefix=name)
        self._lock = threading.Lock()
        self._live: dict[Future, _Live] = {}
        self._closed = False

    def _track(self, future: Future, live: _Live) -> Future:
        with self._lock:
            self._live[future] = live
        future.add_done_callback(self._untrack)
        return future

    def _untrack(self, future: Future) -> None:
        with self._lock:
            self._live.pop(future, None)

    def _watch(self, live: _Live, draw: DrawFuture) -> None:
        """Record the draw a session waits on; cancel it at once if the session already was."""
        with self._lock:
            live.draw = draw
            cancelled = live.cancelled
        if cancelled:
            self.server.cancel(draw)

    def cancel(self, future: Future) -> None:
        """Stop a session of this source at its next turn, its in-flight draw included; it resolves CANCELLED."""
        with self._lock:
            live = self._live.get(future)
            if live is None:  # finished already, or not ours
                return
            live.cancelled = True
            draw = live.draw
        if draw is not None and not draw.done():
            self.server.cancel(draw)

    def close(self) -> None:
        """Cancel the sessions still running and shut the pool down."""
        with self._lock:
            self._closed = True
            running = list(self._live)
        for future in running:
            self.cancel(future)
        self._pool.shutdown(wait=True)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"this {type(self).__name__} is closed")

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class PromptSource(_PooledSource):
    """One-draw sessions scored by a reward function on a thread pool.

    A task's ``data`` holds ``prompt_ids`` and optionally the reward fields
    ``data_source``, ``ground_truth`` and ``extra_info`` (strings). Sample ``s`` of
    ``group`` draws with a seed fixed by (task id, group, sample). The reward reads
    ``decode`` of the sampled ids, a trailing id of ``eos_ids`` left out (default
    decode: ids separated by spaces). Statuses: see the module docstring.
    """

    def __init__(
        self,
        server: RolloutServer,
        reward: Callable[[str, str, str, str], float],
        decode: Callable[[list[int]], str] | None = None,
        *,
        max_new_tokens: int,
        eos_ids: Sequence[int] = (),
        workers: int = 4,
    ):
        if not callable(reward):
            raise TypeError(f"reward must be callable as reward(data_source, completion, ground_truth, extra_info), got {reward!r}")
        if decode is not None and not callable(decode):
            raise TypeError(f"decode must be callable on a list of ids, got {decode!r}")
        self.max_new_tokens = positive_int("max_new_tokens", max_new_tokens)
        super().__init__(server, workers, "dew-prompt-score")
        self.reward = reward
        self.decode = decode or token_text
        self.eos_ids = frozenset(int(i) for i in eos_ids)

    def submit(self, task: Task, group: int, samples: int) -> list[Future]:
        self._check_open()
        if "prompt_ids" not in task.data:
            raise KeyError(f"task {task.id!r} has no 'prompt_ids' in its data; it has {sorted(task.data)}")
        prompt = [int(i) for i in task.data["prompt_ids"]]
        futures = []
        for sample in range(samples):
            draw = self.server.submit(prompt, self.max_new_tokens, seed=_seed(task.id, group, sample))
            live = _Live(draw=draw)
            out = self._track(Future(), live)
            draw.add_done_callback(lambda done, s=sample, o=out, l=live: self._queue(task, group, s, prompt, done, o, l))
            futures.append(out)
        return futures

    def _queue(self, task, group, sample, prompt, done: Future, out: Future, live: _Live) -> None:
        """The draw's done-callback, on the server's thread: hand the scoring to the pool."""
        try:
            self._pool.submit(self._finish, task, group, sample, prompt, done, out, live)
        except RuntimeError:  # the pool is shut down: resolve without scoring
            session = Session(task=task, group=group, sample=sample, attempt=0, calls=[], status=Status.CANCELLED,
                              detail="the source was closed before this draw was scored")
            out.set_result(session)

    def _finish(self, task: Task, group: int, sample: int, prompt: list[int], done: Future, out: Future,
                live: _Live) -> None:
        session = Session(task=task, group=group, sample=sample, attempt=0, calls=[], status=Status.INFRA_ERROR)
        try:
            draw: Draw = done.result()
        except Exception as error:  # the engine failed: the session says so and trains on nothing
            session.detail = f"draw failed: {error!r}"
            out.set_result(session)
            return
        session.calls = [_call(prompt, draw)]
        if draw.finish_reason == "cancelled" or live.cancelled:
            session.status, session.detail = Status.CANCELLED, "cancelled"
            out.set_result(session)
            return
        try:
            score = score_completion(self.reward, self.decode, draw.ids, self.eos_ids, task.data)
        except Exception as error:
            session.detail = f"scoring failed: {error!r}"
            out.set_result(session)
            return
        if live.cancelled:  # cancelled while it was being scored
            session.status, session.detail = Status.CANCELLED, "cancelled"
        else:
            session.status = Status.COMPLETED if draw.eos else Status.TRUNCATED
            session.reward = score
        out.set_result(session)


class _Stop(Exception):
    """Ends a session early with a status and a detail."""

    def __init__(self, status: Status, detail: str):
        super().__init__(detail)
        self.status, self.detail = status, detail


_TERMINAL = {
    EpisodeStatus.COMPLETED: Status.COMPLETED,
    EpisodeStatus.TRUNCATED: Status.TRUNCATED,
    EpisodeStatus.CANCELLED: Status.CANCELLED,
    EpisodeStatus.ERROR: Status.INFRA_ERROR,
}


class EnvironmentSource(_PooledSource):
    """Multi-turn sessions through an in-process environment, one per sample on a worker thread.

    ``environment(task, identity)`` returns an :class:`Environment` (a context manager)
    for one session. ``identity`` is an :class:`EpisodeId` with ``task`` the task id as
    an integer when it is one written in decimal, otherwise the CRC-32 of the id;
    ``step`` the group; ``sample`` the sample index; ``seed`` fixed by (task id, group,
    sample). Turn ``k`` draws with a seed fixed by (task id, group, sample, k).

    Each turn follows :class:`~dew.collection.episode_driver.EpisodeDriver`'s rules, as
    EpisodeRollout's do: a terminal observation ends the session; a context longer than
    ``max_prompt_tokens``, or a turn past ``max_turns`` model calls, truncates it;
    otherwise the context goes to the server with ``max_new_tokens`` and the draw is
    recorded as a :class:`Call`. A draw without EOS truncates the session without
    reaching the environment; the episode records it as a transition with a
    "truncated" observation. A draw ended on EOS when the server says so or, for a
    server that does not, when its last id is one of ``eos_ids``. Otherwise
    ``env.step(Action(context, ids, eos, policy_step=draw.version))`` gives the next observation.

    A :class:`~dew.sandbox.SubprocessEnvironment` serves sessions as
    ``EnvironmentSource(server, workers.for_task, verifier, ...)``: its ``for_task(task,
    identity)`` opens a worker for the session's identity.

    ``verifier(task, episode) -> float`` runs inside the environment's context on
    every episode whose last observation is "completed" or "truncated" (the
    environment's own truncation or the token limit); context and turn limits leave
    the episode running, so those sessions arrive unverified (reward None). Statuses:
    see the module docstring. ``workers`` bounds how many sessions run at once.
    """

    def __init__(
        self,
        server: RolloutServer,
        environment: Callable[[Task, EpisodeId], Environment],
        verifier: Callable[[Task, Episode], float],
        *,
        max_prompt_tokens: int,
        max_new_tokens: int,
        max_turns: int,
        workers: int = 8,
        eos_ids: Sequence[int] = (),
    ):
        if not callable(environment):
            raise TypeError(f"environment must be callable as environment(task, identity), got {environment!r}")
        if not callable(verifier):
            raise TypeError(f"verifier must be callable as verifier(task, episode), got {verifier!r}")
        self.driver = EpisodeDriver(max_prompt_tokens, max_new_tokens, max_turns)
        super().__init__(server, workers, "dew-environment-session")
        self.environment, self.verifier = environment, verifier
        self.eos_ids = frozenset(int(i) for i in eos_ids)

    def submit(self, task: Task, group: int, samples: int, first_sample: int = 0) -> list[Future]:
        """One session per sample, numbered from ``first_sample`` (a pool of sources splitting a group numbers
        its share so that no two sessions share an identity or seeds)."""
        self._check_open()
        futures = []
        for sample in range(first_sample, first_sample + samples):
            live = _Live()
            futures.append(self._track(self._pool.submit(self._run, task, group, sample, live), live))
        return futures

    @staticmethod
    def identity(task: Task, group: int, sample: int) -> EpisodeId:
        """The :class:`EpisodeId` a session's environment receives (see the class docstring)."""
        name = str(task.id)
        number = int(name) if name.isdecimal() else zlib.crc32(name.encode())
        return EpisodeId(task=number, step=group, sample=sample, seed=_seed(task.id, group, sample))

    def _run(self, task: Task, group: int, sample: int, live: _Live) -> Session:
        session = Session(task=task, group=group, sample=sample, attempt=0, calls=[], status=Status.INFRA_ERROR)
        if live.cancelled:
            session.status, session.detail = Status.CANCELLED, "cancelled before it started"
            return session
        identity = self.identity(task, group, sample)
        try:
            opened = self.environment(task, identity)
        except Exception as error:
            session.detail = f"the environment failed to open: {error!r}"
            return session
        try:
            with opened as env:
                session.status, session.reward, session.detail = self._episode(task, identity, env, session, live)
                try:
                    session.episode_metrics = self._episode_metrics(env, session)
                except Exception as error:
                    session.status, session.reward = Status.INFRA_ERROR, None
                    session.detail = f"the environment's metrics() failed: {error!r}"
        except Exception as error:  # leaving the context failed: thrown out rather than scored
            session.status, session.reward = Status.INFRA_ERROR, None
            session.detail = f"releasing the environment failed: {error!r}"
        return session

    def _episode(self, task, identity, env, session, live) -> tuple[Status, float | None, str]:
        """Run the turns inside the environment's context: (status, reward, detail)."""
        try:
            episode = Episode(identity, self._observe(lambda: self.driver.observed(env.reset(), identity)))
            while not episode.last.terminal:
                self._turn(task, identity, env, episode, session, live)
        except _Stop as stop:
            return stop.status, None, stop.detail
        except Exception as error:  # a turn the source could not record (an id the protocol refuses)
            return Status.INFRA_ERROR, None, f"the episode failed: {error!r}"
        status, detail = _TERMINAL[episode.status], episode.detail
        if not self.driver.verifiable(episode):
            return status, None, detail
        try:
            where = f"task {task.id!r}, group {session.group}, sample {session.sample}"
            return status, self.driver.reward(self.verifier(task, episode), where), detail
        except Exception as error:
            return Status.INFRA_ERROR, None, f"the verifier failed: {error!r}"

    def _turn(self, task: Task, identity: EpisodeId, env: Environment, episode: Episode, session: Session,
              live: _Live) -> None:
        if live.cancelled:
            raise _Stop(Status.CANCELLED, "cancelled")
        limit = self.driver.limit(episode, len(session.calls))
        if limit is not None:
            raise _Stop(Status.TRUNCATED, limit)
        context = episode.last.context
        try:
            draw_future = self.server.submit(context, self.driver.max_new_tokens,
                                             seed=_seed(task.id, session.group, session.sample, len(session.calls)))
            self._watch(live, draw_future)
            draw: Draw = draw_future.result()
        except Exception as error:
            raise _Stop(Status.INFRA_ERROR, f"draw failed: {error!r}") from error
        session.calls.append(_call(context, draw))
        if draw.finish_reason == "cancelled" or live.cancelled:
            raise _Stop(Status.CANCELLED, "cancelled")
        ended = bool(draw.eos) or bool(draw.ids and draw.ids[-1] in self.eos_ids)
        action = Action(context, tuple(draw.ids), ended, policy_step=draw.version)
        episode.transitions.append(Transition(action, self._observe(lambda: self.driver.act(env, action, identity))))

    @staticmethod
    def _episode_metrics(env, session: Session) -> dict[str, float]:
        """The session's turns, whether it was truncated, and what the environment's ``metrics()`` reports."""
        reported = env.metrics() if callable(getattr(env, "metrics", None)) else {}
        out = {"turns": float(len(session.calls)), "truncated": float(session.status is Status.TRUNCATED)}
        for name, value in dict(reported).items():
            out[str(name)] = finite_score(f"environment's metrics() entry {name!r}", value)
        return out

    @staticmethod
    def _observe(operation: Callable[[], Observation]) -> Observation:
        """An environment operation's observation; a raise or a wrong type is an infrastructure failure."""
        try:
            return operation()
        except NotAnObservation as error:
            raise _Stop(Status.INFRA_ERROR, str(error)) from error
        except Exception as error:
            raise _Stop(Status.INFRA_ERROR, f"the environment raised: {error!r}") from error
