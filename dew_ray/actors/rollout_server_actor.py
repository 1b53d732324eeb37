"""Rollout servers as Ray actors, and the clients sources use to reach them.

``RolloutServerActor`` hosts a :class:`~dew.inference.NativeRolloutServer` (and, if
asked, its OpenAI-compatible front) in a Ray worker process. It is an async actor: each
draw waits on the server's future in the actor's event loop, so hundreds of draws can be
in flight while the server's own thread batches them.

In the trainer process a source talks to it through :class:`RemoteRolloutServer`, which
implements the :class:`~dew.inference.RolloutServer` interface (submit, cancel, load,
version) over Ray calls, so PromptSource and EnvironmentSource run unchanged against a
local server or a remote one. :class:`ServerPool` spreads draws over several servers
(a :class:`~dew.inference.replica_pool.ReplicaPool`: the one with the fewest draws in
flight takes the next) and loads weights into all of them with one object-store put
(:class:`~dew_ray.weight_broadcast.WeightBroadcast`). A server
whose actor dies fails its draws (:class:`~dew.inference.ServerDied`), which the
scheduler sees as infrastructure errors and submits again; the pool leaves the dead
server out from then on. With a ``timeout``, a server that stops answering (its process
stopped or wedged, alive to Ray) is found by its silence: its draws fail the same way and
go to the others, weight loads stop waiting on it, and it takes draws again once it
answers and serves the pool's weights.
"""

from __future__ import annotations

import asyncio
import functools
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from typing import NamedTuple

import ray
from ray.exceptions import ActorDiedError

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
from dew.inference.replica_pool import PooledRolloutServer, ReplicaPool
from dew.inference.rollout_server import settle
from dew_ray.actor_loss import actor_lost
from dew_ray.actors.actor_replicas import RESTART_WAIT, answer
from dew_ray.actors.keyed_calls import KeyedCalls
from dew_ray.kept_arguments import Kept, keep, unkept
from dew_ray.weight_broadcast import WeightBroadcast
from dew.validation import positive_int


class ServerRestarted(ServerDied):
    """A draw reached a rollout server that Ray is restarting, or that restarted and has not loaded the current
    weights yet; the same draw can be submitted again elsewhere, and the server rejoins once it has loaded them."""


class Serving(NamedTuple):
    """What a rollout server answers a probe: the version it serves, and whether it restarted and waits for a load."""

    version: int
    stale: bool = False


def restarted_actor() -> bool:
    """Whether this process is a Ray actor whose constructor Ray is running again after a loss."""
    if not ray.is_initialized():
        return False
    context = ray.get_runtime_context()
    return context.get_actor_id() is not None and context.was_current_actor_reconstructed


class RolloutServerHost:
    """A NativeRolloutServer in its own process; ``RolloutServerActor`` is this class as a Ray actor.

    ``http=True`` also starts the OpenAI-compatible front on ``host`` (loopback by
    default; any other address needs ``api_keys``, which guard its ``/v1`` routes as vLLM's
    ``--api-key`` does); ``url()`` returns its address. ``landing``: a LandingCheck every load must pass
    (a WeightBroadcast to these actors then fails naming the actor whose copy does not match).
    ``pushed``: whether the weights it serves are pushed to it during the run; a host of pushed
    weights that Ray restarted holds stale ones and refuses draws until its next load (a
    judge's never change, so a restarted judge serves at once).
    """

    def __init__(self, task: ServingTask, slots: int, capacity: int, lanes: int = 1, version: int = 0,
                 http: bool = False, tokenizer=None, host: str = "127.0.0.1", landing: LandingCheck | None = None,
                 pushed: bool = True, api_keys: Sequence[str] = (), stale: bool = False):
        # stale: it joins a running pool and serves nothing before its first load
        self.stale = stale or (pushed and restarted_actor())
        task = unkept(task)  # a restartable server's task is kept by name (dew_ray.kept_arguments)
        self.rollout = NativeRolloutServer(Server.from_task(task, slots=slots, capacity=capacity, lanes=lanes),
                                           version=version, landing=landing)
        self._draws = KeyedCalls(self.rollout.cancel)
        # one thread: loads apply in the order they arrive, so a load that waited out a stall never lands
        # after a newer one and the served version never goes back
        self._loads = ThreadPoolExecutor(1, thread_name_prefix="dew-server-load")
        self.front = None
        if http:
            self.front = OpenAIFront(self.rollout, tokenizer, host=host, api_keys=api_keys)

    async def draw(self, key: str, prompt_ids: Sequence[int], max_new_tokens: int, seed: int) -> Draw:
        """Submit one draw and wait for it; ``key`` is the caller's name for it (see ``cancel``)."""
        if self.stale:
            raise ServerRestarted(f"this rollout server restarted and serves version {self.rollout.version}, not the "
                                  "run's current weights, until a load reaches it")
        return await self._draws.run(
            key, lambda: self.rollout.submit(prompt_ids, max_new_tokens, seed),
            lambda: Draw([], [], [], eos=False, version=self.rollout.version, finish_reason="cancelled"))

    async def cancel(self, key: str) -> None:
        """Stop draw ``key``, also one that has not arrived yet (:class:`~dew_ray.actors.keyed_calls.KeyedCalls`)."""
        self._draws.cancel(key)

    async def load(self, variables, version: int) -> int:
        """Serve ``variables`` from the next decode step on; returns the version now served."""
        await asyncio.get_running_loop().run_in_executor(self._loads, self.rollout.load, variables, version)
        self.stale = False
        return self.rollout.version

    async def version(self) -> int:
        return self.rollout.version

    async def serving(self) -> Serving:
        """The version served, and whether this host restarted and refuses draws until a load (``stale``)."""
        return Serving(self.rollout.version, self.stale)

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
    ``died`` turns true when Ray reports the actor dead (a draw or a probe that failed with
    ``ActorDiedError``), before that draw's future is set: a caller that draws again at once
    must not land on it, and a dead server, failing its draws at once, is always the least busy.
    ``on_restart(why)``, when set (a pool sets it), is called just as early for a draw that
    found the actor restarting or restarted and not yet loaded.
    """

    def __init__(self, actor, name: str = "rollout server", version: int | None = None,
                 publisher: WeightBroadcast | None = None):
        self.actor, self.name = actor, name
        if publisher is None:
            served = ray.get(actor.version.remote()) if version is None else version
            publisher = WeightBroadcast([actor], [name], version=served)
        self.publisher = publisher
        self.died = False
        self.on_restart = None  # a pool's: called with why, when a draw finds the actor restarting or restarted

    @property
    def version(self) -> int:
        return self.publisher.version

    def submit(self, prompt_ids: Sequence[int], max_new_tokens: int, seed: int = 0) -> DrawFuture:
        future = DrawFuture()
        future.request = uuid.uuid4().hex
        ref = self.actor.draw.remote(future.request, [int(i) for i in prompt_ids], int(max_new_tokens), int(seed))
        ref.future().add_done_callback(lambda done: self._settle(future, done))
        return future

    def _settle(self, future: DrawFuture, done: Future) -> None:
        error = done.exception()
        lost = actor_lost(error)
        if lost == "restarting":  # its process was lost and Ray restarts it: not dead
            error = ServerRestarted(f"{self.name} is being restarted by Ray: {error}")
        elif lost == "dead":
            self.died = self.died or isinstance(error, ActorDiedError)
            error = ServerDied(f"{self.name} died during a draw: {error}")
        elif isinstance(error, ServerRestarted):  # the actor's own refusal, wrapped in Ray's RayTaskError
            error = ServerRestarted(f"{self.name} restarted and has not loaded the current weights yet")
        if isinstance(error, ServerRestarted) and self.on_restart is not None:
            # before the future is set, as ``died``: a caller that draws again at once must not land here
            self.on_restart(str(error))
        settle(future, None if error is not None else done.result(), error)

    def cancel(self, draw: DrawFuture) -> None:
        self.actor.cancel.remote(draw.request)

    def load(self, variables, version: int) -> None:
        self.publisher.load(variables, version)

    def probe(self, timeout: float | None) -> Serving | None:
        """What the actor serves (:class:`Serving`), None when it does not answer within ``timeout`` s or Ray is
        restarting it; ServerDied when dead.

        A blocking Ray call: never call it holding a lock others need.
        """
        try:
            served = answer(self.actor.serving.remote(), self.name, timeout)
        except ServerDied as error:
            self.died = self.died or isinstance(error.__cause__, ActorDiedError)
            raise
        return None if served is None else Serving(int(served[0]), bool(served[1]))

    def alive(self, timeout: float = 30.0) -> bool:
        """Whether the actor lives (one that is slow to answer counts as alive); see ``probe``."""
        try:
            self.probe(timeout)
        except ServerDied:
            return False
        return True


class ServerPool(PooledRolloutServer):
    """Draws spread over several RemoteRolloutServers; weights loaded into all with one put.

    The servers are a :class:`~dew.inference.replica_pool.ReplicaPool` (``replicas``): the
    least busy live server takes the next draw; a failed draw's server is asked whether it
    lives on a thread of the pool's own; one Ray reports dead is left out. The pool's one
    :class:`~dew_ray.weight_broadcast.WeightBroadcast` (``publisher``) holds the served
    version for the pool and its members.

    ``timeout`` (seconds, or None to wait for ever): a server that has draws waiting and
    answers nothing for ``timeout`` seconds is probed; if the probe goes unanswered for
    ``timeout`` seconds too, the server is set aside: its waiting draws fail with
    :class:`~dew.inference.ServerDied` (callers draw them again, on the others), no draw
    goes to it, and weight loads skip it (a load it does not answer within ``timeout`` sets
    it aside as well). It is probed again until it answers; then it loads the pool's newest
    weights (:meth:`WeightBroadcast.rejoin`) and takes draws again. A server Ray is restarting,
    or one that restarted and refuses draws until it loads, is set aside at its first failed
    draw and rejoins the same way (see the module docstring). When no server takes draws and some
    are set aside, a draw waits up to ``RESTART_WAIT`` (300 s) for one to rejoin, as the sandbox
    runners' and environment workers' pools wait: Ray starting the servers of a lost node again,
    each loading the weights before it draws, takes longer than ``timeout``.

    ``task``: the ServingTask the servers were built from, put once by :func:`start_rollout_servers`
    (an ObjectRef, or a :class:`~dew_ray.kept_arguments.Kept` for restartable servers:
    a restarted server runs its constructor on it again), which the pool holds for the run, so
    that a server added mid-run is built from it too; ``close()`` releases a kept one.
    """

    def __init__(self, servers: Sequence[RemoteRolloutServer], timeout: float | None = None, task=None):
        self.task = task
        # catch_up() -> (variables, version) or None: the newest weights from whoever holds them, for a pool that has
        # published nothing (the driver's) to bring a restarted server back by itself; None leaves it aside
        self.catch_up: Callable[[], tuple[object, int] | None] | None = None
        self.servers = list(servers)
        if not self.servers:
            raise ValueError("ServerPool needs at least one server")
        names = [server.name for server in self.servers]
        self.replicas = ReplicaPool(
            names, what="rollout server", work="draws", timeout=timeout,
            probe=lambda i, wait: self.servers[i].probe(wait),
            rejoin=self._rejoin,
            on_aside=lambda i: self.publisher.set_aside(self.servers[i].name),
            died=lambda i: self.servers[i].died, wait=RESTART_WAIT)
        self.publisher = WeightBroadcast([s.actor for s in self.servers], names,
                                         version=min(server.version for server in self.servers), drop_dead=True,
                                         on_aside=self._aside_in_load, **({} if timeout is None else {"timeout": timeout}))
        for index, server in enumerate(self.servers):
            server.publisher = self.publisher
            server.on_restart = functools.partial(self.replicas.set_aside, index)
        self.start_draws()

    @property
    def version(self) -> int:
        return self.publisher.version

    def close(self) -> None:
        super().close()
        if isinstance(self.task, Kept):  # no server of the pool is started or restarted from it again
            self.task.release()
            self.task = None

    def add(self, actor, name: str) -> int:
        """A RolloutServerActor joining mid-run; it takes draws once it has loaded the newest weights this pool
        published (start it with ``stale=True`` so that it refuses draws until a load reaches it)."""
        server = RemoteRolloutServer(actor, name, publisher=self.publisher)
        server.on_restart = None
        self.publisher.add(actor, name)
        self.servers.append(server)
        index = self.replicas.add(name)
        server.on_restart = functools.partial(self.replicas.set_aside, index)
        return index

    def remove(self, name: str, timeout: float) -> int:
        """Take server ``name`` out: no new draw goes to it, its draws in flight get ``timeout`` seconds to finish
        and are then failed as ServerDied (drawn again on the others); returns how many were. The actor is the
        caller's to end."""
        index = next(i for i, server in enumerate(self.servers) if server.name == name)
        abandoned = self.replicas.retire(index, timeout)
        self.publisher.remove(name)
        return abandoned

    def _rejoin(self, index: int, served: Serving) -> bool:
        """Bring a server that answers again to the newest weights. A restarted one needs a pool that has published,
        or one whose ``catch_up`` gives the newest weights (the driver's, from its trainers); otherwise it stays aside
        until a pool that publishes has loaded it."""
        name = self.servers[index].name
        if served.stale and not self.publisher.published:
            newest = self.catch_up() if self.catch_up is not None else None
            return newest is not None and self.publisher.rejoin(name, weights=newest)
        return self.publisher.rejoin(name, None if served.stale else served.version)

    def _abandon(self, server: RemoteRolloutServer, future: DrawFuture, error: BaseException) -> bool:
        if not settle(future, None, error):  # its outcome came first
            return False
        server.cancel(future)  # the actor drops the draw when it answers again
        return True

    def load(self, variables, version: int) -> None:
        """Load every server not set aside (one object-store put); see the class docstring."""
        try:
            self.publisher.load(variables, version)
        finally:
            dropped = set(self.publisher.dropped)
            for index, server in enumerate(self.servers):
                if server.name in dropped:
                    self.replicas.mark_dead(index)

    def _aside_in_load(self, name: str, why: str) -> None:
        """A server the publisher set aside during a load: the pool sets it aside too and probes it until it
        rejoins (a load that finds every server aside waits for that)."""
        self.replicas.set_aside(next(i for i, server in enumerate(self.servers) if server.name == name), why)


def server_pool(pairs: Sequence[tuple[str, object]], timeout: float | None = None) -> ServerPool:
    """A ServerPool over ``(name, RolloutServerActor)`` pairs that another process started (a trainer's, an
    environment worker's), each at the version it serves now."""
    return ServerPool([RemoteRolloutServer(actor, name) for name, actor in pairs], timeout=timeout)


def start_rollout_servers(task: ServingTask, count: int, slots: int, capacity: int, lanes: int = 1,
                          version: int = 0, http: bool = False, num_cpus: float = 1, placement=None,
                          timeout: float | None = None, pushed: bool = True, **options) -> ServerPool:
    """``count`` RolloutServerActors serving ``task``, behind one :class:`ServerPool`.

    ``placement(i)``, when given, returns actor i's options (its CPUs and placement-group bundle);
    ``timeout``: the pool's (how long a silent server is waited for before it is set aside);
    ``pushed``: RolloutServerHost's; ``options`` go to Ray (``max_restarts``: how often Ray
    brings a lost server back; the task is then kept by name, see
    :mod:`dew_ray.kept_arguments`).
    """
    positive_int("count", count)
    # one put for every server, held by the pool (ServerPool's task)
    task = keep(task) if options.get("max_restarts", 0) != 0 else ray.put(task)
    actors = [RolloutServerActor.options(**(placement(i) if placement else {"num_cpus": num_cpus}), **options)
              .remote(task, slots, capacity, lanes=lanes, version=version, http=http, pushed=pushed)
              for i in range(count)]
    return ServerPool([RemoteRolloutServer(actor, f"rollout server {i}") for i, actor in enumerate(actors)],
                      timeout=timeout, task=task)
