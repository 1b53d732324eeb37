"""Where a pipeline's actors run: one placement group per role, one bundle per actor, reserved together.

``RolePlacement({"trainer": Role(1, 1.0), "rollout server": Role(2, 1.0, strategy="spread",
resources={"rollout": 1}), ...})`` reserves every role's bundles at once, so a run either gets
all its actors or waits and fails with the roles it could not place named, instead of
starting half of them. Each role is its own placement group: ``strategy`` "pack" (Ray's
``PACK``: on as few nodes as fit) or "spread" (``SPREAD``: over as many nodes as there are,
so a lost node takes as few of the role's actors as it can); ``resources`` are node
resources every bundle of the role asks for, the way a user labels nodes (``ray start
--resources='{"rollout": 4}'``, a custom resource naming the pool a node belongs to): a
role with ``{"rollout": 1}`` runs only on nodes that offer it, one unit per actor.

``options(role, index)`` gives the scheduling options for an actor of that role in its own
bundle, and, for a named placement, the actor's name: ``<name>-<6 hex>/<role>-<index>`` (the
dashboard's actor list shows it; the hex keeps two runs of one name apart). ``where()`` says
on which node each bundle stands now (a bundle whose node was lost moves to a node with
room once Ray finds one, and a restarted actor follows its bundle).
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Mapping
from typing import Literal

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

STRATEGIES = {"pack": "PACK", "spread": "SPREAD"}  # a role's strategy, as Ray's placement groups spell it


@dataclasses.dataclass(frozen=True)
class Role:
    """How many actors a role has and what each reserves (CPUs, GPUs, node resources), and how they are placed."""

    count: int
    cpus: float
    gpus: float = 0.0
    strategy: Literal["pack", "spread"] = "pack"
    resources: Mapping[str, float] = dataclasses.field(default_factory=dict)

    def bundle(self) -> dict[str, float]:
        return {"CPU": float(self.cpus), **({"GPU": float(self.gpus)} if self.gpus else {}),
                **{name: float(amount) for name, amount in self.resources.items()}}

    def describe(self) -> str:
        asks = f"{self.count} x {self.cpus:g} CPU" + (f" + {self.gpus:g} GPU" if self.gpus else "")
        asks += "".join(f" + {amount:g} {name}" for name, amount in self.resources.items())
        return f"{asks}, {self.strategy}"


@dataclasses.dataclass(frozen=True)
class Where:
    """Where one actor's bundle stands: its role and index, the node's id and address."""

    role: str
    index: int
    node: str
    address: str

    def describe(self) -> str:
        return f"{self.role} {self.index} on node {self.node[:8]} ({self.address})"


class RolePlacement:
    """A placement group per role, every role's bundles reserved together (see the module docstring)."""

    def __init__(self, roles: Mapping[str, Role], timeout: float = 300.0, name: str | None = None):
        self.roles = dict(roles)
        for role, spec in self.roles.items():
            if spec.count < 1 or spec.cpus <= 0 or spec.gpus < 0 or any(v <= 0 for v in spec.resources.values()):
                raise ValueError(f"role {role!r} needs at least one actor, a positive CPU count, no negative GPU "
                                 f"count and positive node resources, got {spec}")
            if spec.strategy not in STRATEGIES:
                raise ValueError(f"role {role!r}: strategy must be one of {sorted(STRATEGIES)}, got {spec.strategy!r}")
        self.groups = {role: placement_group([spec.bundle()] * spec.count, strategy=STRATEGIES[spec.strategy],
                                             name=f"{name}/{role}" if name else "")
                       for role, spec in self.roles.items()}
        self.actor_prefix = f"{name}-{uuid.uuid4().hex[:6]}" if name else None
        waiting = {group.ready(): role for role, group in self.groups.items()}
        ready, _ = ray.wait(list(waiting), num_returns=len(waiting), timeout=timeout)
        missing = [waiting[ref] for ref in waiting if ref not in ready]
        if missing:
            self.remove()
            wanted = "; ".join(f"{role}: {self.roles[role].describe()}" for role in missing)
            have = ray.cluster_resources()
            asked = sorted({key for role in missing for key in self.roles[role].bundle()})
            raise RuntimeError(f"the Ray cluster could not place these roles within {timeout:g} s ({wanted}); the "
                               "cluster has " + ", ".join(f"{have.get(key, 0):g} {key}" for key in asked) +
                               " in all, and a bundle must fit on one node")

    def options(self, role: str, index: int = 0) -> dict:
        """Actor options that place actor ``index`` of ``role`` in its own bundle."""
        spec = self.roles[role]
        if not 0 <= index < spec.count:
            raise IndexError(f"role {role!r} has {spec.count} actor(s), not an actor {index}")
        strategy = PlacementGroupSchedulingStrategy(self.groups[role], placement_group_bundle_index=index)
        named = {"name": f"{self.actor_prefix}/{role.replace(' ', '-')}-{index}"} if self.actor_prefix else {}
        return {"num_cpus": spec.cpus, **({"num_gpus": spec.gpus} if spec.gpus else {}),
                **({"resources": dict(spec.resources)} if spec.resources else {}), "scheduling_strategy": strategy,
                **named}

    def where(self) -> list[Where]:
        """Where every bundle stands now, by role and index (a bundle being moved after a node loss is left out)."""
        addresses = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"]}
        found = []
        for role, group in self.groups.items():
            nodes = placement_group_table(group).get("bundles_to_node_id", {})
            found += [Where(role, int(index), node, addresses.get(node, "?")) for index, node in sorted(nodes.items())
                      if node in addresses]
        return found

    def remove(self) -> None:
        for group in self.groups.values():
            remove_placement_group(group)


def alive_nodes() -> set[str]:
    """The ids of the cluster's nodes that are alive now."""
    return {node["NodeID"] for node in ray.nodes() if node["Alive"]}


def shortfall(roles: Mapping[str, Role]) -> str | None:
    """What ``roles`` reserve in all beyond what the cluster's nodes offer (CPUs, GPUs, node resources), said with
    the roles that ask for it, or None when the totals fit. It answers at once, where RolePlacement's wait for
    bundles that can never be placed takes its whole timeout (a bundle must also fit on one node, which only
    RolePlacement finds out)."""
    have = ray.cluster_resources()
    asked: dict[str, float] = {}
    for spec in roles.values():
        for key, amount in spec.bundle().items():
            asked[key] = asked.get(key, 0.0) + spec.count * amount
    short = [key for key, amount in asked.items() if amount > have.get(key, 0.0) + 1e-9]
    if not short:
        return None

    def amount(key: str, value: float) -> str:
        return f"{value:g} {key}s" if key in ("CPU", "GPU") else f"{value:g} {key!r}"

    askers = "; ".join(f"{role}: {spec.describe()}" for role, spec in roles.items()
                       if any(key in spec.bundle() for key in short))
    return (f"the run reserves {', '.join(amount(key, asked[key]) for key in short)} ({askers}) but the Ray cluster "
            f"has {', '.join(amount(key, have.get(key, 0.0)) for key in short)}: lower the roles' counts or their "
            "*_cpus, *_gpus or *_resources fields (node resources come from `ray start --resources`)")
