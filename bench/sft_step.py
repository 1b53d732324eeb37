"""SFT training-step throughput: dew against TRL's SFTTrainer and a plain torch loop, same model and batch.

Two model shapes (``--shape``, bench/shapes.py), randomly initialised, AdamW, 2 threads:

- ``bench`` (default): the bench's Qwen3-shaped decoder (vocab 8192, hidden 384, 6 layers,
  6 heads, 2 KV heads, head_dim 64, MLP 1024, tied embeddings, 12.6M parameters); 8 rows
  of 128 tokens, 10 timed steps after 2 warm-up steps, 3 rounds;
- ``qwen3-0.6b``: Qwen3-0.6B's shape (596M parameters, vocabulary 151,936, tied
  embeddings); 2 rows of 128 tokens, 3 timed steps after 2 warm-up steps, 2 rounds.

Entries, each measured in a fresh process (so its peak resident memory is its own),
interleaved round by round:

- dew float32;
- dew bf16 compute: float32 master weights, bfloat16 operands for every weight product
  (forward and both gradients) with float32 accumulation (``matmul_dtype=jnp.bfloat16``);
- dew bf16 compute, 4 KB pages: the same without huge pages (below);
- torch loop: transformers' Qwen3ForCausalLM with torch.optim.AdamW, float32
  (bench/peers/torch_sft.py);
- TRL SFTTrainer float32: ``bf16=False, gradient_checkpointing=False`` (the fair peer);
- TRL SFTTrainer defaults: TRL 1.16's SFTConfig as shipped (bf16 autocast, gradient
  checkpointing) (bench/peers/trl_sft.py).

Every entry but the "4 KB pages" one starts with ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``,
as the processes dew-ray starts do (dew/hugepages.py): glibc then asks for transparent huge
pages for the large allocations XLA (and torch) make and free every step.

The peers run in the reference environment .venv-ref (see docs/benchmarks.md) when it exists.
Each round also measures XLA's float32 and bfloat16 matrix-product rates (4096 x 4096,
the same process kind as dew's) for the model FLOP utilisation: the step's model FLOPs
(3 x the forward pass's products: 2 x tokens x weights, plus the full attention squares)
times steps per second over XLA's rate of the entry's precision.

    uv run python bench/sft_step.py [--shape bench|qwen3-0.6b] [--rounds N] [--steps N]

Prints a table and writes bench/results/sft_step{,_qwen3-0.6b}.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

from interleaved import PEER_PYTHON, RESULTS, bar_plot, medians, run_rounds
from shapes import MODEL_SHAPES, weight_count

from dew.hugepages import hugepage_environment, started_with_hugepages

# shape -> rows, width, timed steps, rounds
SIZES = {"bench": (8, 128, 10, 3), "qwen3-0.6b": (2, 128, 3, 2)}
PEAK_SIZE = 4096
LABELS = {"bench": "12.6M-parameter Qwen3-shaped decoder", "qwen3-0.6b": "Qwen3-0.6B-shaped decoder (596M parameters)"}


def step_flops(shape: str, rows: int, width: int) -> float:
    """Model FLOPs of one training step: 3 x (weight products + attention scores and values) of the forward pass."""
    s = MODEL_SHAPES[shape]
    tokens = rows * width
    attention = s["num_layers"] * 2 * 2 * rows * width * width * s["num_heads"] * s["head_dim"]
    return 3.0 * (2 * tokens * weight_count(shape) + attention)


def dew_worker(shape: str, precision: str, steps: int) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from dew import Trainer, models
    from dew.objectives import LMObjective

    rows, width, _, _ = SIZES[shape]
    options = {"matmul_dtype": jnp.bfloat16} if precision == "bf16" else {}
    model = models.build("causal_transformer", **MODEL_SHAPES[shape], max_seq_len=width, **options)
    trainer = Trainer(LMObjective(model, seq_len=width, ema_decay=None), optax.adamw(1e-4),
                      key=jax.random.key(0), progress=False)
    vocab = MODEL_SHAPES[shape]["vocab_size"]
    batch = {"text": np.random.default_rng(0).integers(0, vocab, (rows, width + 1)).astype(np.int32)}
    state = trainer.initial_state()
    start = time.perf_counter()
    state, _ = trainer.step(state, batch)
    first = time.perf_counter() - start
    state, _ = trainer.step(state, batch)
    start = time.perf_counter()
    for _ in range(steps):
        state, _ = trainer.step(state, batch)
    rate = steps / (time.perf_counter() - start)
    print(json.dumps({"steps_per_second": rate, "first_step_seconds": first, "hugepages": started_with_hugepages(),
                      "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))


def peak_worker() -> None:
    """XLA's matrix-product rate on this machine, float32 and bfloat16 operands with float32 accumulation."""
    import jax
    import jax.numpy as jnp

    record = {}
    for name, dtype in (("float32", jnp.float32), ("bfloat16", jnp.bfloat16)):
        a = jax.random.normal(jax.random.key(0), (PEAK_SIZE, PEAK_SIZE)).astype(dtype)
        b = jax.random.normal(jax.random.key(1), (PEAK_SIZE, PEAK_SIZE)).astype(dtype)
        product = jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=jnp.float32))
        product(a, b).block_until_ready()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            product(a, b).block_until_ready()
            times.append(time.perf_counter() - start)
        record[f"{name}_gflops"] = 2 * PEAK_SIZE**3 / min(times) / 1e9
    print(json.dumps(record))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=tuple(SIZES), default="bench")
    parser.add_argument("--rounds", type=int, help="default: 3 (bench), 2 (qwen3-0.6b)")
    parser.add_argument("--steps", type=int, help="timed steps per entry; default: 10 (bench), 3 (qwen3-0.6b)")
    parser.add_argument("--worker", choices=("float32", "bf16", "peak"))
    args = parser.parse_args()
    rows, width, steps, rounds = SIZES[args.shape]
    steps, rounds = args.steps or steps, args.rounds or rounds
    if args.worker == "peak":
        peak_worker()
        return
    if args.worker:
        dew_worker(args.shape, args.worker, steps)
        return

    me = [sys.executable, __file__, "--shape", args.shape, "--steps", str(steps), "--worker"]
    commands = {"dew float32": me + ["float32"], "dew bf16 compute": me + ["bf16"],
                "dew bf16 compute, 4 KB pages": me + ["bf16"]}
    peers = {}
    if PEER_PYTHON.exists():
        sizes = [str(steps), str(rows), str(width)]
        peers = {
            "torch loop": [str(PEER_PYTHON), "bench/peers/torch_sft.py", *sizes, "2", args.shape],
            "TRL SFTTrainer float32": [str(PEER_PYTHON), "bench/peers/trl_sft.py", str(steps + 2), str(rows),
                                       str(width), "float32", args.shape],
            # Its steps are several times slower on this CPU: fewer of them give as steady a median.
            "TRL SFTTrainer defaults": [str(PEER_PYTHON), "bench/peers/trl_sft.py", str(max(3, steps // 2) + 2),
                                        str(rows), str(width), "defaults", args.shape],
        }
    commands.update(peers)
    commands["XLA matmul peak"] = me + ["peak"]
    huge = hugepage_environment()
    environments = {name: huge for name in commands if name != "dew bf16 compute, 4 KB pages"}
    records = run_rounds(commands, rounds, environments=environments)
    peak_records = records.pop("XLA matmul peak")
    peak = medians({"peak": peak_records}, ("float32_gflops", "bfloat16_gflops"))["peak"]
    table = medians(records, ("steps_per_second", "peak_rss_gib", "first_step_seconds"))
    flops = step_flops(args.shape, rows, width)

    label = LABELS[args.shape]
    print(f"\nSFT step, {rows} x {width} tokens, AdamW, {label}, 2 CPU cores, medians of {rounds} rounds")
    print(f"XLA matmul {PEAK_SIZE}^2: float32 {peak['float32_gflops']:.0f} GFLOP/s, bfloat16 operands "
          f"{peak['bfloat16_gflops']:.0f} GFLOP/s; model FLOPs per step {flops / 1e9:.1f} G")
    torch_rate = table.get("torch loop", {}).get("steps_per_second")
    trl_rate = table.get("TRL SFTTrainer float32", {}).get("steps_per_second")
    dew_rate = table["dew float32"]["steps_per_second"]
    print(f"{'implementation':<29} {'steps/s':>8} {'tokens/s':>9} {'vs dew f32':>10} {'vs torch':>9} "
          f"{'vs TRL f32':>11} {'MFU f32':>8} {'MFU bf16':>9} {'peak RSS GiB':>13} {'first step s':>13}")
    for name, m in table.items():
        rate = m["steps_per_second"]
        versus_torch = f"{rate / torch_rate:.2f}x" if torch_rate else "-"
        versus_trl = f"{rate / trl_rate:.2f}x" if trl_rate else "-"
        mfu = {kind: f"{100 * rate * flops / 1e9 / peak[f'{kind}_gflops']:.0f}%" for kind in ("float32", "bfloat16")}
        first = f"{m['first_step_seconds']:.1f}" if "first_step_seconds" in m else "-"
        print(f"{name:<29} {rate:>8.3f} {rate * rows * width:>9.0f} {rate / dew_rate:>9.2f}x {versus_torch:>9} "
              f"{versus_trl:>11} {mfu['float32']:>8} {mfu['bfloat16']:>9} {m['peak_rss_gib']:>13.2f} {first:>13}")
    if not peers:
        print("(no peers: create .venv-ref as docs/benchmarks.md describes to measure the torch loop and TRL)")

    RESULTS.mkdir(parents=True, exist_ok=True)
    suffix = "" if args.shape == "bench" else f"_{args.shape}"
    versions = {key: r[0][key] for r in records.values() for key in ("torch", "transformers", "trl") if key in r[0]}
    (RESULTS / f"sft_step{suffix}.json").write_text(json.dumps(
        {"shape": args.shape, "rows": rows, "width": width, "steps": steps, "records": records, "medians": table,
         "xla_peak": peak, "xla_peak_records": peak_records, "model_flops_per_step": flops, "peer_versions": versions,
         "environments": environments}, indent=2))
    bar_plot(RESULTS / f"sft_step{suffix}.png", f"SFT step, {rows}x{width} tokens, {label}, 2 CPU cores",
             [("steps_per_second", "training steps per second (higher is better)"),
              ("peak_rss_gib", "peak resident memory, GiB")], records)
    print(f"wrote {RESULTS / f'sft_step{suffix}.json'} and {RESULTS / f'sft_step{suffix}.png'}")


if __name__ == "__main__":
    main()
