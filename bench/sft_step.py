"""SFT training-step throughput: dew against a plain torch loop on the same model and batch.

Model: the Qwen3-shaped decoder of shared/PERF.md (vocab 8192, hidden 384, 6 layers,
6 heads, 2 KV heads, head_dim 64, MLP 1024, tied embeddings, 12.6M parameters),
randomly initialised; 8 rows of 128 tokens; AdamW. dew runs in float32 and with
bfloat16 compute over float32 master weights. The peer (bench/peers/torch_sft.py,
transformers' Qwen3ForCausalLM with torch.optim.AdamW, 2 threads) runs in the
reference environment .venv-ref (see shared/DESIGN.md) when it exists. Rounds are
interleaved, dew then peer, and the table reports medians and the ratio.

    uv run python bench/sft_step.py [--rounds 3] [--steps 10]

Prints a table and writes bench/results/sft_step.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dew import Trainer, models
from dew.objectives import LMObjective

ROOT = Path(__file__).resolve().parents[1]
PEER_PYTHON = ROOT / ".venv-ref" / "bin" / "python"
ROWS, WIDTH = 8, 128


def dew_round(dtype, steps: int) -> tuple[float, float]:
    """(steps per second, seconds to compile and run the first step) for one fresh trainer."""
    model = models.build(
        "causal_transformer", vocab_size=8192, emb_features=384, num_layers=6, num_heads=6, num_kv_heads=2,
        head_dim=64, mlp_features=1024, max_seq_len=WIDTH, qk_norm=True, dtype=dtype,
    )
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
    return steps / (time.perf_counter() - start), first


def peer_round(steps: int) -> dict | None:
    if not PEER_PYTHON.exists():
        return None
    out = subprocess.run(
        [str(PEER_PYTHON), str(ROOT / "bench" / "peers" / "torch_sft.py"), str(steps), str(ROWS), str(WIDTH), "2"],
        capture_output=True, text=True, check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()

    rates: dict[str, list[float]] = {"dew float32": [], "dew bf16 compute": [], "torch loop": []}
    compile_seconds: dict[str, list[float]] = {"dew float32": [], "dew bf16 compute": []}
    versions = None
    for round_index in range(args.rounds):
        for name, dtype in (("dew float32", jnp.float32), ("dew bf16 compute", jnp.bfloat16)):
            rate, first = dew_round(dtype, args.steps)
            rates[name].append(rate)
            compile_seconds[name].append(first)
        peer = peer_round(args.steps)
        if peer is not None:
            rates["torch loop"].append(peer["steps_per_second"])
            versions = {"torch": peer["torch"], "transformers": peer["transformers"]}
        print(f"round {round_index + 1}/{args.rounds}: " + ", ".join(f"{k} {v[-1]:.3f}" for k, v in rates.items() if v))

    medians = {name: statistics.median(values) for name, values in rates.items() if values}
    peer = medians.get("torch loop")
    print(f"\nSFT step, {ROWS} x {WIDTH} tokens, AdamW, 12.6M-parameter Qwen3-shaped decoder, {jax.device_count()} device(s)")
    print(f"{'implementation':<20} {'steps/s':>8} {'tokens/s':>9} {'vs torch':>9} {'first step s':>13}")
    for name, rate in medians.items():
        ratio = f"{rate / peer:.2f}x" if peer else "-"
        first = f"{statistics.median(compile_seconds[name]):.1f}" if name in compile_seconds else "-"
        print(f"{name:<20} {rate:>8.3f} {rate * ROWS * WIDTH:>9.0f} {ratio:>9} {first:>13}")
    if peer is None:
        print("(no peer: create .venv-ref as shared/DESIGN.md describes to measure the torch loop)")

    results = ROOT / "bench" / "results"
    results.mkdir(parents=True, exist_ok=True)
    record = {"rows": ROWS, "width": WIDTH, "rates": rates, "medians": medians, "compile_seconds": compile_seconds,
              "peer_versions": versions, "jax": jax.__version__}
    (results / "sft_step.json").write_text(json.dumps(record, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 3))
    names = list(medians)
    axis.barh(names, [medians[n] for n in names], color=["#4477aa", "#66ccee", "#bbbbbb"][: len(names)])
    for index, name in enumerate(names):
        axis.plot(rates[name], [index] * len(rates[name]), "k.", markersize=4)
    axis.set_xlabel("training steps per second (higher is better)")
    axis.set_title(f"SFT step, {ROWS}x{WIDTH} tokens, 12.6M params, 2 CPU cores")
    figure.tight_layout()
    figure.savefig(results / "sft_step.png", dpi=120)
    print(f"wrote {results / 'sft_step.json'} and {results / 'sft_step.png'}")


if __name__ == "__main__":
    main()
