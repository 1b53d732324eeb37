"""Interleaved measurements in fresh processes, shared by the step and loader benchmarks.

Each measurement is one command that prints a JSON record as its last line; every
round runs every command once, in order, so a noisy stretch of the machine hits all of
them alike. ``medians`` reduces the rounds, ``bar_plot`` draws one bar per entry with
the rounds as dots.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEER_PYTHON = ROOT / ".venv-ref" / "bin" / "python"
RESULTS = ROOT / "bench" / "results"


def measure(command: list[str], env: dict[str, str] | None = None) -> dict:
    """Run ``command`` from the repository root (with ``env`` added to this environment) and return the JSON
    record on its last line."""
    out = subprocess.run(command, capture_output=True, text=True, cwd=ROOT,
                         env=None if env is None else {**os.environ, **env})
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed with code {out.returncode}:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_rounds(commands: dict[str, list[str]], rounds: int, show: str = "steps_per_second",
               environments: dict[str, dict[str, str]] | None = None) -> dict[str, list[dict]]:
    """Every command once per round, in order; prints each round's ``show`` figures (of the records that have one).

    ``environments`` adds variables to the environment of the entries it names.
    """
    records: dict[str, list[dict]] = {name: [] for name in commands}
    for index in range(rounds):
        for name, command in commands.items():
            records[name].append(measure(command, (environments or {}).get(name)))
        shown = (f"{name} {r[-1][show]:.3f}" for name, r in records.items() if show in r[-1])
        print(f"round {index + 1}/{rounds}: " + ", ".join(shown), flush=True)
    return records


def medians(records: dict[str, list[dict]], keys: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """The median of each of ``keys`` over the rounds of every entry (keys an entry lacks are left out)."""
    return {name: {key: statistics.median(r[key] for r in rs) for key in keys if all(key in r for r in rs)}
            for name, rs in records.items()}


def bar_plot(path: Path, title: str, panels: list[tuple[str, str]], records: dict[str, list[dict]]) -> None:
    """One horizontal bar chart per (key, axis label) panel: medians as bars, rounds as dots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(records)
    palette = ["#4477aa", "#66ccee", "#228833", "#ccbb44", "#bbbbbb", "#ee6677", "#aa3377"]
    figure, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels) + 1.5, 0.45 * len(names) + 1.4),
                                squeeze=False)
    for column, (key, label) in enumerate(panels):
        axis = axes[0][column]
        values = [statistics.median(r[key] for r in records[n]) for n in names]
        axis.barh(names, values, color=[palette[i % len(palette)] for i in range(len(names))])
        for index, name in enumerate(names):
            axis.plot([r[key] for r in records[name]], [index] * len(records[name]), "k.", markersize=4)
        axis.set_xlabel(label)
        if column:
            axis.set_yticks([])
        axis.invert_yaxis()
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
