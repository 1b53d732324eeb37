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

With ``locate`` (``locate(index, timeout)``: the root URL replica ``index``'s engine answers
at now, None while that is not known yet, ServerDied once no engine will come back), an
engine that is gone (it refuses the connection, as when its process died) is not given up:
its host starts it again, perhaps on another node and port. The replica is set aside at once,
its probe asks ``locate`` where the engine is, points the replica and the publisher at the new
root (:meth:`~dew.inference.engine_rollout_server.EngineRolloutServer.move`,
``Publication.move``), and rejoins it as above once it serves the newest weights; until then
the others take its draws, and ``take`` waits up to ``wait`` seconds for one to come back when
none is live, as does a load. A load that fails while an engine is gone sweeps the replicas
and pushes once more to those left.

On a trainer of several processes every process has its pool and sets its own replicas
aside for its draws; the push runs on one process, which leaves out the replicas its own
pool set aside.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from dew.inference.engine_rollout_server import EngineRolloutServer, PublishedRolloutServer
from dew.inference.replica_pool import PooledRolloutServer, ReplicaPool
from dew.inference.rollout_server import ServerDied

logger = logging.getLogger(__name__)


class EnginePool(PooledRolloutServer, PublishedRolloutServer):
    """Draws spread over engine replicas that share one publisher (see the module docstring)."""

    def __init__(self, servers: Sequence[EngineRolloutServer], timeout: float | None = None,
                 locate: Callable[[int, float | None], str | None] | None = None, wait: float | None = None):
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
        if locate is not None and not callable(getattr(self.weights, "move", None)):
            raise ValueError("EnginePool(locate=...) follows engines started again elsewhere, which needs a publisher "
                             f"that can move a replica (a Publication); got {type(self.weights).__name__}")
        self.locate = locate
        self.replicas = ReplicaPool(
            [server.root for server in self.servers], what="engine", work="draws", timeout=timeout,
            probe=self._probe, rejoin=lambda i, served: self.weights.rejoin(self.servers[i].root),
            on_aside=lambda i: self.weights.set_aside(self.servers[i].root),
            died=None if locate else lambda i: self.servers[i].died,
            away=(lambda i: self.servers[i].died) if locate else None, wait=wait)
        self.start_draws()

    def _probe(self, index: int, wait: float | None):
        """What replica ``index`` answers (see ReplicaPool's probe); with ``locate``, a gone engine is set aside
        and, once aside, looked for where its host started it again."""
        server = self.servers[index]
        try:
            return server.probe(wait)
        except ServerDied as error:
            if self.locate is None:
                raise
            gone = error
        if index not in self.replicas.aside():  # set aside first: looking for it is the probe loop's to do
            self.replicas.set_aside(index, f"its engine is gone ({gone}); its host starts it again")
            return None
        root = self.locate(index, wait)
        if root is None:
            return None
        root = root.rstrip("/")
        if root != server.root:
            old = server.root
            self.weights.move(old, root)
            server.move(root)
            self.replicas.rename(index, root)
            logger.warning("the engine of %s answers at %s now", old, root)
        try:
            return server.probe(wait)
        except ServerDied:  # not serving yet where its host says it is: asked again
            return None

    def load(self, variables, version: int) -> None:
        """Publish once through the shared publisher; with a timeout, the replicas that stopped answering first
        leave the push (see the module docstring)."""
        if self.replicas.timeout is not None:
            self.replicas.sweep()
        if self.locate is not None:  # every engine gone from where it was: wait for one to come back
            self.replicas.ready()
        try:
            self.weights.load(variables, version)
        except RuntimeError as error:  # EngineError where the push ran, RuntimeError naming it on the others
            if self.locate is None:
                raise
            # An engine that went during the push fails it; every process of a trainer retries alike (each one's
            # push raises when it failed anywhere), and the engines found gone sit this one out.
            logger.warning("the load of version %d failed (%s); pushing once more to the engines that answer",
                           version, error)
            self.replicas.sweep()
            self.replicas.ready()
            self.weights.load(variables, version)

    def close(self) -> None:
        super().close()
        for server in self.servers:
            server.close()
