"""Rollouts from several engine replicas behind one publisher: :class:`EnginePool`.

``EnginePool(servers, timeout=None)`` is one RolloutServer over replicas of an engine
(:class:`~dew.inference.engine_rollout_server.EngineRolloutServer` s: vLLM or SGLang, each
drawing over HTTP) that share one publisher, so one push serves them all and the version is
one. The replicas are a :class:`~dew.inference.replica_pool.ReplicaPool`: the replica with the
fewest draws in flight takes the next, and one whose engine is gone (it refuses the
connection, or ``/health`` reports it unhealthy) is left out.

With ``timeout`` (seconds), a replica that has draws waiting and answers nothing for that
long is probed (``GET /health``); unanswered for another ``timeout`` it is set aside: its
draws fail with :class:`~dew.inference.ServerDied` (callers draw them again on the others),
and the publisher leaves it out of its pushes. A load first probes every live replica the
same way, so a push never waits on a replica that stopped answering before it began. Once a
replica set aside answers again, the publisher catches it up
(:meth:`~dew.inference.safetensors_reload.Publication.rejoin`: a SafetensorsReload reloads it
from the directory the last push wrote and checks the landing; an NCCLPush includes it in
its next push) and it takes draws again. A timeout needs a Publication over a push that can
leave a replica out (SafetensorsReload, NCCLPush). A replica that stalls in the middle of a
push still fails that push after the push's own timeout.

On a trainer of several processes every process has its pool and sets its own replicas
aside for its draws; the push runs on one process, which leaves out the replicas its own
pool set aside.
"""

from __future__ import annotations

from collections.abc import Sequence

from dew.inference.engine_rollout_server import EngineRolloutServer, PublishedRolloutServer
from dew.inference.replica_pool import PooledRolloutServer, ReplicaPool


class EnginePool(PooledRolloutServer, PublishedRolloutServer):
    """Draws spread over engine replicas that share one publisher (see the module docstring)."""

    def __init__(self, servers: Sequence[EngineRolloutServer], timeout: float | None = None):
        self.servers = list(servers)
        if not self.servers:
            raise ValueError("EnginePool needs at least one server")
        self.weights = self.servers[0].weights
        if any(server.weights is not self.weights for server in self.servers):
            raise ValueError("every replica of an EnginePool must share one publisher (its weights), "
                             "so one push serves them all and the version is one")
        if timeout is not None and not getattr(self.weights, "replicated", False):
            raise ValueError(f"EnginePool(timeout={timeout!r}) sets silent replicas aside, which needs a publisher "
                             "that can leave one out of its pushes (a Publication over SafetensorsReload or "
                             f"NCCLPush); got {type(self.weights).__name__}")
        self.replicas = ReplicaPool(
            [server.root for server in self.servers], what="engine", work="draws", timeout=timeout,
            probe=lambda i, wait: self.servers[i].probe(wait),
            rejoin=lambda i, served: self.weights.rejoin(self.servers[i].root),
            on_aside=lambda i: self.weights.set_aside(self.servers[i].root),
            died=lambda i: self.servers[i].died)
        self.start_draws()

    def load(self, variables, version: int) -> None:
        """Publish once through the shared publisher; with a timeout, the replicas that stopped answering first
        leave the push (see the module docstring)."""
        if self.replicas.timeout is not None:
            self.replicas.sweep()
        self.weights.load(variables, version)

    def close(self) -> None:
        super().close()
        for server in self.servers:
            server.close()
