"""The main job's held-out reward across seeds: how much of its gain a seed decides.

Runs ``dew-ray rlvr --set seed=N`` once per seed, one after the other, each into a run directory
of its own under ``--out`` (nothing else set but ``progress=false``, so each is the README's
main job), then reads every run's ``held_out.jsonl`` (the held-out reward every 20 updates)
and ``summary.json``. ``--set key=value`` is passed to every run (``--set beta=0`` runs without
the KL term); ``--config FILE`` runs that recipe instead of the main job (the real model's,
``cluster_configs/rlvr-smollm2.toml``: results named after it); ``--runs DIR ...`` reads runs made
earlier instead of starting any.

    uv run python bench/heldout_seeds.py [--seeds 0 1 2 3 4] [--config FILE] [--set key=value ...]
    uv run python bench/heldout_seeds.py --runs runs/s0 runs/s1 ... [--config FILE]

Prints a table (held-out before and after, the gain in standard errors, the run's time) and
writes bench/results/heldout_seeds.{json,png}: one held-out curve per seed, with a band of one
standard error (the spread of the held-out prompts' means over the square root of their count).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def run_seed(seed: int, out: Path, overrides: list[str], config: Path | None = None) -> Path:
    """One main job (or ``config``'s run) with this seed into ``out/s<seed>``; raises naming the seed and the log
    when it fails."""
    run_dir = out / f"s{seed}"
    log = out / f"s{seed}.log"
    command = ["uv", "run", "dew-ray", "rlvr", *(["--config", str(config)] if config else []), "--run-dir",
               str(run_dir), "--set", f"seed={seed}", "--set", "progress=false",
               *[arg for item in overrides for arg in ("--set", item)]]
    started = time.monotonic()
    with log.open("w") as handle:
        code = subprocess.run(command, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise RuntimeError(f"seed {seed}: dew-ray rlvr exited {code}; its output is in {log}")
    print(f"seed {seed}: {time.monotonic() - started:.0f} s", flush=True)
    return run_dir


def read_run(run_dir: Path) -> dict:
    """A run's held-out curve, seed, KL coefficient and wall time, from its run directory."""
    config = json.loads((run_dir / "config.json").read_text())
    lines = (run_dir / "held_out.jsonl").read_text().splitlines()
    curve = [json.loads(line) for line in lines if line.strip()]
    if len(curve) < 2:
        raise ValueError(f"{run_dir}/held_out.jsonl: expected a measurement before and after training, "
                         f"found {len(curve)}")
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"run": str(run_dir), "seed": config["seed"], "beta": config.get("beta", 0.0),
            "steps": [point["step"] for point in curve],
            "reward": [point["reward"]["all"] for point in curve],
            "stderr": [point["reward"]["stderr"] for point in curve],
            "seconds": summary.get("seconds")}


def plot(runs: list[dict], path: Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6.5, 3.8))
    for run in runs:
        low = [r - e for r, e in zip(run["reward"], run["stderr"])]
        high = [r + e for r, e in zip(run["reward"], run["stderr"])]
        line, = axis.plot(run["steps"], run["reward"], marker="o", markersize=3,
                          label=f"seed {run['seed']} (beta {run['beta']:g})")
        axis.fill_between(run["steps"], low, high, color=line.get_color(), alpha=0.12)
    axis.set_xlabel("GRPO update")
    axis.set_ylabel("held-out reward (64 tasks x 4 draws)")
    axis.set_title(f"dew-ray rlvr{title}: held-out reward per seed, band of one standard error", fontsize=9)
    axis.legend(fontsize=8, loc="lower right")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="passed to every run as --set KEY=VALUE")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "heldout_seeds", help="where the runs go")
    parser.add_argument("--runs", type=Path, nargs="+", help="read these run directories instead of running")
    parser.add_argument("--config", type=Path, default=None, help="a recipe to run instead of the main job")
    args = parser.parse_args(argv)
    if args.runs:
        directories = args.runs
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        directories = [run_seed(seed, args.out, args.overrides, args.config) for seed in args.seeds]
    runs = [read_run(directory) for directory in directories]
    print(f"{'seed':>4} {'beta':>5} {'before':>7} {'after':>7} {'gain':>7} {'gain / s.e.':>11} {'run':>6}")
    for run in runs:
        gain = run["reward"][-1] - run["reward"][0]
        seconds = f"{run['seconds']:.0f} s" if run["seconds"] is not None else "-"
        print(f"{run['seed']:>4} {run['beta']:>5g} {run['reward'][0]:>7.3f} {run['reward'][-1]:>7.3f} {gain:>+7.3f} "
              f"{gain / run['stderr'][-1]:>11.1f} {seconds:>6}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = "heldout_seeds" + (f"_{args.config.stem}" if args.config else "")
    (RESULTS / f"{name}.json").write_text(json.dumps(runs, indent=1))
    plot(runs, RESULTS / f"{name}.png", f" {args.config.stem}" if args.config else "")
    print(f"wrote {RESULTS / name}.json and {RESULTS / name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
