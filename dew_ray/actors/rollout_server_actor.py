"""Rollout servers as Ray actors, and the clients sources use to reach them.

``RolloutServerActor`` hosts a :class:`~dew.inference.NativeRolloutServer` (and, if
asked, its OpenAI-compatible front) in a Ray worker process. It is an async actor: each
draw waits on the server's future in the actor's event loop, so hundreds of draws can be
in flight while the server's own thread batches them.

In the trainer process a source talks to it through :class:`RemoteRolloutServer`, which
implements the :class:`~dew.inference.RolloutServer` interface (submit, cancel, load,
version) over Ray calls, so PromptSource and EnvironmentSource run unchanged against a
local server or a remote one. :class:`ServerPool` spreads draws over several servers
(the one with the fewest draws in flight takes the next) and loads weights into all of
them with one object-store put (:class:`~dew_ray.weight_broadcast.WeightBroadcast`). A server
whose actor dies fails its draws (:class:`~dew.inference.ServerDied`), which the
scheduler sees as infrastructure errors and submits again; the pool leaves the dead
server out from then on. With a ``timeout``, a server that stops answering (its process
stopped or wedged, alive to Ray) is found by its silence: its draws fail the same way and
go to the others, weight loads stop waiting on it, and it takes draws again once it
answers and serves the pool's weights.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import ray
from ray.exceptions import ActorDiedError, GetTimeoutError, RayActorError

from dew.inference import (
    Draw,
    DrawFuture,
    LandingCheck,
    NativeRolloutServer,
    OpenAIFront,
    RolloutServer,
    Server,
    ServerDied,
    ServingTask,
)
from dew_ray.actors.keyed_calls import KeyedCalls
from dew_ray.weight_broadcast import WeightBroadcast
from dew.validation import positive, positive_int

logger = logging.getLogger(__name__)


class RolloutServerHost:
    """A NativeRolloutServer in its own process; ``RolloutServerActor`` is this class as a Ray actor.

    ``http=True`` also starts the OpenAI-compatible front on ``host`` (loopback by
    default); ``url()`` returns its address. ``landing``: a LandingCheck every load must pass
    (a WeightBroadcast to these actors then fails naming the actor whose copy does not match).
    """

    def __init__(self, task: ServingTask, slots: int, capacity: int, lanes: int = 1, version: int = 0,
                 http: bool = False, tokenizer=None, host: str = "127.0.0.1", landing: LandingCheck | None = None):
        self.rollout = NativeRolloutServer(Server.from_task(task, slots=slots, capacity=capacity, lanes=lanes),
                                           version=version, landing=landing)
        self._draws = KeyedCalls(self.rollout.cancel)
        # one thread: loads apply in the order they arrive, so a load that waited out a stall never lands
        # after a newer one and the served version never goes back
        self._loads = ThreadPoolExecutor(1, thread_name_prefix="dew-server-load")
        self.front = None
        if http:
            self.front = OpenAIFront(self.rollout, tokenizer, host=host)

    async def draw(self, key: str, prompt_ids: Sequence[int], max_new_tokens: int, seed: int) -> Draw:
        """Submit one draw and wait for it; ``key`` is the caller's name for it (see ``cancel``)."""
        return await self._draws.run(
            key, lambda: self.rollout.submit(prompt_ids, max_new_tokens, seed),
            lambda: Draw([], [], [], eos=False, version=self.rollout.version, finish_reason="cancelled"))

    async def cancel(self, key: str) -> None:
        """Stop draw ``key``, also one that has not arrived yet (:class:`~dew_ray.actors.keyed_calls.KeyedCalls`)."""
        self._draws.cancel(key)

    async def load(self, variables, version: int) -> int:
        """Serve ``variables`` from the next decode step on; returns the version now served."""
        await asyncio.get_running_loop().run_in_executor(self._loads, self.rollout.load, variables, version)
        return self.rollout.version

    async def version(self) -> int:
        return self.rollout.version

    async def url(self) -> str | None:
        return None if self.front is None else self.front.url

    async def in_flight(self) -> int:
        return len(self._draws)

    async def close(self) -> None:
        if self.front is not None:
            self.front.close()
        self.rollout.close()
        self._loads.shutdown(wait=False)


RolloutServerActor = ray.remote(RolloutServerHost)


class RemoteRolloutServer(RolloutServer):
    """The RolloutServer interface over one ``RolloutServerActor`` (see the module docstring).

    The served version is its publisher's: a :class:`~dew_ray.weight_broadcast.WeightBroadcast`
    over this actor alone, or, for a member of a :class:`ServerPool`, the pool's one
    broadcast over every member (``publisher``), so a member's version is the pool's.
    """

    def __init__(self, actor, name: str = "rollout server", version: int | None = None,
                 publisher: WeightBroadcast | None = None):
        self.actor, self.name = actor, name
        if publisher is None:
            served = ray.get(actor.version.remote()) if version is None else version
            publisher = WeightBroadcast([actor], [name], version=served)
        self.publisher = publisher
        self._lock = threading.Lock()
        self._pending: dict[str, tuple[DrawFuture, float]] = {}  # unanswered draws and when each was sent
        self._answered = time.monotonic()
        # Set when Ray reports the actor dead (before the failed draw's future is: a caller that draws again at once
        # must not land on it, and a dead server, failing draws at once, is always the least busy), or when its pool
        # finds it dead; a pool reads its dead servers from here
        self.died = False

    @property
    def version(self) -> int:
        return self.publisher.version

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._pending)

    def submit(self, prompt_ids: Sequence[int], max_new_tokens: int, seed: int = 0) -> DrawFuture:
        future = DrawFuture()
        future.request = uuid.uuid4().hex
        with self._lock:
            self._pending[future.request] = (future, time.monotonic())
        ref = self.actor.draw.remote(future.request, [int(i) for i in prompt_ids], int(max_new_tokens), int(seed))
        ref.future().add_done_callback(lambda done: self._settle(future, done))
        return future

    def _settle(self, future: DrawFuture, done: Future) -> None:
        with self._lock:
            if self._pending.pop(future.request, None) is None:  # failed already (``fail_pending``)
                return
            self._answered = time.monotonic()
        error = done.exception()
        if error is None:
            future.set_result(done.result())
        elif isinstance(error, RayActorError):
            if isinstance(error, ActorDiedError):  # unavailable for now is not dead
                self.died = True
            future.set_exception(ServerDied(f"{self.name} died during a draw: {error}"))
        else:
            future.set_exception(error)

    def cancel(self, draw: DrawFuture) -> None:
        self.actor.cancel.remote(draw.request)

    def load(self, variables, version: int) -> None:
        self.publisher.load(variables, version)

    def silent_for(self) -> float:
        """Seconds since the actor last answered while draws wait on it (0 when none wait)."""
        with self._lock:
            if not self._pending:
                return 0.0
            since = max(self._answered, min(sent for _, sent in self._pending.values()))
        return time.monotonic() - since

    def probe(self, timeout: float) -> int | None:
        """The version the actor serves, None when it does not answer within ``timeout`` s; ServerDied when dead.

        A blocking Ray call: never call it holding a lock others need.
        """
        try:
            served = ray.get(self.actor.version.remote(), timeout=timeout)
        except RayActorError as error:
            if isinstance(error, ActorDiedError):
                self.died = True
            raise ServerDied(f"{self.name} has died: {error}") from error
        except GetTimeoutError:
            return None
        with self._lock:
            self._answered = time.monotonic()
        return int(served)

    def alive(self, timeout: float = 30.0) -> bool:
        """Whether the actor lives (one that is slow to answer counts as alive); see ``probe``."""
        try:
            self.probe(timeout)
        except ServerDied:
            return False
        return True

    def fail_pending(self, error: BaseException) -> int:
        """Fail every unanswered draw with ``error`` (and cancel it on the actor); returns how many.

        Their replies, if the actor answers later, are dropped.
        """
        with self._lock:
            pending, self._pending = self._pending, {}
        for request, (future, _) in pending.items():
            self.actor.cancel.remote(request)
            future.set_exception(error)
        return len(pending)


class ServerPool(RolloutServer):
    """Draws spread over several RemoteRolloutServers; weights loaded into all with one put.

    The pool's one :class:`~dew_ray.weight_broadcast.WeightBroadcast` holds the served version for
    the pool and its members. When a draw fails, whether its server died is asked on a
    thread of the pool's own, outside the lock ``submit`` takes: a server that stops
    answering delays only the check of its own liveness, never the other servers' draws.

    ``timeout`` (seconds, or None to wait for ever): a server that has draws waiting and
    answers nothing for ``timeout`` seconds is probed; if the probe goes unanswered for
    ``timeout`` seconds too, the server is set aside: its waiting draws fail with
    :class:`~dew.inference.ServerDied` (callers draw them again, on the others), no draw
    goes to it, and weight loads skip it (a load it does not answer within ``timeout`` sets
    it aside as well). It is probed again until it answers; then it loads the pool's newest
    weights (:meth:`WeightBroadcast.rejoin`) and takes draws again.
    """

    def __init__(self, servers: Sequence[RemoteRolloutServer], timeout: float | None = None):
        self.servers = list(servers)
        if not self.servers:
            raise ValueError("ServerPool needs at least one server")
        names = [server.name for server in self.servers]
        if len(set(names)) != len(names):
            raise ValueError(f"the pool's servers need distinct names (a dead one is found by name), got {names}")
        if timeout is not None:
            positive("timeout", timeout, why="seconds, or None")
        self.timeout = timeout
        self.publisher = WeightBroadcast([s.actor for s in self.servers], names,
                                         version=min(server.version for server in self.servers), drop_dead=True,
                                         **({} if timeout is None else {"timeout": timeout}))
        for server in self.servers:
            server.publisher = self.publisher
        self._aside: set[int] = set()  # silent: no draws, no loads, probed until it answers and catches up
        self._probing: set[int] = set()
        self._owner: dict[str, int] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._checks = ThreadPoolExecutor(1, thread_name_prefix="dew-pool-liveness")
        self._probes = ThreadPoolExecutor(len(self.servers), thread_name_prefix="dew-pool-probe")
        if timeout is not None:
            threading.Thread(target=self._watch, name="dew-pool-watch", daemon=True).start()

    @property
    def version(self) -> int:
        return self.publisher.version

    def dead(self) -> list[int]:
        """The servers found dead."""
        return [i for i, server in enumerate(self.servers) if server.died]

    def live(self) -> list[int]:
        """The servers that take draws: not dead, not set aside."""
        with self._lock:
            return [i for i, server in enumerate(self.servers) if not server.died and i not in self._aside]

    def aside(self) -> list[int]:
        """The servers set aside for not answering."""
        with self._lock:
            return sorted(i for i in self._aside if not self.servers[i].died)

    def submit(self, prompt_ids: Sequence[int], max_new_tokens: int, seed: int = 0) -> DrawFuture:
        live = self.live()
        if not live and self.aside() and self.timeout is not None:  # one may answer again soon: wait for it a while
            until = time.monotonic() + self.timeout
            while not (live := self.live()) and self.aside() and time.monotonic() < until:
                time.sleep(0.05)
        if not live:
            raise RuntimeError(f"no rollout server of the pool takes draws: of {len(self.servers)} started, "
                               f"{len(self.dead())} died and {len(self.aside())} stopped answering")
        index = min(live, key=lambda i: self.servers[i].in_flight)
        future = self.servers[index].submit(prompt_ids, max_new_tokens, seed)
        with self._lock:
            self._owner[future.request] = index
        future.add_done_callback(lambda done: self._settled(index, done))
        return future

    def _settled(self, index: int, done: DrawFuture) -> None:
        with self._lock:
            self._owner.pop(done.request, None)
            known = self.servers[index].died or index in self._aside  # its failed draws need no check each
        if done.exception() is not None and not known:
            self._checks.submit(self._check, index)

    def _check(self, index: int) -> None:
        if not self.servers[index].alive():
            self.servers[index].died = True

    def _watch(self) -> None:
        """Probe each server that has draws waiting and has said nothing for ``timeout`` seconds."""
        while not self._closed.wait(min(1.0, self.timeout / 4)):
            for index, server in enumerate(self.servers):
                with self._lock:
                    if server.died or index in self._aside | self._probing:
                        continue
                if server.silent_for() >= self.timeout:
                    self._probe_soon(index)

    def _probe_soon(self, index: int) -> None:
        with self._lock:
            if index in self._probing or self._closed.is_set():
                return
            self._probing.add(index)
        self._probes.submit(self._probe, index)

    def _probe(self, index: int) -> None:
        """Probe server ``index`` until it answers or dies; set it aside while it does not."""
        server = self.servers[index]
        try:
            while not self._closed.is_set():
                try:
                    served = server.probe(self.timeout)
                except ServerDied as error:
                    server.died = True
                    server.fail_pending(error)
                    return
                with self._lock:
                    silent = index in self._aside
                if served is not None and not silent:
                    return
                if served is not None and self.publisher.rejoin(server.name, served):
                    with self._lock:
                        self._aside.discard(index)
                    logger.warning("%s answers again and serves version %d: it takes draws again", server.name,
                                   self.publisher.version)
                    return
                if not silent:  # (served is None)
                    self._set_aside(index, f"it answered nothing for {2 * self.timeout:g} s with draws waiting")
        finally:
            with self._lock:
                self._probing.discard(index)

    def _set_aside(self, index: int, why: str) -> None:
        server = self.servers[index]
        with self._lock:
            self._aside.add(index)
        self.publisher.set_aside(server.name)
        failed = server.fail_pending(ServerDied(f"{server.name} was set aside: {why}; its draws go to the others"))
        logger.warning("%s set aside (%s); %d draws go to the other servers", server.name, why, failed)

    def cancel(self, draw: DrawFuture) -> None:
        with self._lock:
            index = self._owner.get(draw.request)
        if index is not None:
            self.servers[index].cancel(draw)

    def load(self, variables, version: int) -> None:
        """Load every server not set aside (one object-store put); see the class docstring."""
        try:
            self.publisher.load(variables, version)
        finally:
            dropped, aside = set(self.publisher.dropped), set(self.publisher.aside)
            newly = []
            with self._lock:
                for i, server in enumerate(self.servers):
                    if server.name in dropped:
                        server.died = True
                    elif server.name in aside and i not in self._aside:
                        newly.append(i)
            for i in newly:
                self._set_aside(i, f"it did not load version {version} within {self.publisher.timeout:g} s")
                self._probe_soon(i)

    def close(self) -> None:
        self._closed.set()
        self._checks.shutdown(wait=False, cancel_futures=True)
        self._probes.shutdown(wait=False, cancel_futures=True)


def start_rollout_servers(task: ServingTask, count: int, slots: int, capacity: int, lanes: int = 1,
                          version: int = 0, http: bool = False, num_cpus: float = 1, placement=None,
                          timeout: float | None = None, **options) -> ServerPool:
    """``count`` RolloutServerActors serving ``task``, behind one :class:`ServerPool`.

    ``placement(i)``, when given, returns actor i's options (its CPUs and placement-group bundle);
    ``timeout``: the pool's (how long a silent server is waited for before it is set aside).
    """
    positive_int("count", count)
    actors = [RolloutServerActor.options(**(placement(i) if placement else {"num_cpus": num_cpus}), **options)
              .remote(task, slots, capacity, lanes=lanes, version=version, http=http) for i in range(count)]
    return ServerPool([RemoteRolloutServer(actor, f"rollout server {i}") for i, actor in enumerate(actors)],
                      timeout=timeout)
