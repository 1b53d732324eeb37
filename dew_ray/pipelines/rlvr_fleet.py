"""The RLVR pipeline's rollout fleet between ``servers_min`` and ``servers_max``: servers added and removed mid-run.

A run starts ``servers`` rollout servers. With ``servers_max`` above it, the fleet grows into
nodes that join the cluster: before each update the driver looks for nodes that were not there
at the last look, and when one has come and the cluster has room for one more server (a bundle of
``server_cpus``, ``server_gpus`` and ``server_resources`` free, the run's own servers' bundle), it starts one there or
wherever Ray finds the room (:meth:`RLVRFleet.grow`). Only a node's arrival starts a server: a
fleet shrunk by hand stays shrunk. ``add_servers(n)`` and ``remove_servers(n)`` on the
pipeline change it by hand, within the bounds. A server added mid-run starts stale: it refuses
draws until a trainer's pool has loaded it with the newest weights that pool published, then
takes its share (:meth:`~dew_ray.pipelines.rlvr_actors.RLVRActors.add_servers`). A removed one
takes no new draw; its draws in flight get a drain timeout to finish, and those still running
then fail as the draws of a dead server do, so the scheduler draws them again on the others:
none is lost. Each change is a line of ``fleet.jsonl`` (the update it came after, the change,
the servers, the size after it, draws moved), and every ``metrics.jsonl`` row carries the
size it was trained with (``fleet/servers``). Only native servers change; a vLLM fleet is
fixed (the config refuses ``servers_max`` above ``servers`` with ``engine="vllm"``).
"""

from __future__ import annotations

import json
from pathlib import Path

import ray

from dew_ray.pipelines.rlvr_actors import RLVRActors
from dew_ray.placement import alive_nodes

GROW_WAIT = 5.0  # seconds a growth waits for its bundle once the free resources say it fits


class RLVRFleet:
    """Bounds, growth and the log of one run's fleet changes (see the module docstring)."""

    def __init__(self, config, run_dir: Path, name: str):
        self.config, self.run_dir, self.name = config, run_dir, name
        self.low, self.high = config.fleet_bounds()
        self.changes = 0  # names each change's placement group
        self.nodes = alive_nodes() if self.high > config.servers else set()  # the nodes seen at the last look

    def size(self, actors: RLVRActors) -> int:
        """How many rollout servers the run has now (started, added, not removed)."""
        return len(actors.pool.servers) - len(actors.removed)

    def add(self, actors: RLVRActors, count: int, step: int, wait: float = 300.0, why: str = "asked") -> list[str]:
        """``count`` more servers, at most ``servers_max`` in all; returns their names."""
        size = self.size(actors)
        if count < 1 or size + count > self.high:
            raise ValueError(f"adding {count} rollout server(s) to {size} would pass servers_max={self.high}")
        self.changes += 1
        names, where = actors.add_servers(count, name=f"{self.name}-fleet{self.changes}", wait=wait)
        for name, place in zip(names, where):
            print(f"placement: {name} on node {place.node[:8]} ({place.address})", flush=True)
        self._log(actors, step, "add", names, why=why)
        return names

    def remove(self, actors: RLVRActors, count: int, step: int, timeout: float) -> list[str]:
        """Take the ``count`` newest servers out, leaving at least ``servers_min``; returns their names."""
        size = self.size(actors)
        if count < 1 or size - count < self.low:
            raise ValueError(f"removing {count} rollout server(s) of {size} would pass servers_min={self.low}")
        names = [server.name for server in actors.pool.servers if server.name not in actors.removed][-count:]
        moved = actors.remove_servers(names, timeout)
        self._log(actors, step, "remove", names, moved=moved)
        return names

    def grow(self, actors: RLVRActors, step: int) -> list[str]:
        """One more server when a node has joined since the last look, the fleet is under ``servers_max`` and the
        cluster has room for the server now."""
        if self.high <= self.config.servers:
            return []
        alive = alive_nodes()
        joined, self.nodes = alive - self.nodes, alive
        if not joined or self.size(actors) >= self.high or not self._room():
            return []
        try:
            return self.add(actors, 1, step, wait=GROW_WAIT, why=f"node {sorted(joined)[0][:8]} joined")
        except RuntimeError:  # the free resources were spread over nodes no one of which holds a bundle
            return []

    def _room(self) -> bool:
        free = ray.available_resources()
        asked = self.config.roles()["rollout server"].bundle()  # one server's bundle, as its placement asks
        return all(free.get(key, 0.0) >= amount for key, amount in asked.items())

    def _log(self, actors: RLVRActors, step: int, change: str, names: list[str], **more) -> None:
        entry = {"step": step, "change": change, "servers": names, "size": self.size(actors), **more}
        with open(self.run_dir / "fleet.jsonl", "a") as file:
            file.write(json.dumps(entry) + "\n")
