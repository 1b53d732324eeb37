"""Where a pipeline's actors run: one placement group per run, one bundle per actor.

``RolePlacement({"trainer": (count, cpus), "rollout server": (count, cpus), ...})``
reserves every role's CPUs at once (a ``PACK`` placement group: on one node when it
fits, spread over nodes when not), so a run either gets all its actors or waits and
fails with the roles named, instead of starting half of them. ``options(role, index)``
gives the scheduling options for an actor of that role in its own bundle, and, for a
named placement, the actor's name: ``<name>-<6 hex>/<role>-<index>`` (the dashboard's
actor list shows it; the hex keeps two runs of one name apart). The CPUs per
role come from the pipeline config, and so do the GPUs of the roles that ask for them
(``trainer_gpus``, ``server_gpus``).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


class RolePlacement:
    """One placement group holding a bundle of CPUs (and GPUs, for roles that ask) for every actor of every role.

    ``roles`` maps a role to ``(count, cpus)`` or ``(count, cpus, gpus)``.
    """

    def __init__(self, roles: Mapping[str, tuple], timeout: float = 300.0, name: str | None = None):
        self.first: dict[str, int] = {}
        self.roles = {role: (spec[0], spec[1], spec[2] if len(spec) > 2 else 0.0) for role, spec in roles.items()}
        bundles = []
        for role, (count, cpus, gpus) in self.roles.items():
            if count < 1 or cpus <= 0 or gpus < 0:
                raise ValueError(f"role {role!r} needs at least one actor, a positive CPU count and no negative GPU "
                                 f"count, got {count}, {cpus}, {gpus}")
            self.first[role] = len(bundles)
            bundles += [{"CPU": float(cpus), **({"GPU": float(gpus)} if gpus else {})} for _ in range(count)]
        self.group = placement_group(bundles, strategy="PACK", name=name or "")
        self.actor_prefix = f"{name}-{uuid.uuid4().hex[:6]}" if name else None
        ready, _ = ray.wait([self.group.ready()], timeout=timeout)
        if not ready:
            remove_placement_group(self.group)
            wanted = ", ".join(f"{count} {role} x {cpus:g} CPU" + (f" + {gpus:g} GPU" if gpus else "")
                               for role, (count, cpus, gpus) in self.roles.items())
            raise RuntimeError(f"the Ray cluster could not reserve this run's actors within {timeout:g} s ({wanted}; "
                               f"the cluster has {ray.cluster_resources().get('CPU', 0):g} CPUs)")

    def options(self, role: str, index: int = 0) -> dict:
        """Actor options that place actor ``index`` of ``role`` in its own bundle."""
        count, cpus, gpus = self.roles[role]
        if not 0 <= index < count:
            raise IndexError(f"role {role!r} has {count} actor(s), not an actor {index}")
        strategy = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=self.first[role] + index)
        named = {"name": f"{self.actor_prefix}/{role.replace(' ', '-')}-{index}"} if self.actor_prefix else {}
        return {"num_cpus": cpus, **({"num_gpus": gpus} if gpus else {}), "scheduling_strategy": strategy, **named}

    def remove(self) -> None:
        remove_placement_group(self.group)
