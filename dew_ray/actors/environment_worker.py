"""Environment workers: EnvironmentSource sessions run across Ray actors.

``EnvironmentWorker`` hosts an :class:`~dew.collection.sources.EnvironmentSource` in a Ray
worker process: its sessions enter their environments there (tool processes, sandboxes
and their files stay on that actor's node) and submit each turn to the rollout servers
(:class:`~dew_ray.actors.ServerPool` over the RolloutServerActors), so turns of
sessions on every worker share the engines' batches. It is an async actor: a session
waits in the actor's event loop while the source's threads run it.

In the trainer process :class:`RemoteEnvironmentSource` is the SessionSource the
RolloutScheduler talks to: each sample of a group goes to the worker with the fewest
sessions in flight (a :class:`~dew.inference.replica_pool.ReplicaPool`), numbered within the group so identities and seeds never repeat
across workers; ``cancel`` reaches the session on its worker (mid-draw included). A
worker that dies resolves its sessions as INFRA_ERROR, which the scheduler submits
again, to the workers still alive.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import ray

from dew.collection.sources import EnvironmentSource
from dew.records.session_records import Session, SessionSource, Status, Task
from dew_ray.actors.actor_replicas import ActorReplicas
from dew_ray.actors.keyed_calls import KeyedCalls
from dew_ray.kept_arguments import Kept, keep, put_once, unkept
from dew_ray.actors.rollout_server_actor import ServerPool, server_pool
from dew.validation import positive_int


class EnvironmentWorkerHost:
    """An EnvironmentSource over remote rollout servers; ``EnvironmentWorker`` is this class as a Ray actor.

    ``servers``: (name, RolloutServerActor) pairs; ``server_timeout``: the worker's
    ServerPool's ``timeout`` (a server silent that long is set aside); ``environment``,
    ``verifier`` and ``options`` are EnvironmentSource's (``max_prompt_tokens``,
    ``max_new_tokens``, ``max_turns``, ``workers``, ``eos_ids``). ``build``, instead of
    ``environment`` and ``verifier``: a picklable callable that returns the pair, called
    once in the worker's process (for parts that cannot pickle, such as a reward holding a
    sandbox fleet).
    """

    def __init__(self, servers: Sequence, environment: Callable | None = None, verifier: Callable | None = None,
                 server_timeout: float | None = None, build: Callable | None = None, **options):
        # a restartable worker's arguments are kept by name (dew_ray.kept_arguments), released at close
        self._kept = [argument for argument in (servers, environment, verifier, build) if isinstance(argument, Kept)]
        servers, environment, verifier, build = (unkept(argument) for argument in (servers, environment, verifier, build))
        if (build is None) == (environment is None or verifier is None):
            raise ValueError("EnvironmentWorker needs either environment and verifier, or build")
        if build is not None:
            environment, verifier = build()
        self.pool = server_pool(servers, timeout=server_timeout)
        self.source = EnvironmentSource(self.pool, environment, verifier, **options)
        self._sessions = KeyedCalls(self.source.cancel)

    async def run(self, key: str, task: Task, group: int, sample: int) -> Session:
        """Run one session (sample ``sample`` of ``group``) and return it; ``key`` names it for ``cancel``."""
        return await self._sessions.run(
            key, lambda: self.source.submit(task, group, 1, first_sample=sample)[0],
            lambda: Session(task=task, group=group, sample=sample, attempt=0, calls=[], status=Status.CANCELLED,
                            detail="cancelled before it started"))

    async def cancel(self, key: str) -> None:
        """Stop session ``key``, also one that has not arrived yet (:class:`~dew_ray.actors.keyed_calls.KeyedCalls`)."""
        self._sessions.cancel(key)

    async def in_flight(self) -> int:
        return len(self._sessions)

    async def add_servers(self, pairs: list) -> None:
        """Rollout servers joining the worker's pool (see :meth:`ServerPool.add`)."""
        for name, actor in pairs:
            self.pool.add(actor, name)

    async def remove_servers(self, names: list[str], timeout: float) -> int:
        """Take servers out of the worker's pool (see :meth:`ServerPool.remove`)."""
        loop = asyncio.get_running_loop()
        return sum([await loop.run_in_executor(None, self.pool.remove, name, timeout) for name in names])

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.source.close)
        self.pool.close()
        for kept in self._kept:
            await asyncio.get_running_loop().run_in_executor(None, kept.release)


EnvironmentWorker = ray.remote(EnvironmentWorkerHost)


def start_environment_workers(count: int, servers: ServerPool, environment: Callable | None = None,
                              verifier: Callable | None = None, num_cpus: float = 0.5,
                              actor_options: dict | None = None, placement: Callable[[int], dict] | None = None,
                              **options) -> list:
    """``count`` EnvironmentWorkers over the pool's rollout servers.

    ``placement(i)``, when given, returns worker i's options (its CPUs and placement-group bundle)
    in place of ``num_cpus``; ``options`` go to each worker (``build``, ``server_timeout`` and
    EnvironmentSource's). With ``max_restarts`` in ``actor_options``, the servers' handles,
    ``environment``, ``verifier`` and ``build`` are kept by name
    (:mod:`dew_ray.kept_arguments`) for each worker's restarts, until it closes.
    """
    positive_int("count", count)
    pairs = [(server.name, server.actor) for server in servers.servers]
    given = {"servers": pairs, "environment": environment, "verifier": verifier, "build": options.pop("build", None)}
    actor_options = actor_options or {}
    each = [given] * count
    if actor_options.get("max_restarts", 0) != 0:  # one put of each, under each worker's own keys (released at close)
        shared = {name: put_once(value) for name, value in given.items() if value is not None}
        each = [{**given, **{name: keep(reference) for name, reference in shared.items()}} for _ in range(count)]
    return [EnvironmentWorker.options(**(placement(i) if placement else {"num_cpus": num_cpus}), **actor_options)
            .remote(**arguments, **options) for i, arguments in enumerate(each)]


class RemoteEnvironmentSource(SessionSource):
    """The SessionSource over EnvironmentWorkers (see the module docstring)."""

    def __init__(self, workers: Sequence):
        self.workers = list(workers)
        if not self.workers:
            raise ValueError("RemoteEnvironmentSource needs at least one EnvironmentWorker")
        self._lock = threading.Lock()
        self.replicas = ActorReplicas(self.workers, "environment worker", "sessions")
        self._where: dict[Future, tuple[int, str]] = {}

    def submit(self, task: Task, group: int, samples: int) -> list[Future]:
        return [self._start(task, group, sample) for sample in range(samples)]

    def _start(self, task: Task, group: int, sample: int) -> Future:
        future: Future = Future()
        key = uuid.uuid4().hex

        def run(index, worker):
            with self._lock:  # where it runs is known before it starts: a cancel always reaches it
                self._where[future] = (index, key)
            return worker.run.remote(key, task, group, sample)

        index, done = self.replicas.call(run)
        done.add_done_callback(lambda done: self._finish(future, done, index, task, group, sample))
        return future

    def _finish(self, future: Future, done: Future, index: int, task: Task, group: int, sample: int) -> None:
        with self._lock:
            self._where.pop(future, None)
        error = done.exception()
        if error is None:
            future.set_result(done.result())
            return
        # The session never reached a verdict of the policy: an infrastructure failure, submitted again.
        future.set_result(Session(task=task, group=group, sample=sample, attempt=0, calls=[],
                                  status=Status.INFRA_ERROR, detail=f"environment worker {index} failed: {error}"))

    def cancel(self, future: Future) -> None:
        with self._lock:
            where = self._where.get(future)
        if where is not None:
            index, key = where
            self.workers[index].cancel.remote(key)

    @property
    def live(self) -> int:
        """How many workers still take sessions."""
        return len(self.replicas.live())
