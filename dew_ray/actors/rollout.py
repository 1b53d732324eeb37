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
them with one object-store put (:class:`~dew_ray.weights.WeightBroadcast`). A server
whose actor dies fails its draws, which the scheduler sees as infrastructure errors and
submits again; the pool leaves the dead server out from then on.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import ray
from ray.exceptions import RayActorError

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
from dew_ray.weights import WeightBroadcast
from dew.validation import positive_int


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
        self._draws: dict[str, DrawFuture] = {}
        self._cancelled: set[str] = set()
        self.front = None
        if http:
            self.front = OpenAIFront(self.rollout, tokenizer, host=host)

    async def draw(self, key: str, prompt_ids: Sequence[int], max_new_tokens: int, seed: int) -> Draw:
        """Submit one draw and wait for it; ``key`` is the caller's name for it (see ``cancel``)."""
        if key in self._cancelled:  # cancelled before it arrived
            self._cancelled.discard(key)
            return Draw([], [], [], eos=False, version=self.rollout.version, finish_reason="cancelled")
        future = self.rollout.submit(prompt_ids, max_new_tokens, seed)
        self._draws[key] = future
        try:
            return await asyncio.wrap_future(future)
        finally:
            self._draws.pop(key, None)

    async def cancel(self, key: str) -> None:
        future = self._draws.get(key)
        if future is None:
            self._cancelled.add(key)
        else:
            self.rollout.cancel(future)

    async def load(self, variables, version: int) -> int:
        """Serve ``variables`` from the next decode step on; returns the version now served."""
        await asyncio.get_running_loop().run_in_executor(None, self.rollout.load, variables, version)
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


RolloutServerActor = ray.remote(RolloutServerHost)


class RemoteRolloutServer(RolloutServer):
    """The RolloutServer interface over one ``RolloutServerActor`` (see the module docstring).

    The served version is its publisher's: a :class:`~dew_ray.weights.WeightBroadcast`
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
        self.in_flight = 0

    @property
    def version(self) -> int:
        return self.publisher.version

    def submit(self, prompt_ids: Sequence[int], max_new_tokens: int, seed: int = 0) -> DrawFuture:
        future = DrawFuture()
        future.request = uuid.uuid4().hex
        ref = self.actor.draw.remote(future.request, [int(i) for i in prompt_ids], int(max_new_tokens), int(seed))
        with self._lock:
            self.in_flight += 1
        ref.future().add_done_callback(lambda done: self._settle(future, done))
        return future

    def _settle(self, future: DrawFuture, done: Future) -> None:
        with self._lock:
            self.in_flight -= 1
        error = done.exception()
        if error is None:
            future.set_result(done.result())
        elif isinstance(error, RayActorError):
            future.set_exception(ServerDied(f"{self.name} died during a draw: {error}"))
        else:
            future.set_exception(error)

    def cancel(self, draw: DrawFuture) -> None:
        self.actor.cancel.remote(draw.request)

    def load(self, variables, version: int) -> None:
        self.publisher.load(variables, version)

    def alive(self, timeout: float = 30.0) -> bool:
        """Whether the actor answers; a blocking Ray call, so never call it holding a lock others need."""
        try:
            ray.get(self.actor.version.remote(), timeout=timeout)
        except RayActorError:
            return False
        return True


class ServerPool(RolloutServer):
    """Draws spread over several RemoteRolloutServers; weights loaded into all with one put.

    The pool's one :class:`~dew_ray.weights.WeightBroadcast` holds the served version for
    the pool and its members. When a draw fails, whether its server died is asked on a
    thread of the pool's own, outside the lock ``submit`` takes: a server that stops
    answering delays only the check of its own liveness, never the other servers' draws.
    """

    def __init__(self, servers: Sequence[RemoteRolloutServer]):
        self.servers = list(servers)
        if not self.servers:
            raise ValueError("ServerPool needs at least one server")
        names = [server.name for server in self.servers]
        if len(set(names)) != len(names):
            raise ValueError(f"the pool's servers need distinct names (a dead one is found by name), got {names}")
        self.publisher = WeightBroadcast([s.actor for s in self.servers], names,
                                         version=min(server.version for server in self.servers), drop_dead=True)
        for server in self.servers:
            server.publisher = self.publisher
        self._dead: set[int] = set()
        self._owner: dict[str, int] = {}
        self._lock = threading.Lock()
        self._checks = ThreadPoolExecutor(1, thread_name_prefix="dew-pool-liveness")

    @property
    def version(self) -> int:
        return self.publisher.version

    def live(self) -> list[int]:
        with self._lock:
            return [i for i in range(len(self.servers)) if i not in self._dead]

    def submit(self, prompt_ids: Sequence[int], max_new_tokens: int, seed: int = 0) -> DrawFuture:
        live = self.live()
        if not live:
            raise RuntimeError(f"every rollout server of the pool has died ({len(self.servers)} started)")
        index = min(live, key=lambda i: self.servers[i].in_flight)
        future = self.servers[index].submit(prompt_ids, max_new_tokens, seed)
        with self._lock:
            self._owner[future.request] = index
        future.add_done_callback(lambda done: self._settled(index, done))
        return future

    def _settled(self, index: int, done: DrawFuture) -> None:
        with self._lock:
            self._owner.pop(done.request, None)
        if done.exception() is not None:
            self._checks.submit(self._check, index)

    def _check(self, index: int) -> None:
        if not self.servers[index].alive():
            with self._lock:
                self._dead.add(index)

    def cancel(self, draw: DrawFuture) -> None:
        with self._lock:
            index = self._owner.get(draw.request)
        if index is not None:
            self.servers[index].cancel(draw)

    def load(self, variables, version: int) -> None:
        """Load every live server (one object-store put); servers found dead leave the pool."""
        try:
            self.publisher.load(variables, version)
        finally:
            dropped = set(self.publisher.dropped)
            with self._lock:
                self._dead.update(i for i, server in enumerate(self.servers) if server.name in dropped)

    def close(self) -> None:
        self._checks.shutdown(wait=False, cancel_futures=True)


def start_rollout_servers(task: ServingTask, count: int, slots: int, capacity: int, lanes: int = 1,
                          version: int = 0, http: bool = False, num_cpus: float = 1, placement=None,
                          **options) -> ServerPool:
    """``count`` RolloutServerActors serving ``task``, behind one :class:`ServerPool`.

    ``placement(i)``, when given, returns actor i's options (its CPUs and placement-group bundle).
    """
    positive_int("count", count)
    actors = [RolloutServerActor.options(**(placement(i) if placement else {"num_cpus": num_cpus}), **options)
              .remote(task, slots, capacity, lanes=lanes, version=version, http=http) for i in range(count)]
    return ServerPool([RemoteRolloutServer(actor, f"rollout server {i}") for i, actor in enumerate(actors)])
