"""A :class:`~dew.inference.ReplicaPool` of Ray actors: what the Ray layer adds to the pool is actors and their deaths.

``ActorReplicas(actors, what, work)`` is the pool of RemoteEnvironmentSource's environment
workers and RemoteFleet's sandbox runners: ``call(start)`` runs ``start(index, actor)``
(a Ray call returning an ObjectRef) on the least busy live actor and returns the actor's
index and a Future of the call's result; a call that fails with Ray's ``ActorDiedError``
marks its actor dead, so no later call goes to it. An actor started with ``max_restarts``
whose process or node was lost fails its calls with ``ActorUnavailableError`` while Ray
restarts it: it is set aside (its calls go to the others) and probed until its new
incarnation answers, then takes calls again. With every actor set aside, a call waits up to
``wait`` seconds for one to come back before it fails.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future

import ray
from ray.exceptions import GetTimeoutError

from dew.inference.replica_pool import ReplicaPool
from dew.inference.rollout_server import ServerDied
from dew_ray.actor_loss import ACTOR_GONE, actor_lost

RESTART_WAIT = 300.0  # seconds a call waits for a restarting actor when every actor of the pool is away


def answer(ref, name: str, timeout: float | None):
    """The result of one call on an actor (``ref``); None while the actor gives no answer within ``timeout`` seconds
    or Ray is restarting it; ServerDied naming ``name`` (chained to Ray's error) once it is dead.

    A blocking Ray call: never call it holding a lock others need.
    """
    try:
        return ray.get(ref, timeout=timeout)
    except GetTimeoutError:
        return None
    except ACTOR_GONE as error:
        if actor_lost(error) == "restarting":
            return None
        raise ServerDied(f"{name} has died: {error}") from error


class ActorReplicas(ReplicaPool):
    """Ray actors as the replicas of a pool (see the module docstring)."""

    def __init__(self, actors: Sequence, what: str, work: str, wait: float = RESTART_WAIT):
        self.actors = list(actors)
        super().__init__([f"{what} {i}" for i in range(len(self.actors))], what=what, work=work, probe=self._ready,
                         wait=wait)

    def _ready(self, index: int, timeout: float | None) -> bool | None:
        """True once actor ``index`` answers; None while it is silent or restarting; ServerDied once it is dead."""
        return answer(self.actors[index].__ray_ready__.remote(), self.names[index], timeout)

    def call(self, start: Callable[[int, object], object]) -> tuple[int, Future]:
        """``start(index, actor)`` on the least busy live actor: (index, a Future of the call's result)."""
        ticket = self.take()
        result: Future = Future()

        def done(reply: Future) -> None:
            error = reply.exception()
            lost = actor_lost(error)
            self.release(ticket, died=lost == "dead")
            if lost == "restarting":
                self.set_aside(ticket.replica, "its process was lost and Ray is restarting it")
            if error is None:
                result.set_result(reply.result())
            else:
                result.set_exception(error)

        try:
            reply = start(ticket.replica, self.actors[ticket.replica])
        except BaseException:
            self.release(ticket, failed=True)
            raise
        reply.future().add_done_callback(done)
        return ticket.replica, result
