"""DPO step throughput and peak memory: dew against TRL's DPOTrainer, and DPO against SFT.

Two model shapes (``--shape``, bench/shapes.py), randomly initialised, fp32 master weights, AdamW,
pairs of 64 ids a side (31 prompt ids, 32 completion ids and EOS), beta 0.1:

- ``bench`` (default): the 12.6M-parameter Qwen3-shaped decoder (vocab 8192, hidden 384,
  6 layers, 6 heads, 2 KV heads, head_dim 64, MLP 1024, tied embeddings); 8 pairs,
  10 timed steps, 3 rounds;
- ``qwen3-0.6b``: Qwen3-0.6B's shape (596M parameters, vocabulary 151,936); 2 pairs,
  3 timed steps, 2 rounds.

Each measurement runs in a fresh process, so its peak resident memory (ru_maxrss) is its own:

- dew DPO: DPOObjective over PreferencePairs rows (policy, frozen reference in the EMA slot);
- dew SFT: LMObjective over the same sequences as one batch (no reference);
- dew DPO bf16 compute: the same with bfloat16 operands for every weight product
  (``matmul_dtype=jnp.bfloat16``, float32 master weights and accumulation);
- TRL DPOTrainer float32 (bench/peers/trl_dpo.py in .venv-ref): ``bf16=False,
  gradient_checkpointing=False``, the like-for-like peer, same shapes, 2 threads;
- TRL DPOTrainer defaults: DPOConfig as TRL 1.16 ships it (bf16 autocast, gradient
  checkpointing).

Every process starts with ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``, as the processes dew-ray
starts do (dew/hugepages.py). Rounds are interleaved in that order. The table gives medians
and ratios against TRL float32.

    uv run python bench/dpo_step.py [--shape bench|qwen3-0.6b] [--rounds N] [--steps N]

Writes bench/results/dpo_step{,_qwen3-0.6b}.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

from interleaved import PEER_PYTHON, RESULTS, bar_plot, medians, run_rounds
from shapes import MODEL_SHAPES

from dew.hugepages import hugepage_environment

PROMPT, ANSWER = 31, 32
# shape -> pairs, timed steps, rounds
SIZES = {"bench": (8, 10, 3), "qwen3-0.6b": (2, 3, 2)}
LABELS = {"bench": "12.6M-parameter decoder", "qwen3-0.6b": "Qwen3-0.6B-shaped decoder (596M parameters)"}


def worker(shape: str, kind: str, steps: int) -> None:
    """One measurement in this process; prints its JSON record."""
    import jax
    import numpy as np
    import jax.numpy as jnp
    import optax

    from dew import Trainer, models
    from dew.data import Loading, Partition, PreferencePairs
    from dew.objectives import LMObjective
    from dew.objectives.dpo import DPOObjective

    pairs_count, vocab = SIZES[shape][0], MODEL_SHAPES[shape]["vocab_size"]
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(pairs_count):
        prompt = rng.integers(2, vocab, PROMPT).tolist()
        sides = {side: prompt + rng.integers(2, vocab, ANSWER).tolist() + [0] for side in ("chosen", "rejected")}
        mask = [0] * PROMPT + [1] * (ANSWER + 1)
        rows.append({**sides, "chosen_mask": mask, "rejected_mask": mask})
    width = PROMPT + ANSWER + 1
    pairs = next(PreferencePairs(records=rows, seq_len=width, loading=Loading(shuffle=False)).load(batch=pairs_count)
                 .train(Partition()))
    model = models.build("causal_transformer", **MODEL_SHAPES[shape], max_seq_len=width,
                         **({"matmul_dtype": jnp.bfloat16} if kind == "dpo-bf16" else {}))
    if kind.startswith("dpo"):
        objective, batch = DPOObjective(model, seq_len=width - 1, beta=0.1), pairs
    else:
        objective = LMObjective(model, seq_len=width - 1, ema_decay=None)
        batch = {"text": pairs["input_ids"].reshape(2 * pairs_count, width)}
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
    parser.add_argument("--shape", choices=tuple(SIZES), default="bench")
    parser.add_argument("--rounds", type=int, help="default: 3 (bench), 2 (qwen3-0.6b)")
    parser.add_argument("--steps", type=int, help="timed steps per entry; default: 10 (bench), 3 (qwen3-0.6b)")
    parser.add_argument("--worker", choices=("dpo", "dpo-bf16", "sft"))
    args = parser.parse_args()
    pairs, steps, rounds = SIZES[args.shape]
    steps, rounds = args.steps or steps, args.rounds or rounds
    if args.worker:
        worker(args.shape, args.worker, steps)
        return
    me = [sys.executable, __file__, "--shape", args.shape, "--steps", str(steps), "--worker"]
    commands = {"dew DPO": me + ["dpo"], "dew SFT (same sequences)": me + ["sft"], "dew DPO bf16 compute": me + ["dpo-bf16"]}
    if PEER_PYTHON.exists():
        commands["TRL DPOTrainer float32"] = [str(PEER_PYTHON), "bench/peers/trl_dpo.py", str(steps + 2), "float32",
                                              args.shape, str(pairs)]
        # About 15 times slower a step on this CPU: fewer steps give as steady a median.
        commands["TRL DPOTrainer defaults"] = [str(PEER_PYTHON), "bench/peers/trl_dpo.py",
                                               str(max(3, steps // 2) + 2), "defaults", args.shape, str(pairs)]
    environments = {name: hugepage_environment() for name in commands}
    records = run_rounds(commands, rounds, environments=environments)
    trl_version = next((r[0]["trl"] for r in records.values() if "trl" in r[0]), None)
    table = medians(records, ("steps_per_second", "peak_rss_gib"))
    peer = table.get("TRL DPOTrainer float32")
    print(f"\nDPO step, {pairs} pairs x {PROMPT + ANSWER + 1} ids, beta 0.1, AdamW, {LABELS[args.shape]}, "
          f"2 CPU cores, medians of {rounds} rounds")
    print(f"{'implementation':<26} {'steps/s':>8} {'vs TRL f32':>11} {'peak RSS GiB':>13} {'RSS vs TRL f32':>15}")
    for name, m in table.items():
        ratio = f"{m['steps_per_second'] / peer['steps_per_second']:.2f}x" if peer else "-"
        memory = f"{m['peak_rss_gib'] / peer['peak_rss_gib']:.2f}x" if peer else "-"
        print(f"{name:<26} {m['steps_per_second']:>8.3f} {ratio:>11} {m['peak_rss_gib']:>13.2f} {memory:>15}")
    dpo, sft = table["dew DPO"], table["dew SFT (same sequences)"]
    print(f"dew DPO holds {dpo['peak_rss_gib'] - sft['peak_rss_gib']:+.2f} GiB against SFT on the same sequences "
          "(the reference copy and its forward pass)")
    if peer is None:
        print("(no peer: create .venv-ref as docs/benchmarks.md describes to measure TRL)")
    RESULTS.mkdir(parents=True, exist_ok=True)
    suffix = "" if args.shape == "bench" else f"_{args.shape}"
    (RESULTS / f"dpo_step{suffix}.json").write_text(json.dumps(
        {"shape": args.shape, "pairs": pairs, "steps": steps, "records": records, "medians": table, "trl": trl_version,
         "environments": environments}, indent=2))
    bar_plot(RESULTS / f"dpo_step{suffix}.png", f"DPO step, {pairs} pairs x 64 ids, {LABELS[args.shape]}, 2 CPU cores",
             [("steps_per_second", "steps per second (higher is better)"), ("peak_rss_gib", "peak resident memory, GiB")],
             records)
    print(f"wrote {RESULTS / f'dpo_step{suffix}.json'} and {RESULTS / f'dpo_step{suffix}.png'}")


if __name__ == "__main__":
    main()
