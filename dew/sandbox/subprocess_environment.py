"""SubprocessEnvironment: a tool episode's environment served by a local worker process over JSON lines.

``SubprocessEnvironment(command, limits, env)`` is an environment factory: called with
an :class:`~dew.records.episode_protocol.EpisodeId` it returns a :class:`WorkerEnvironment`,
used as a context manager. On entry (or at its first request) it starts the argv
``command`` with :func:`dew.sandbox.launcher.launch` in a fresh temporary directory
(its working directory, HOME and TMPDIR; ``directory`` while open), and on exit it
kills the worker's process group and removes the directory.

The protocol is one JSON object per line, one reply per request::

    parent -> worker                                               worker -> parent
    {"op": "reset", "episode": {"task", "step", "sample", "seed"}}   {"context": [ids], "status": s, "detail": str}
    {"op": "step", "context": [ids], "tokens": [ids],               {"context": [ids], "status": s, "detail": str}
     "eos": bool, "policy_step": int}
    {"op": "get_state"}                                             {"state": "<base64>"}
    {"op": "set_state", "state": "<base64>"}                        {"restored": true}

``s`` is one of "running", "completed", "truncated", "cancelled", "error"; ``detail``
may be left out (""); other keys are ignored. Nothing else may appear on the worker's
stdout; its stderr is kept (the last 64 KiB) and quoted in failure details.

Limits: RLIMIT_CPU, RLIMIT_AS and RLIMIT_NPROC in the worker (``limits.cpu_seconds``,
``memory_bytes``, ``processes``); in the parent, one wall-clock deadline per session,
``limits.wall_seconds`` from the worker's start (the time between requests counts
too), and a cap of ``limits.message_bytes`` on a reply line, read in bounded chunks.

A failed worker (a hang past the deadline, an exit or a signal, the memory or CPU
limit, output that is not the protocol: not JSON, an oversized line, missing fields,
bad ids) never raises out of ``reset``/``step``: they return an ``error`` observation
whose detail names what happened, with the worker's stderr; the worker is killed and
every later ``reset``/``step`` returns that same observation. ``get_state`` and
``set_state`` are journal operations, so there a failure raises
:class:`~dew.records.episode_protocol.EnvironmentFailure`. A worker that itself replies
``"error"`` is alive and keeps being asked.

What is isolated: resources (the limits above), the process group (killed on exit) and
the parent's environment variables (the worker sees only the launcher's minimal set plus
``env``). If the parent dies, the worker gets SIGKILL (``setpriv --pdeathsig``; Linux
sends it when the *thread* that started the worker ends, so open an environment on a
thread that outlives it); a grandchild that left the worker's session is not covered,
and the temporary directory of a parent killed outright stays behind (``dew-episode-*`` in TMPDIR).
What is not isolated: the worker runs with the caller's OS user and permissions and sees
the whole filesystem and network. Untrusted code, generated code included, needs an
outer sandbox (a container or VM) around the worker.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import selectors
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from dew.records.episode_protocol import (
    Action,
    Environment,
    EnvironmentFailure,
    EpisodeId,
    EpisodeStatus,
    Observation,
)
from dew.sandbox.launcher import kill_group, launch
from dew.sandbox.program import SandboxLimits

READ_CHUNK = 1 << 16
STDERR_KEPT = 1 << 16  # bytes of the worker's stderr kept in memory (the last ones)
STDERR_SHOWN = 2000  # characters of it quoted in a failure detail
PREVIEW = 200  # characters of a malformed reply quoted in a failure detail
EXIT_WAIT_SECONDS = 0.5  # how long a worker that closed its stdout gets to exit before it is killed


class _WorkerDied(Exception):
    """Internal: the worker broke the protocol or ended; the argument is what happened."""


class SubprocessEnvironment:
    """An environment factory: ``factory(episode_id)`` returns a :class:`WorkerEnvironment` running ``command``.

    command: the worker's argv (no shell); ``argv[0]`` is looked up on the launcher's PATH.
    limits: the worker's resource limits, the session deadline and the reply size cap.
    env: extra environment variables for the worker.
    """

    def __init__(
        self, command: Sequence[str], limits: SandboxLimits = SandboxLimits(), env: Mapping[str, str] | None = None
    ):
        if isinstance(command, (str, bytes)) or not command or not all(isinstance(part, str) for part in command):
            raise ValueError(f"command must be a non-empty sequence of strings (an argv, no shell), got {command!r}")
        if not isinstance(limits, SandboxLimits):
            raise ValueError(f"limits must be a SandboxLimits, got {type(limits).__name__}")
        if env is not None and (
            not isinstance(env, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
        ):
            raise ValueError("env must map strings to strings")
        self.command = tuple(command)
        self.limits = limits
        self.env = dict(env or {})

    def __call__(self, episode: EpisodeId) -> WorkerEnvironment:
        return WorkerEnvironment(episode, self.command, self.limits, self.env)

    def for_task(self, task, episode: EpisodeId) -> WorkerEnvironment:
        """The ``environment(task, identity)`` form EnvironmentSource calls: a worker for the session's identity.

        ``EnvironmentSource(server, factory.for_task, verifier, ...)``; the worker sees the
        identity in its reset request (the task's integer id among it), not the task's payload.
        """
        return self(episode)


class WorkerEnvironment(Environment):
    """One episode served by one worker process (see the module docstring)."""

    def __init__(self, episode: EpisodeId, command: Sequence[str], limits: SandboxLimits, env: Mapping[str, str]):
        if not isinstance(episode, EpisodeId):
            raise ValueError(f"episode must be an EpisodeId, got {type(episode).__name__}")
        self.episode = episode
        self._command = list(command)
        self._limits = limits
        self._env = dict(env)
        self.directory: str | None = None  # the worker's temporary working directory (removed by close)
        self._process: subprocess.Popen | None = None
        self._selector: selectors.BaseSelector | None = None
        self._deadline = 0.0
        self._stdout = bytearray()  # reply bytes read but not yet taken as a line
        self._stderr = bytearray()
        self._failure: Observation | None = None
        self._closed = False

    def __enter__(self) -> WorkerEnvironment:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    @property
    def failure(self) -> Observation | None:
        """The error observation that ended the worker, or ``None`` while it is healthy."""
        return self._failure

    def reset(self) -> Observation:
        return self._observe({"op": "reset", "episode": dataclasses.asdict(self.episode)})

    def step(self, action: Action) -> Observation:
        if not isinstance(action, Action):
            raise ValueError(f"step takes an Action, got {type(action).__name__}")
        return self._observe({
            "op": "step", "context": list(action.context), "tokens": list(action.tokens), "eos": action.eos,
            "policy_step": action.policy_step,
        })

    def get_state(self) -> bytes:
        def parse(reply: dict) -> bytes:
            if not isinstance(reply.get("state"), str):
                raise ValueError('the reply needs "state", a base64 string')
            return base64.b64decode(reply["state"], validate=True)

        return self._journal({"op": "get_state"}, parse)

    def set_state(self, state: bytes) -> None:
        if not isinstance(state, (bytes, bytearray, memoryview)):
            raise ValueError(f"set_state takes bytes, got {type(state).__name__}")

        def parse(reply: dict) -> None:
            if reply.get("restored") is not True:
                raise ValueError('the reply must be {"restored": true}')

        self._journal({"op": "set_state", "state": base64.b64encode(bytes(state)).decode("ascii")}, parse)

    def close(self) -> None:
        """Kill the worker's process group, reap it and remove its directory. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._process is not None:
                kill_group(self._process)
                self._process.wait()
                self._selector.close()
                for stream in (self._process.stdin, self._process.stdout, self._process.stderr):
                    stream.close()
        finally:
            if self.directory is not None:
                shutil.rmtree(self.directory)

    # -- the worker process ------------------------------------------------------------------

    def _start(self) -> None:
        if self._closed:
            raise RuntimeError(f"the environment of {self.episode} is closed")
        if self._process is not None:
            return
        self.directory = tempfile.mkdtemp(prefix="dew-episode-")
        self._process = launch(self._command, self.directory, self._limits, self._env)
        self._deadline = time.monotonic() + self._limits.wall_seconds
        os.set_blocking(self._process.stdin.fileno(), False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._process.stdout.fileno(), selectors.EVENT_READ)
        self._selector.register(self._process.stderr.fileno(), selectors.EVENT_READ)

    def _observe(self, request: dict) -> Observation:
        """A reset or step: the worker's observation, or the error observation that ended it."""

        def parse(reply: dict) -> Observation:
            missing = [key for key in ("context", "status") if key not in reply]
            if missing:
                raise ValueError(f"the reply lacks {missing}")
            if not isinstance(reply["context"], list):
                raise ValueError("context must be a JSON array of token ids")
            if not isinstance(reply["status"], str):
                raise ValueError("status must be a string")
            return Observation(reply["context"], reply["status"], reply.get("detail", ""))

        try:
            return self._call(request, parse)
        except _WorkerDied:
            return self._failure

    def _journal(self, request: dict, parse: Callable[[dict], Any]) -> Any:
        """A get_state or set_state: a failure raises, since a journal must not record a bad snapshot."""
        try:
            return self._call(request, parse)
        except _WorkerDied as died:
            raise EnvironmentFailure(f"{request['op']} failed for {self.episode}: {died}") from None

    def _call(self, request: dict, parse: Callable[[dict], Any]) -> Any:
        """Send ``request``, read one reply line and ``parse`` its object.

        Any failure kills the worker and raises ``_WorkerDied`` with the recorded detail.
        """
        self._start()
        if self._failure is not None:
            raise _WorkerDied(self._failure.detail)
        try:
            line = self._exchange(json.dumps(request, separators=(",", ":")).encode() + b"\n")
            try:
                reply = json.loads(line)
            except (ValueError, RecursionError) as error:  # RecursionError: arrays nested past Python's stack
                raise _WorkerDied(f"malformed reply to {request['op']}: not JSON ({error}): {_preview(line)}") from None
            if not isinstance(reply, dict):
                raise _WorkerDied(f"malformed reply to {request['op']}: not a JSON object: {_preview(line)}")
            try:
                return parse(reply)
            except (TypeError, ValueError) as error:  # binascii.Error is a ValueError
                raise _WorkerDied(f"malformed reply to {request['op']}: {error}: {_preview(line)}") from None
        except _WorkerDied as died:
            raise _WorkerDied(self._kill(str(died))) from None

    def _exchange(self, request: bytes) -> bytes:
        """Write ``request`` and return the reply line (without its newline), all before the session deadline."""
        self._pump(b"", timeout=0)
        if self._stdout:
            raise _WorkerDied(f"protocol error: the worker wrote to stdout outside a reply: {_preview(self._stdout)}")
        pending = request
        while True:
            newline = self._stdout.find(b"\n")
            if newline >= 0:
                if pending:
                    raise _WorkerDied("protocol error: the worker replied before reading the whole request")
                line = bytes(self._stdout[:newline])
                del self._stdout[: newline + 1]
                return line
            remaining = self._deadline - time.monotonic()
            if remaining <= 0:
                raise _WorkerDied(
                    f"worker timed out after {self._limits.wall_seconds:g} s (limits.wall_seconds, from its start)"
                )
            pending = self._pump(pending, timeout=remaining)

    def _pump(self, pending: bytes, timeout: float) -> bytes:
        """One round of I/O: write what stdin takes of ``pending``, read what stdout and stderr hold.

        Returns the part of ``pending`` not yet written.
        """
        stdin = self._process.stdin.fileno()
        stdout = self._process.stdout.fileno()
        if pending:
            self._selector.register(stdin, selectors.EVENT_WRITE)
        try:
            events = self._selector.select(timeout)
        finally:
            if pending:
                self._selector.unregister(stdin)
        for key, _ in events:
            if key.fd == stdin:
                try:
                    pending = pending[os.write(stdin, pending[:READ_CHUNK]) :]
                except BlockingIOError:
                    pass
                except BrokenPipeError:
                    raise _WorkerDied(self._exit_detail("closed its stdin")) from None
            elif key.fd == stdout:
                chunk = os.read(stdout, READ_CHUNK)
                if not chunk:
                    raise _WorkerDied(self._exit_detail("closed its stdout"))
                self._stdout += chunk
                newline = self._stdout.find(b"\n")
                if (newline if newline >= 0 else len(self._stdout)) > self._limits.message_bytes:
                    raise _WorkerDied(
                        f"protocol error: a reply line longer than limits.message_bytes={self._limits.message_bytes}"
                    )
            else:
                self._read_stderr()
        return pending

    def _read_stderr(self) -> bool:
        """Read what the worker's stderr holds into the kept tail; False at its end."""
        stderr = self._process.stderr.fileno()
        chunk = os.read(stderr, READ_CHUNK)
        if not chunk:
            self._selector.unregister(stderr)
            return False
        self._stderr += chunk
        del self._stderr[:-STDERR_KEPT]
        return True

    def _exit_detail(self, what: str) -> str:
        """Why the worker stopped talking: its exit status or signal, or ``what`` it did if it is still running."""
        try:
            code = self._process.wait(timeout=EXIT_WAIT_SECONDS)
        except subprocess.TimeoutExpired:
            return f"the worker {what} without replying"
        if code < 0:
            return f"worker exited with signal {-code} ({signal.Signals(-code).name})"
        return f"worker exited with status {code}"

    def _kill(self, detail: str) -> str:
        """Kill the worker's group, record the error observation and return its detail (with the stderr tail)."""
        kill_group(self._process)
        self._process.wait()
        stdout, stderr = self._process.stdout.fileno(), self._process.stderr.fileno()
        self._selector.unregister(stdout)
        # Killed, the group closes its end at once; a process that left the session may hold it, hence the bound.
        until = time.monotonic() + EXIT_WAIT_SECONDS
        while stderr in self._selector.get_map() and (remaining := until - time.monotonic()) > 0:
            if not self._selector.select(remaining):
                break
            self._read_stderr()
        tail = self._stderr.decode("utf-8", "replace").strip()[-STDERR_SHOWN:]
        if tail:
            detail = f"{detail}; stderr: {tail}"
        self._failure = Observation((), EpisodeStatus.ERROR, detail)
        return detail


def _preview(data: bytes | bytearray) -> str:
    text = bytes(data[: PREVIEW * 4]).decode("utf-8", "replace")
    return repr(text[:PREVIEW]) + ("..." if len(data) > PREVIEW else "")
