"""DPO step throughput and peak memory: dew against TRL's DPOTrainer, and DPO against SFT.

Model: the 12.6M-parameter Qwen3-shaped decoder of shared/PERF.md (vocab 8192, hidden 384,
6 layers, 6 heads, 2 KV heads, head_dim 64, MLP 1024, tied embeddings), fp32, AdamW.
Batch: 8 preference pairs of 64 ids a side (31 prompt ids, 32 completion ids and EOS),
beta 0.1. Each measurement runs in a fresh process, so its peak resident memory
(ru_maxrss) is its own:

- dew DPO: DPOObjective over PreferencePairs rows (policy, frozen reference in the EMA slot);
- dew SFT: LMObjective over the same 16 sequences as one batch (no reference);
- TRL DPOTrainer (bench/peers/trl_dpo.py in .venv-ref), same shapes, 2 threads.

Rounds are interleaved (dew DPO, dew SFT, TRL). The table gives medians and ratios.

    uv run python bench/dpo_step.py [--rounds 3] [--steps 10]

Writes bench/results/dpo_step.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEER_PYTHON = ROOT / ".venv-ref" / "bin" / "python"
VOCAB, PAIRS, PROMPT, ANSWER = 8192, 8, 31, 32


def worker(kind: str, steps: int) -> None:
    """One measurement in this process; prints its JSON record."""
    import jax
    import numpy as np
    import optax

    from dew import Trainer, models
    from dew.data import Loading, Partition, PreferencePairs
    from dew.objectives import LMObjective
    from dew.objectives.rl import DPOObjective

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
                         num_kv_heads=2, head_dim=64, mlp_features=1024, max_seq_len=width, qk_norm=True)
    if kind == "dpo":
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


def measure(command: list[str]) -> dict:
    out = subprocess.run(command, capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--worker", choices=("dpo", "sft"))
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps)
        return
    commands = {
        "dew DPO": [sys.executable, __file__, "--worker", "dpo", "--steps", str(args.steps)],
        "dew SFT (same sequences)": [sys.executable, __file__, "--worker", "sft", "--steps", str(args.steps)],
    }
    if PEER_PYTHON.exists():
        commands["TRL DPOTrainer"] = [str(PEER_PYTHON), str(ROOT / "bench" / "peers" / "trl_dpo.py"), str(args.steps + 2)]
    records: dict[str, list[dict]] = {name: [] for name in commands}
    trl_version = None
    for index in range(args.rounds):
        for name, command in commands.items():
            record = measure(command)
            trl_version = record.get("trl", trl_version)
            records[name].append(record)
        print(f"round {index + 1}/{args.rounds}: " + ", ".join(
            f"{name} {r[-1]['steps_per_second']:.2f}/s {r[-1]['peak_rss_gib']:.2f} GiB" for name, r in records.items()))
    medians = {name: {key: statistics.median(r[key] for r in rs) for key in ("steps_per_second", "peak_rss_gib")}
               for name, rs in records.items()}
    peer = medians.get("TRL DPOTrainer")
    print(f"\nDPO step, {PAIRS} pairs x {PROMPT + ANSWER + 1} ids, beta 0.1, AdamW, 12.6M-parameter decoder, 2 CPU cores")
    print(f"{'implementation':<26} {'steps/s':>8} {'vs TRL':>7} {'peak RSS GiB':>13}")
    for name, m in medians.items():
        ratio = f"{m['steps_per_second'] / peer['steps_per_second']:.2f}x" if peer else "-"
        print(f"{name:<26} {m['steps_per_second']:>8.3f} {ratio:>7} {m['peak_rss_gib']:>13.2f}")
    dpo, sft = medians["dew DPO"], medians["dew SFT (same sequences)"]
    print(f"dew DPO holds {dpo['peak_rss_gib'] - sft['peak_rss_gib']:+.2f} GiB against SFT on the same sequences "
          "(the reference copy and its forward pass)")
    if peer is None:
        print("(no peer: create .venv-ref as the README describes to measure TRL)")
    results = ROOT / "bench" / "results"
    results.mkdir(parents=True, exist_ok=True)
    (results / "dpo_step.json").write_text(json.dumps({"records": records, "medians": medians, "trl": trl_version}, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (speed, memory) = plt.subplots(1, 2, figsize=(9, 2.8))
    names = list(medians)
    colors = ["#4477aa", "#66ccee", "#bbbbbb"][: len(names)]
    speed.barh(names, [medians[n]["steps_per_second"] for n in names], color=colors)
    speed.set_xlabel("steps per second (higher is better)")
    memory.barh(names, [medians[n]["peak_rss_gib"] for n in names], color=colors)
    memory.set_xlabel("peak resident memory, GiB")
    memory.set_yticks([])
    figure.suptitle("DPO step, 8 pairs x 64 ids, 12.6M params, 2 CPU cores")
    figure.tight_layout()
    figure.savefig(results / "dpo_step.png", dpi=120)
    print(f"wrote {results / 'dpo_step.json'} and {results / 'dpo_step.png'}")


if __name__ == "__main__":
    main()
