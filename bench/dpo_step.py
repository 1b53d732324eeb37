"""DPO step throughput and peak memory: dew against TRL's DPOTrainer, and DPO against SFT.

Model: the bench's 12.6M-parameter Qwen3-shaped decoder (vocab 8192, hidden 384,
6 layers, 6 heads, 2 KV heads, head_dim 64, MLP 1024, tied embeddings), fp32, AdamW.
Batch: 8 preference pairs of 64 ids a side (31 prompt ids, 32 completion ids and EOS),
beta 0.1. Each measurement runs in a fresh process, so its peak resident memory
(ru_maxrss) is its own:

- dew DPO: DPOObjective over PreferencePairs rows (policy, frozen reference in the EMA slot);
- dew SFT: LMObjective over the same 16 sequences as one batch (no reference);
- dew DPO bf16 compute: the same with bfloat16 operands for every weight product
  (``matmul_dtype=jnp.bfloat16``, float32 master weights and accumulation);
- TRL DPOTrainer float32 (bench/peers/trl_dpo.py in .venv-ref): ``bf16=False,
  gradient_checkpointing=False``, the like-for-like peer, same shapes, 2 threads;
- TRL DPOTrainer defaults: DPOConfig as TRL 1.16 ships it (bf16 autocast, gradient
  checkpointing).

Rounds are interleaved in that order. The table gives medians and ratios against TRL float32.

    uv run python bench/dpo_step.py [--rounds 3] [--steps 10]

Writes bench/results/dpo_step.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

from interleaved import PEER_PYTHON, RESULTS, bar_plot, medians, run_rounds

VOCAB, PAIRS, PROMPT, ANSWER = 8192, 8, 31, 32


def worker(kind: str, steps: int) -> None:
    """One measurement in this process; prints its JSON record."""
    import jax
    import numpy as np
    import jax.numpy as jnp
    import optax

    from dew import Trainer, models
    from dew.data import Loading, Partition, PreferencePairs
    from dew.objectives import LMObjective
    from dew.objectives.dpo import DPOObjective

    rng = np.random.default_rng(0)
    rows = []
    for _ in range(PAIRS):
        prompt = rng.integers(2, VOCAB, PROMPT).tolist()
        sides = {side: prompt + rng.integers(2, VOCAB, ANSWER).tolist() + [0] for side in ("chosen", "rejected")}
        mask = [0] * PROMPT + [1] * (ANSWER + 1)
        rows.append({**sides, "chosen_mask": mask, "rejected_mask": mask})
    width = PROMPT + ANSWER + 1
    pairs = next(PreferencePairs(records=rows, seq_len=width, loading=Loading(shuffle=False)).load(batch=PAIRS)
                 .train(Partition()))
    model = models.build("causal_transformer", vocab_size=VOCAB, emb_features=384, num_layers=6, num_heads=6,
                         num_kv_heads=2, head_dim=64, mlp_features=1024, max_seq_len=width, qk_norm=True,
                         **({"matmul_dtype": jnp.bfloat16} if kind == "dpo-bf16" else {}))
    if kind.startswith("dpo"):
        objective, batch = DPOObjective(model, seq_len=width - 1, beta=0.1), pairs
    else:
        objective = LMObjective(model, seq_len=width - 1, ema_decay=None)
        batch = {"text": pairs["input_ids"].reshape(2 * PAIRS, width)}
    trainer = Trainer(objective, optax.adamw(1e-4), key=jax.random.key(0), progress=False)
    state = trainer.initial_state()
    for _ in range(2):
        state, _ = trainer.step(state, batch)
    start = time.perf_counter()
    for _ in range(steps):
        state, _ = trainer.step(state, batch)
    rate = steps / (time.perf_counter() - start)
    print(json.dumps({"steps_per_second": rate, "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--worker", choices=("dpo", "dpo-bf16", "sft"))
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps)
        return
    me = [sys.executable, __file__, "--steps", str(args.steps), "--worker"]
    commands = {"dew DPO": me + ["dpo"], "dew SFT (same sequences)": me + ["sft"], "dew DPO bf16 compute": me + ["dpo-bf16"]}
    if PEER_PYTHON.exists():
        commands["TRL DPOTrainer float32"] = [str(PEER_PYTHON), "bench/peers/trl_dpo.py", str(args.steps + 2), "float32"]
        # About 15 times slower a step on this CPU: fewer steps give as steady a median.
        commands["TRL DPOTrainer defaults"] = [str(PEER_PYTHON), "bench/peers/trl_dpo.py", str(max(3, args.steps // 2) + 2),
                                               "defaults"]
    records = run_rounds(commands, args.rounds)
    trl_version = next((r[0]["trl"] for r in records.values() if "trl" in r[0]), None)
    table = medians(records, ("steps_per_second", "peak_rss_gib"))
    peer = table.get("TRL DPOTrainer float32")
    print(f"\nDPO step, {PAIRS} pairs x {PROMPT + ANSWER + 1} ids, beta 0.1, AdamW, 12.6M-parameter decoder, "
          f"2 CPU cores, medians of {args.rounds} rounds")
    print(f"{'implementation':<26} {'steps/s':>8} {'vs TRL f32':>11} {'peak RSS GiB':>13} {'RSS vs TRL f32':>15}")
    for name, m in table.items():
        ratio = f"{m['steps_per_second'] / peer['steps_per_second']:.2f}x" if peer else "-"
        memory = f"{m['peak_rss_gib'] / peer['peak_rss_gib']:.2f}x" if peer else "-"
        print(f"{name:<26} {m['steps_per_second']:>8.3f} {ratio:>11} {m['peak_rss_gib']:>13.2f} {memory:>15}")
    dpo, sft = table["dew DPO"], table["dew SFT (same sequences)"]
    print(f"dew DPO holds {dpo['peak_rss_gib'] - sft['peak_rss_gib']:+.2f} GiB against SFT on the same sequences "
          "(the reference copy and its forward pass)")
    if peer is None:
        print("(no peer: create .venv-ref as the README describes to measure TRL)")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "dpo_step.json").write_text(json.dumps({"records": records, "medians": table, "trl": trl_version}, indent=2))
    bar_plot(RESULTS / "dpo_step.png", "DPO step, 8 pairs x 64 ids, 12.6M params, 2 CPU cores",
             [("steps_per_second", "steps per second (higher is better)"), ("peak_rss_gib", "peak resident memory, GiB")],
             records)
    print(f"wrote {RESULTS / 'dpo_step.json'} and {RESULTS / 'dpo_step.png'}")


if __name__ == "__main__":
    main()
