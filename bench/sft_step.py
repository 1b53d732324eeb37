"""SFT training-step throughput: dew against TRL's SFTTrainer and a plain torch loop, same model and batch.

Model: the bench's Qwen3-shaped decoder (vocab 8192, hidden 384, 6 layers,
6 heads, 2 KV heads, head_dim 64, MLP 1024, tied embeddings, 12.6M parameters),
randomly initialised; 8 rows of 128 tokens; AdamW; 2 threads. Entries, each measured in
a fresh process (so its peak resident memory is its own), interleaved round by round:

- dew float32;
- dew bf16 compute: float32 master weights, bfloat16 operands for every weight product
  (forward and both gradients) with float32 accumulation (``matmul_dtype=jnp.bfloat16``);
- torch loop: transformers' Qwen3ForCausalLM with torch.optim.AdamW, float32
  (bench/peers/torch_sft.py);
- TRL SFTTrainer float32: ``bf16=False, gradient_checkpointing=False`` (the fair peer);
- TRL SFTTrainer defaults: TRL 1.16's SFTConfig as shipped (bf16 autocast, gradient
  checkpointing) (bench/peers/trl_sft.py).

The peers run in the reference environment .venv-ref (see the README) when it exists.
Each round also measures XLA's float32 and bfloat16 matrix-product rates (4096 x 4096,
the same process kind as dew's) for the model FLOP utilisation: the step's model FLOPs
(3 x the forward pass's products: 2 x tokens x weights, plus the full attention squares)
times steps per second over XLA's float32 rate.

    uv run python bench/sft_step.py [--rounds 3] [--steps 10]

Prints a table and writes bench/results/sft_step.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

from interleaved import PEER_PYTHON, RESULTS, bar_plot, medians, run_rounds

ROWS, WIDTH = 8, 128
SHAPE = dict(vocab_size=8192, emb_features=384, num_layers=6, num_heads=6, num_kv_heads=2, head_dim=64,
             mlp_features=1024)
PEAK_SIZE = 4096


def step_flops(rows: int, width: int) -> float:
    """Model FLOPs of one training step: 3 x (weight products + attention scores and values) of the forward pass."""
    s = SHAPE
    attention_width = s["num_heads"] * s["head_dim"]
    kv_width = s["num_kv_heads"] * s["head_dim"]
    per_layer = s["emb_features"] * (2 * attention_width + 2 * kv_width) + 3 * s["emb_features"] * s["mlp_features"]
    weights = s["num_layers"] * per_layer + s["vocab_size"] * s["emb_features"]  # tied output layer
    tokens = rows * width
    attention = s["num_layers"] * 2 * 2 * rows * width * width * attention_width
    return 3.0 * (2 * tokens * weights + attention)


def dew_worker(precision: str, steps: int) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from dew import Trainer, models
    from dew.objectives import LMObjective

    options = {"matmul_dtype": jnp.bfloat16} if precision == "bf16" else {}
    model = models.build("causal_transformer", **SHAPE, max_seq_len=WIDTH, qk_norm=True, **options)
    trainer = Trainer(LMObjective(model, seq_len=WIDTH, ema_decay=None), optax.adamw(1e-4),
                      key=jax.random.key(0), progress=False)
    batch = {"text": np.random.default_rng(0).integers(0, 8192, (ROWS, WIDTH + 1)).astype(np.int32)}
    state = trainer.initial_state()
    start = time.perf_counter()
    state, _ = trainer.step(state, batch)
    first = time.perf_counter() - start
    state, _ = trainer.step(state, batch)
    start = time.perf_counter()
    for _ in range(steps):
        state, _ = trainer.step(state, batch)
    rate = steps / (time.perf_counter() - start)
    print(json.dumps({"steps_per_second": rate, "first_step_seconds": first,
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
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--worker", choices=("float32", "bf16", "peak"))
    args = parser.parse_args()
    if args.worker == "peak":
        peak_worker()
        return
    if args.worker:
        dew_worker(args.worker, args.steps)
        return

    me = [sys.executable, __file__, "--steps", str(args.steps), "--worker"]
    commands = {"dew float32": me + ["float32"], "dew bf16 compute": me + ["bf16"]}
    peers = {}
    if PEER_PYTHON.exists():
        sizes = [str(args.steps), str(ROWS), str(WIDTH)]
        peers = {
            "torch loop": [str(PEER_PYTHON), "bench/peers/torch_sft.py", *sizes, "2"],
            "TRL SFTTrainer float32": [str(PEER_PYTHON), "bench/peers/trl_sft.py", str(args.steps + 2), str(ROWS),
                                       str(WIDTH), "float32"],
            # Its steps are several times slower on this CPU: fewer of them give as steady a median.
            "TRL SFTTrainer defaults": [str(PEER_PYTHON), "bench/peers/trl_sft.py", str(max(3, args.steps // 2) + 2),
                                        str(ROWS), str(WIDTH), "defaults"],
        }
    commands.update(peers)
    commands["XLA matmul peak"] = me + ["peak"]
    records = run_rounds(commands, args.rounds)
    peak_records = records.pop("XLA matmul peak")
    peak = medians({"peak": peak_records}, ("float32_gflops", "bfloat16_gflops"))["peak"]
    table = medians(records, ("steps_per_second", "peak_rss_gib", "first_step_seconds"))
    flops = step_flops(ROWS, WIDTH)

    print(f"\nSFT step, {ROWS} x {WIDTH} tokens, AdamW, 12.6M-parameter Qwen3-shaped decoder, 2 CPU cores, "
          f"medians of {args.rounds} rounds")
    print(f"XLA matmul {PEAK_SIZE}^2: float32 {peak['float32_gflops']:.0f} GFLOP/s, bfloat16 operands "
          f"{peak['bfloat16_gflops']:.0f} GFLOP/s; model FLOPs per step {flops / 1e9:.1f} G")
    torch_rate = table.get("torch loop", {}).get("steps_per_second")
    trl_rate = table.get("TRL SFTTrainer float32", {}).get("steps_per_second")
    print(f"{'implementation':<25} {'steps/s':>8} {'tokens/s':>9} {'vs torch':>9} {'vs TRL f32':>11} "
          f"{'MFU (XLA f32)':>14} {'peak RSS GiB':>13} {'first step s':>13}")
    for name, m in table.items():
        rate = m["steps_per_second"]
        versus_torch = f"{rate / torch_rate:.2f}x" if torch_rate else "-"
        versus_trl = f"{rate / trl_rate:.2f}x" if trl_rate else "-"
        mfu = f"{100 * rate * flops / 1e9 / peak['float32_gflops']:.0f}%"
        first = f"{m['first_step_seconds']:.1f}" if "first_step_seconds" in m else "-"
        print(f"{name:<25} {rate:>8.3f} {rate * ROWS * WIDTH:>9.0f} {versus_torch:>9} {versus_trl:>11} {mfu:>14} "
              f"{m['peak_rss_gib']:>13.2f} {first:>13}")
    if not peers:
        print("(no peers: create .venv-ref as the README describes to measure the torch loop and TRL)")

    RESULTS.mkdir(parents=True, exist_ok=True)
    versions = {key: r[0][key] for r in records.values() for key in ("torch", "transformers", "trl") if key in r[0]}
    (RESULTS / "sft_step.json").write_text(json.dumps(
        {"rows": ROWS, "width": WIDTH, "records": records, "medians": table, "xla_peak": peak,
         "xla_peak_records": peak_records, "model_flops_per_step": flops, "peer_versions": versions}, indent=2))
    bar_plot(RESULTS / "sft_step.png", f"SFT step, {ROWS}x{WIDTH} tokens, 12.6M params, 2 CPU cores",
             [("steps_per_second", "training steps per second (higher is better)"),
              ("peak_rss_gib", "peak resident memory, GiB")], records)
    print(f"wrote {RESULTS / 'sft_step.json'} and {RESULTS / 'sft_step.png'}")


if __name__ == "__main__":
    main()
