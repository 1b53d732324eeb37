"""The layers: every module imports only its own layer and the layers below it, as docs/concepts.md's layers table says.

A room is a package (``dew.collection``) or a top-level module of ``dew`` (``dew.trainer``);
``dew.objectives.rl`` is a room of its own, the spec's import paths, above everything in
``dew`` and imported by nothing in the project (tests/test_spec_examples.py checks that).
A module that joins the project has to be placed here, in the layer its imports put it.
"""

import ast
from pathlib import Path

from conftest import ROOT

# Bottom to top; a room may import rooms of its own layer or of a lower one.
LAYERS = [
    ["dew.validation", "dew.config", "dew.hugepages"],
    ["dew.experiment_trackers", "dew.tracking", "dew.models", "dew.sampling", "dew.data", "dew.parallelism",
     "dew.sharding", "dew.checkpoint", "dew.update_record", "dew.optimizers", "dew"],
    ["dew.losses"],  # pure math
    ["dew.records", "dew.flow", "dew.presets"],  # records and packing; the rectified-flow pieces
    ["dew.inference"],  # engines and publishers
    ["dew.objectives"],
    ["dew.trainer", "dew.replay"],
    ["dew.collection"],  # rollouts, sources, scheduler, episodes, journal
    ["dew.sandbox"],
    ["dew.recipes"],
    ["dew.objectives.rl"],  # the spec's facade
    ["dew_harbor"],
    ["dew_ray.ray_auth", "dew_ray.actor_loss", "dew_ray.weight_broadcast", "dew_ray.placement", "dew_ray.dashboard_metrics",
     "dew_ray.kept_arguments"],
    ["dew_ray.actors"],
    ["dew_ray.pipelines"],
    ["dew_ray.cli", "dew_ray"],
]
LEVEL = {room: level for level, rooms in enumerate(LAYERS) for room in rooms}


def room(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] not in ("dew", "dew_ray", "dew_harbor"):
        return None
    if parts[:3] == ["dew", "objectives", "rl"]:
        return "dew.objectives.rl"
    return "dew_harbor" if parts[0] == "dew_harbor" else ".".join(parts[:2])


def imports(path: Path) -> list[tuple[str, int]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, node.lineno))
        elif isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
    return found


def test_every_import_runs_down_the_layers():
    unplaced, upward = set(), []
    for package in ("dew", "dew_ray", "dew_harbor"):
        for path in sorted((ROOT / package).rglob("*.py")):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            source = room(module)
            if source not in LEVEL:
                unplaced.add(source)
                continue
            for target_module, line in imports(path):
                target = room(target_module)
                if target is None or target == source:
                    continue
                if target not in LEVEL:
                    unplaced.add(target)
                elif LEVEL[target] > LEVEL[source]:
                    upward.append(f"{path.relative_to(ROOT)}:{line} ({source}) imports {target_module} ({target})")
    assert not unplaced, f"rooms with no layer in tests/test_layers.py: {sorted(unplaced)}"
    assert not upward, "imports that run up the layers:\n" + "\n".join(upward)


def test_each_module_name_says_one_concept():
    """No module name repeats across the packages, so "where is X" is one hop from the file list."""
    seen: dict[str, list[str]] = {}
    for package in ("dew", "dew_ray", "dew_harbor"):
        for path in (ROOT / package).rglob("*.py"):
            if path.name != "__init__.py":
                seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert not {name: paths for name, paths in seen.items() if len(paths) > 1}
