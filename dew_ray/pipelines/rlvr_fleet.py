"""The RLVR pipeline's rollout fleet between ``servers_min`` and ``servers_max``: servers added and removed mid-run.

A run starts ``servers`` rollout servers. With ``servers_max`` above it, the fleet grows into
nodes that join the cluster: before each update the driver looks for nodes that were not there
at the last look, and when one has come and the cluster has room for one more server (a bundle of
``server_cpus``, ``server_gpus`` and ``server_resources`` free, the run's own servers' bundle), it starts one there or
wherever Ray finds the room (:meth:`RLVRFleet.grow`). Only a node's arrival starts a server: a
fleet shrunk by hand stays shrunk. ``add_servers(n)`` and ``remove_servers(n)`` on the
pipeline change it by hand, within the bounds, and so do requests from outside the driver (``dew-ray
fleet RUN_DIR --add N``, a command-line driver's only way in): :func:`ask` queues a
:class:`FleetRequest` as a file in the run directory's ``fleet-requests/``, and the driver
applies queued requests, in the order asked, before its next update
(:meth:`RLVRFleet.serve_requests`); a request that cannot be met (past a bound, no room within
``ROOM_WAIT`` seconds, a malformed file) is refused, and either way its outcome is a ``fleet.jsonl``
line carrying its id. A removal takes the newest servers that still live and leaves at least ``servers_min``
live ones (a server Ray reports dead is neither taken nor counted). A server added mid-run starts stale: it refuses
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
import os
import secrets
import time
from pathlib import Path
from typing import Literal

import ray
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dew_ray.pipelines.rlvr_actors import RLVRActors
from dew_ray.placement import alive_nodes

GROW_WAIT = 5.0  # seconds a growth waits for its bundle once the free resources say it fits
REQUESTS = "fleet-requests"  # the run directory's folder of fleet changes asked from outside the driver
# seconds an asked-for addition waits for room before it is refused: Ray's view of the free resources trails a removal
# (the server's end, its placement group's release) by seconds on a loaded machine
ROOM_WAIT = 15.0
LIVE_WAIT = 5.0  # seconds a removal waits for a server's answer before counting a silent one as live


class FleetRequest(BaseModel):
    """One change asked of a running pipeline's rollout fleet (``dew-ray fleet``, :func:`ask`).

    change: "add" starts ``count`` servers (at most ``servers_max`` in all), "remove" takes the
    ``count`` newest live ones out (leaving at least ``servers_min``); drain: seconds a removed
    server's draws in flight get to finish before they are drawn again on the others.
    """

    model_config = ConfigDict(extra="forbid")

    change: Literal["add", "remove"]
    count: int = Field(1, ge=1)
    drain: float = Field(30.0, gt=0)


def ask(run_dir: str | Path, request: FleetRequest) -> str:
    """Queue ``request`` for the driver of the run in ``run_dir`` (applied before its next update, in the order
    asked); returns the request's id, which its ``fleet.jsonl`` line carries."""
    folder = Path(run_dir) / REQUESTS
    folder.mkdir(exist_ok=True)
    ident = f"{time.time_ns():020d}-{secrets.token_hex(4)}"  # sorts in the order asked
    partial = folder / f"{ident}.partial"
    partial.write_text(request.model_dump_json())
    os.replace(partial, folder / f"{ident}.json")  # the driver never sees half a request
    return ident


def withdraw(run_dir: str | Path, ident: str) -> bool:
    """Take back a queued request; False when the driver has already taken it (its outcome is coming)."""
    try:
        (Path(run_dir) / REQUESTS / f"{ident}.json").unlink()
        return True
    except FileNotFoundError:
        return False


def outcome(run_dir: str | Path, ident: str) -> dict | None:
    """The ``fleet.jsonl`` line of request ``ident``, None while it has none."""
    path = Path(run_dir) / "fleet.jsonl"
    if not path.exists():
        return None
    for line in path.read_text().splitlines():
        entry = json.loads(line) if line.strip() else {}
        if entry.get("request") == ident:
            return entry
    return None


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

    def add(self, actors: RLVRActors, count: int, step: int, wait: float = 300.0, why: str = "asked",
            **logged) -> list[str]:
        """``count`` more servers, at most ``servers_max`` in all; returns their names."""
        self._within_max(actors, count)
        self.changes += 1
        names, where = actors.add_servers(count, name=f"{self.name}-fleet{self.changes}", wait=wait)
        for name, place in zip(names, where):
            print(f"placement: {name} on node {place.node[:8]} ({place.address})", flush=True)
        self._log(actors, step, "add", names, why=why, **logged)
        return names

    def _within_max(self, actors: RLVRActors, count: int) -> None:
        size = self.size(actors)
        if count < 1 or size + count > self.high:
            raise ValueError(f"adding {count} rollout server(s) to {size} would pass servers_max={self.high}")

    def remove(self, actors: RLVRActors, count: int, step: int, timeout: float, **logged) -> list[str]:
        """Take the ``count`` newest live servers out, leaving at least ``servers_min`` live ones; returns their
        names."""
        if self.config.engine != "native":
            raise ValueError("removing servers during a run needs engine='native' (vLLM engines are a fixed fleet)")
        live = [server.name for server in actors.pool.servers
                if server.name not in actors.removed and server.alive(LIVE_WAIT)]
        if count < 1 or len(live) - count < self.low:
            raise ValueError(f"removing {count} rollout server(s) of {len(live)} live would pass "
                             f"servers_min={self.low}")
        names = live[-count:]
        moved = actors.remove_servers(names, timeout)
        self._log(actors, step, "remove", names, moved=moved, **logged)
        return names

    def serve_requests(self, actors: RLVRActors, step: int) -> None:
        """Apply the requests queued in the run directory (:func:`ask`), in the order asked, each outcome a
        ``fleet.jsonl`` line. One that cannot be met is refused (its line says why) and the run goes on."""
        folder = self.run_dir / REQUESTS
        if not folder.exists():
            return
        for path in sorted([*folder.glob("*.json"), *folder.glob("*.taken")]):
            ident, taken = path.stem, path.with_suffix(".taken")
            # A request taken (renamed) by a driver that then died is served again by the next one, unless its
            # outcome was logged: a rerun starts the fleet at ``servers`` again, so the change is asked of the new
            # fleet.
            if path == taken and outcome(self.run_dir, ident) is not None:
                taken.unlink()
                continue
            try:
                os.replace(path, taken)
            except FileNotFoundError:  # withdrawn meanwhile
                continue
            self._serve(actors, step, ident, taken)
            taken.unlink()

    def _serve(self, actors: RLVRActors, step: int, ident: str, taken: Path) -> None:
        try:
            request = FleetRequest.model_validate_json(taken.read_text())
        except (ValidationError, ValueError, UnicodeDecodeError) as error:
            self._log(actors, step, "refused", [], request=ident,
                      refused=f"{REQUESTS}/{ident}.json is not a fleet request: {error}")
            return
        try:
            if request.change == "add":
                self._within_max(actors, request.count)  # before looking for room, which may wait
                # refused within ROOM_WAIT: the updates do not wait on a node to come
                if not self._room(request.count, within=ROOM_WAIT):
                    raise RuntimeError(f"the cluster has no room now for {request.count} more rollout server(s) "
                                       f"({self._bundle()} each); with servers_max above servers the fleet grows "
                                       "into a node when one joins")
                self.add(actors, request.count, step, wait=ROOM_WAIT, request=ident)
            else:
                self.remove(actors, request.count, step, request.drain, request=ident)
        except (ValueError, RuntimeError) as error:  # past a bound, or no room for the servers' bundles now
            self._log(actors, step, "refused", [], request=ident, asked=request.model_dump(), refused=str(error))

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

    def _bundle(self) -> dict[str, float]:
        return self.config.roles()["rollout server"].bundle()  # one server's bundle, as its placement asks

    def _room(self, count: int = 1, within: float = 0.0) -> bool:
        """Whether the free resources hold ``count`` more servers' bundles, looked at until ``within`` s pass."""
        deadline = time.monotonic() + within
        while True:
            free = ray.available_resources()
            if all(free.get(key, 0.0) >= amount * count for key, amount in self._bundle().items()):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.5)

    def _log(self, actors: RLVRActors, step: int, change: str, names: list[str], **more) -> None:
        entry = {"step": step, "change": change, "servers": names, "size": self.size(actors), **more}
        with open(self.run_dir / "fleet.jsonl", "a") as file:
            file.write(json.dumps(entry) + "\n")
