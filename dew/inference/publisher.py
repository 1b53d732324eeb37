"""The weight-publisher protocol: how the trainer's weights reach whatever serves the rollouts.

A :class:`WeightPublisher` has ``load(variables, version)``, which makes ``version`` the
served policy, and ``version``, the version served now. The RolloutScheduler pushes
through one and checks the type, not the attribute names. Every rollout server is one
(:class:`~dew.inference.RolloutServer` derives from it: the native server loads its own
Server); publishers that serve other processes implement it too: ``WeightBroadcast``
(Ray actors through the object store, in ``dew_ray.weight_broadcast``), and the publishers for
vLLM and SGLang replicas to come (safetensors reload, NCCL, a stamped Publication).

``version`` is held by the publisher alone: a client, a pool or a broadcast that serves
through another publisher reads that one's version rather than keeping a copy, so no
two places can disagree about what is served.
"""

from __future__ import annotations

import abc


class WeightPublisher(abc.ABC):
    """Publishes trainer weights as a numbered policy version (see the module docstring)."""

    @abc.abstractmethod
    def load(self, variables, version: int) -> None:
        """Serve ``variables`` as ``version``; raises (leaving ``version`` where it was) when that fails."""

    @property
    @abc.abstractmethod
    def version(self) -> int:
        """The policy version served now."""
