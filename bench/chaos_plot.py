"""The chaos bench's plot: a run's progress over time, with every fault it injected.

The line is the number of update lines in ``metrics.jsonl`` as the injector saw it change (a
resume drops the lines after its checkpoint, so the line falls there and climbs again); each
fault is a mark on its own row at the time it was injected, one row per family of faults.
"""

from __future__ import annotations

from pathlib import Path

# fault kinds (as the injector logs them) by the row they are drawn on, bottom to top
FAMILIES = {
    "stopped server or engine": ("SIGSTOP",),
    "killed server or engine": ("ray.kill rollout server", "SIGKILL rollout server process", "SIGKILL vLLM engine"),
    "killed runner or program": ("ray.kill sandbox runner", "SIGKILL sandbox program"),
    "node removed": ("remove node",),
    "fleet request": ("fleet add", "fleet remove"),
    "trainer killed": ("ray.kill trainer",),
    "driver killed": ("SIGKILL driver",),
}


def family(kind: str) -> str:
    """The plot row of a fault kind; a kind no family names gets a row of its own."""
    for name, prefixes in FAMILIES.items():
        if kind.startswith(prefixes):
            return name
    return kind


def plot_timeline(result: dict, path: Path) -> None:
    """Draw ``result`` (``chaos_run``'s, with ``progress`` and ``log``) to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    progress, log = result.get("progress") or [], result.get("log") or []
    times = [t for t, _ in progress] + [entry["time"] for entry in log]
    if not times:
        raise ValueError("the chaos result has neither progress nor faults to plot")
    start = min(times)
    figure, (faults, updates) = plt.subplots(2, 1, figsize=(10, 5.2), sharex=True,
                                             gridspec_kw={"height_ratios": [1, 1.6]})
    updates.step([t - start for t, _ in progress], [n for _, n in progress], where="post", color="k")
    updates.set_ylabel("updates in metrics.jsonl")
    updates.set_xlabel("seconds since the injector began watching the run (the warm start included)")
    rows = [name for name in FAMILIES if any(family(e["fault"]) == name for e in log)]
    rows += sorted({family(e["fault"]) for e in log} - set(rows))
    for index, name in enumerate(rows):
        at = [e["time"] - start for e in log if family(e["fault"]) == name]
        faults.plot(at, [index] * len(at), "|", markersize=12, markeredgewidth=1.5)
        for moment in (at if name in ("driver killed", "trainer killed", "node removed") else []):
            updates.axvline(moment, color=faults.lines[-1].get_color(), alpha=0.5, linewidth=1)
    faults.set_yticks(range(len(rows)), [f"{name} ({sum(family(e['fault']) == name for e in log)})" for name in rows])
    faults.set_ylim(-0.7, len(rows) - 0.3)
    invariants = result.get("invariants", {})
    held = sum(v.get("ok", False) for v in invariants.values())
    faults.set_title(f"chaos run: {result.get('steps')} updates, seed {result.get('seed')}, "
                     f"{result.get('injected', len(log))} faults, {held} of {len(invariants)} invariants held")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
