"""The weight-publisher protocol: how the trainer's weights reach whatever serves the rollouts.

A :class:`WeightPublisher` has ``load(variables, version)``, which makes ``version`` the
served policy, and ``version``, the version served now. The RolloutScheduler pushes
through one and checks the type, not the attribute names. Every rollout server is one
(:class:`~dew.inference.RolloutServer` derives from it: the native server loads its own
Server), and so are the publishers that serve other processes: ``WeightBroadcast`` (Ray
actors through the object store, in :mod:`dew_ray.weight_broadcast`) and
:class:`~dew.inference.safetensors_reload.Publication`, the versioned face of a push to
vLLM or SGLang replicas (:class:`~dew.inference.safetensors_reload.SafetensorsReload`
through the disk, :class:`~dew.inference.nccl_push.NCCLPush` by NCCL broadcast).

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
