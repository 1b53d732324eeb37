"""A :class:`~dew.inference.ReplicaPool` of Ray actors: what the Ray layer adds to the pool is actors and their deaths.

``ActorReplicas(actors, what, work)`` is the pool of RemoteEnvironmentSource's environment
workers and RemoteFleet's sandbox runners: ``call(start)`` runs ``start(index, actor)``
(a Ray call returning an ObjectRef) on the least busy live actor and returns the actor's
index and a Future of the call's result; a call that fails with Ray's ``RayActorError``
marks its actor dead, so no later call goes to it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future

from ray.exceptions import RayActorError

from dew.inference.replica_pool import ReplicaPool


class ActorReplicas(ReplicaPool):
    """Ray actors as the replicas of a pool (see the module docstring)."""

    def __init__(self, actors: Sequence, what: str, work: str):
        self.actors = list(actors)
        super().__init__([f"{what} {i}" for i in range(len(self.actors))], what=what, work=work)

    def call(self, start: Callable[[int, object], object]) -> tuple[int, Future]:
        """``start(index, actor)`` on the least busy live actor: (index, a Future of the call's result)."""
        ticket = self.take()
        result: Future = Future()

        def done(reply: Future) -> None:
            error = reply.exception()
            self.release(ticket, died=isinstance(error, RayActorError))
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
