"""Sandbox throughput: programs per second for a trivial Python program through each runner.

Program: ``python3 -c "print(1)"`` (the system interpreter, /usr/bin/python3; in a
container, the image's), no files, no stdin. Each configuration runs ``--programs`` of
them per round through a SandboxFleet (ProcessRunner, BwrapRunner and ContainerRunner on
``--image``, 1 and 2 workers) and, as the floor, in a plain ``subprocess.run`` loop with
captured output and no limits; the configurations take turns within each round. The
figure is the median over rounds; the ratio is against the plain loop. ContainerRunner
is left out, saying so, when no Docker daemon answers or the image is absent
(``uv run python tools/container_env.py up`` provides both).

    uv run python bench/sandbox_throughput.py [--programs 200] [--rounds 3] [--image dew-ray/base:bookworm]

Prints a table and writes bench/results/sandbox_throughput.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path

import matplotlib

from dew.sandbox import BwrapRunner, ContainerRunner, ProcessRunner, Program, SandboxFleet, SandboxLimits, Verdict
from dew.sandbox.launcher import BASE_ENVIRONMENT

ROOT = Path(__file__).resolve().parents[1]
ARGV = ["python3", "-c", "print(1)"]
LIMITS = SandboxLimits(cpu_seconds=10, wall_seconds=30, memory_bytes=1 << 30)


def plain_rate(count: int) -> float:
    python = shutil.which("python3", path=BASE_ENVIRONMENT["PATH"])
    start = time.perf_counter()
    for _ in range(count):
        assert subprocess.run([python, *ARGV[1:]], capture_output=True, check=True).stdout == b"1\n"
    return count / (time.perf_counter() - start)


def fleet_rate(runner, workers: int, count: int) -> float:
    with SandboxFleet(runner, LIMITS, workers=workers) as fleet:
        start = time.perf_counter()
        outcomes = fleet.map([Program(argv=ARGV)] * count)
        seconds = time.perf_counter() - start
    bad = [o for o in outcomes if o.verdict is not Verdict.COMPLETED or o.stdout != "1\n"]
    assert not bad, bad[0]
    return count / seconds


def container_runner(image: str) -> ContainerRunner | None:
    """A ContainerRunner on ``image``, or None (saying why) when Docker or the image is missing."""
    if shutil.which("docker") is None:
        print("no docker CLI: ContainerRunner left out (uv run python tools/container_env.py up)")
        return None
    if subprocess.run(["docker", "image", "inspect", image], capture_output=True, timeout=60).returncode != 0:
        print(f"no Docker daemon answers or {image} is absent: ContainerRunner left out "
              "(uv run python tools/container_env.py up)")
        return None
    return ContainerRunner(image)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--programs", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--image", default="dew-ray/base:bookworm", help="ContainerRunner's image")
    args = parser.parse_args()
    runners = {"ProcessRunner": ProcessRunner(), "BwrapRunner": BwrapRunner()}
    container = container_runner(args.image)
    if container is not None:
        runners["ContainerRunner"] = container
    configs = ["subprocess.run loop"] + [f"{name}, {w} worker{'s' * (w > 1)}" for name in runners for w in (1, 2)]
    rates: dict[str, list[float]] = {config: [] for config in configs}
    fleet_rate(runners["ProcessRunner"], 1, 5)  # warm the page cache and the imports
    for index in range(args.rounds):
        rates[configs[0]].append(plain_rate(args.programs))
        for name, runner in runners.items():
            for workers in (1, 2):
                rates[f"{name}, {workers} worker{'s' * (workers > 1)}"].append(
                    fleet_rate(runner, workers, args.programs))
        print(f"round {index + 1}/{args.rounds}: " + "; ".join(f"{c} {v[-1]:.0f}/s" for c, v in rates.items()))
    plain = statistics.median(rates[configs[0]])
    cores = os.cpu_count()
    print(f"\n{args.programs} programs of `python3 -c \"print(1)\"` per round, median of {args.rounds} rounds, "
          f"{cores} CPU cores")
    print(f"{'how':<26} {'programs/s':>10} {'ms each':>8} {'vs plain':>9}")
    summary = {}
    for config in configs:
        rate = statistics.median(rates[config])
        summary[config] = {"programs_per_second": rate, "ratio_to_plain": rate / plain}
        print(f"{config:<26} {rate:>10.1f} {1e3 / rate:>8.1f} {rate / plain:>8.2f}x")
    results = ROOT / "bench" / "results"
    results.mkdir(parents=True, exist_ok=True)
    versions = {name: runner.describe() for name, runner in runners.items() if hasattr(runner, "describe")}
    (results / "sandbox_throughput.json").write_text(json.dumps(
        {"programs": args.programs, "rounds": args.rounds, "cpu_cores": cores, "runners": versions,
         "rates": rates, "summary": summary}, indent=2))
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 3.6))
    colours = ["#bbbbbb"] + ["#4477aa", "#4477aa", "#228833", "#228833", "#cc6677", "#cc6677"][: len(configs) - 1]
    axis.barh(range(len(configs)), [summary[c]["programs_per_second"] for c in configs], color=colours)
    axis.set_yticks(range(len(configs)), configs)
    axis.invert_yaxis()
    axis.set_xlabel('python3 -c "print(1)" programs per second')
    figure.tight_layout()
    figure.savefig(results / "sandbox_throughput.png", dpi=120)
    print(f"wrote {results / 'sandbox_throughput.json'} and {results / 'sandbox_throughput.png'}")


if __name__ == "__main__":
    main()
