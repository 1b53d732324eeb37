"""Native Server generation throughput against transformers' generate on the same weights.

Model: the 12.6M-parameter Qwen3-shaped decoder of shared/PERF.md, randomly initialised
in dew, exported with Pretrained.save for the peer. Requests: prompts of 16 to 48 ids
(mixed lengths), 128 new tokens each, top-k 50, no EOS stop. Served in float32 and in
bfloat16 (dew: bfloat16 weights and weight products with float32 accumulation; the
peer: the model loaded in bfloat16). For 1, 8 and 32 concurrent requests, dew's
continuous-batching Server (as many slots as requests, in one lane and, from 8
requests, in two lanes decoding side by side) runs them to completion after a warm-up
round; the peer (bench/peers/hf_generate.py in .venv-ref) runs transformers' generate
over the same prompts as one left-padded batch.

The decode step's achieved bandwidth is the weights plus the KV cache it reads per step
(the cache blocks up to the furthest position of the step's requests, averaged over the
steps) divided by the step time, set against this machine's measured copy bandwidth.

    uv run python bench/serve_throughput.py [--rounds 2]

Prints a table and writes bench/results/serve_throughput.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dew import models
from dew.inference import Server
from dew.inference.server import BLOCK_SIZE, blocks_reaching, cache_blocks
from dew.models.pretrained import Pretrained
from dew.sampling import Sampling

ROOT = Path(__file__).resolve().parents[1]
PEER_PYTHON = ROOT / ".venv-ref" / "bin" / "python"
CONCURRENCY = (1, 8, 32)
LANES = {1: (1,), 8: (1, 2), 32: (1, 2)}
PRECISIONS = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
NEW_TOKENS, CAPACITY = 128, 192


def copy_bandwidth() -> float:
    """GB/s of a 512 MiB numpy copy, best of 3."""
    source = np.ones(2**27, np.float32)
    target = np.empty_like(source)
    best = min(_timed(lambda: np.copyto(target, source)) for _ in range(3))
    return 2 * source.nbytes / best / 1e9  # read and write


def _timed(work) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def dew_round(model, variables, prompts: list[list[int]], dtype, lanes: int = 1) -> tuple[float, float]:
    """(tokens per second, seconds per decode step) for one batch of requests run to completion."""
    server = Server(model, variables, Sampling(temperature=1.0, top_k=50), slots=len(prompts), capacity=CAPACITY,
                    dtype=dtype, lanes=lanes)
    for index, prompt in enumerate(prompts):
        server.submit(prompt, NEW_TOKENS, seed=index)
    steps, start = 0, time.perf_counter()
    while server.busy:
        server.step()
        steps += 1
    seconds = time.perf_counter() - start
    return len(prompts) * NEW_TOKENS / seconds, seconds / steps


def peer_round(scratch: str, prompts_file: Path, precision: str) -> dict:
    out = subprocess.run([str(PEER_PYTHON), str(ROOT / "bench" / "peers" / "hf_generate.py"), scratch,
                          str(prompts_file), str(NEW_TOKENS), precision], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def positions_read(prompts: list[list[int]]) -> float:
    """Cache positions per slot that the Server's decode steps read, averaged over the steps of a round."""
    ends = np.cumsum(cache_blocks(CAPACITY, BLOCK_SIZE))
    reach = [max(len(p) for p in prompts) + step + 1 for step in range(NEW_TOKENS)]
    return statistics.mean(float(ends[blocks_reaching(ends, r) - 1]) for r in reach)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    model = models.build("causal_transformer", vocab_size=8192, emb_features=384, num_layers=6, num_heads=6,
                         num_kv_heads=2, head_dim=64, mlp_features=1024, max_seq_len=CAPACITY, qk_norm=True)
    variables = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    rng = np.random.default_rng(0)
    prompts = {str(c): [rng.integers(1, 8192, rng.integers(16, 49)).tolist() for _ in range(c)] for c in CONCURRENCY}
    bandwidth = copy_bandwidth()
    # rates[precision][runner][concurrency] -> tokens/s of each round
    rates = {p: {"dew": {}, "dew, 2 lanes": {}, "transformers": {}} for p in PRECISIONS}
    step_seconds = {p: {} for p in PRECISIONS}
    version = None
    with tempfile.TemporaryDirectory() as scratch:
        Pretrained.from_model(model).save(variables, scratch)
        prompts_file = Path(scratch) / "prompts.json"
        prompts_file.write_text(json.dumps(prompts))
        for precision, dtype in PRECISIONS.items():  # compile every shape before timing
            for concurrency in CONCURRENCY:
                for lanes in LANES[concurrency]:
                    dew_round(model, variables, prompts[str(concurrency)], dtype, lanes)
        for index in range(args.rounds):
            for precision, dtype in PRECISIONS.items():
                by = rates[precision]
                for concurrency in CONCURRENCY:
                    key = str(concurrency)
                    rate, step = dew_round(model, variables, prompts[key], dtype)
                    by["dew"].setdefault(key, []).append(rate)
                    step_seconds[precision].setdefault(key, []).append(step)
                    if 2 in LANES[concurrency]:
                        by["dew, 2 lanes"].setdefault(key, []).append(dew_round(model, variables, prompts[key], dtype, 2)[0])
                if PEER_PYTHON.exists():
                    peer = peer_round(scratch, prompts_file, precision)
                    version = peer.pop("transformers")
                    for key, rate in peer.items():
                        by["transformers"].setdefault(key, []).append(rate)
                print(f"round {index + 1}/{args.rounds}, {precision}: " + "; ".join(
                    f"{name} " + ", ".join(f"{c}: {v[-1]:.0f}" for c, v in runs.items()) for name, runs in by.items() if runs))

    print(f"\nGeneration, 12.6M-parameter decoder, prompts 16-48 ids, {NEW_TOKENS} new tokens, top-k 50, 2 CPU cores; "
          f"copy bandwidth {bandwidth:.1f} GB/s")
    print(f"{'precision':>9} {'concurrency':>11} {'dew tok/s':>10} {'2 lanes':>8} {'HF tok/s':>9} {'ratio':>7} "
          f"{'step ms':>8} {'read GB/s':>10} {'of copy':>8}")
    summary = {}
    for precision, dtype in PRECISIONS.items():
        by = rates[precision]
        weight_bytes = sum(x.size * jnp.dtype(dtype).itemsize for x in jax.tree.leaves(variables))
        for concurrency in CONCURRENCY:
            key = str(concurrency)
            dew = statistics.median(by["dew"][key])
            laned = statistics.median(by["dew, 2 lanes"][key]) if key in by["dew, 2 lanes"] else None
            peer = statistics.median(by["transformers"][key]) if by["transformers"] else None
            best = max(dew, laned or 0.0)
            step = statistics.median(step_seconds[precision][key])
            # float32 keys and values of every layer and slot, over the cache blocks the steps read
            kv_bytes = 2 * 6 * concurrency * positions_read(prompts[key]) * 2 * 64 * 4
            read = (weight_bytes + kv_bytes) / step / 1e9
            summary[f"{precision}/{key}"] = {"dew": dew, "dew_2_lanes": laned, "transformers": peer,
                                             "step_seconds": step, "read_gbps": read}
            print(f"{precision:>9} {concurrency:>11} {dew:>10.0f} {(f'{laned:.0f}' if laned else '-'):>8} "
                  f"{(f'{peer:.0f}' if peer else '-'):>9} {(f'{best / peer:.2f}x' if peer else '-'):>7} "
                  f"{step * 1e3:>8.2f} {read:>10.1f} {read / bandwidth:>7.0%}")
    results = ROOT / "bench" / "results"
    results.mkdir(parents=True, exist_ok=True)
    (results / "serve_throughput.json").write_text(json.dumps(
        {"rates": rates, "summary": summary, "copy_gbps": bandwidth, "transformers": version}, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(PRECISIONS), figsize=(10, 3), sharey=True)
    positions = np.arange(len(CONCURRENCY))
    for axis, precision in zip(axes, PRECISIONS, strict=True):
        rows = [summary[f"{precision}/{c}"] for c in CONCURRENCY]
        axis.bar(positions - 0.27, [r["dew"] for r in rows], 0.27, label="dew Server", color="#4477aa")
        axis.bar(positions, [r["dew_2_lanes"] or 0 for r in rows], 0.27, label="dew Server, 2 lanes", color="#66ccee")
        if version:
            axis.bar(positions + 0.27, [r["transformers"] for r in rows], 0.27,
                     label=f"transformers {version} generate", color="#bbbbbb")
        axis.set_xticks(positions, [f"{c} concurrent" for c in CONCURRENCY])
        axis.set_title(precision)
    axes[0].set_ylabel("generated tokens per second")
    axes[0].legend()
    figure.tight_layout()
    figure.savefig(results / "serve_throughput.png", dpi=120)
    print(f"wrote {results / 'serve_throughput.json'} and {results / 'serve_throughput.png'}")


if __name__ == "__main__":
    main()
