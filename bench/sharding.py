"""Sharded training: per-device memory of one GRPO step for Qwen3 shapes, and the cost of FSDP's collectives here.

Part 1, memory (nothing that large is allocated): for Qwen3-shaped decoders of 0.6B, 1.7B, 4B and 8B
parameters (the Hugging Face configs' shapes: vocabulary 151,936, QK-norm, grouped KV heads; float32
master weights, AdamW), the Trainer's GRPO update is lowered ahead of time over abstract arrays on 8
CPU devices (``Trainer.step_memory``: ``jax.eval_shape`` for the state, XLA's compiled memory analysis)
under replicated, FSDP 8 and FSDP 4 x tensor 2, with and without rematerialised layers ("full"). The batch
is one micro-batch of 8 rows of 1,024 ids (gradient accumulation takes more). Peak per device is
arguments + outputs + temporaries - aliased (the donated state is updated in place). Whether it fits
80 GB and 141 GB devices is that peak against the device, with nothing else on it.

Part 2, step time: the bench's 12.6M-parameter Qwen3-shaped decoder (vocab 8192, hidden 384, 6 layers)
trains GRPO-shaped SFT steps (8 rows of 128 ids) on 8 CPU devices replicated and under FSDP 8, rounds
interleaved in one process; the ratio is the cost of the all-gathers and reduce-scatters on this machine's
2 cores (on GPUs the collectives overlap with compute; on CPU they are memory copies).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 uv run python bench/sharding.py [--sizes 0.6B,1.7B,4B,8B]

Writes bench/results/sharding.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dew import Trainer, models
from dew.objectives import LMObjective
from dew.objectives.grpo import GRPOObjective
from dew.parallelism import Parallelism

RESULTS = Path(__file__).resolve().parent / "results"
GB = 1e9
QWEN3 = {  # the Hugging Face configs' shapes (Qwen/Qwen3-*: config.json)
    "0.6B": dict(emb_features=1024, num_layers=28, num_heads=16, num_kv_heads=8, mlp_features=3072, tie_embeddings=True),
    "1.7B": dict(emb_features=2048, num_layers=28, num_heads=16, num_kv_heads=8, mlp_features=6144, tie_embeddings=True),
    "4B": dict(emb_features=2560, num_layers=36, num_heads=32, num_kv_heads=8, mlp_features=9728, tie_embeddings=True),
    "8B": dict(emb_features=4096, num_layers=36, num_heads=32, num_kv_heads=8, mlp_features=12288, tie_embeddings=False),
}
MESHES = {"replicated": Parallelism(), "fsdp 8": Parallelism(fsdp=8), "fsdp 4 x tensor 2": Parallelism(fsdp=4, tensor=2)}
ROWS, WIDTH = 8, 1024
GRPO_FIELDS = {**{name: jnp.int32 for name in ("input_ids", "text_segment_ids", "text_positions", "response_mask",
                                               "versions", "session_index", "call_index")},
               **{name: jnp.float32 for name in ("behavior_log_probs", "advantages", "session_weights",
                                                 "old_log_probs")}}


def qwen3(size: str, remat: str = "none"):
    return models.build("causal_transformer", vocab_size=151_936, max_seq_len=WIDTH, head_dim=128, qk_norm=True,
                        rope_theta=1_000_000.0, norm_eps=1e-6, remat=remat, **QWEN3[size])


def memory_rows(sizes: list[str]) -> list[dict]:
    batch = {name: jax.ShapeDtypeStruct((ROWS, WIDTH), dtype) for name, dtype in GRPO_FIELDS.items()}
    rows = []
    for size in sizes:
        for remat in ("none", "full"):
            model = qwen3(size, remat)
            objective = GRPOObjective(model, seq_len=WIDTH - 1)
            for mesh_name, parallelism in MESHES.items():
                started = time.perf_counter()
                trainer = Trainer(objective, optax.adamw(1e-6), key=jax.random.key(0), parallelism=parallelism,
                                  progress=False)
                params = sum(leaf.size for leaf in jax.tree.leaves(jax.eval_shape(trainer.initial_state).params))
                memory = trainer.step_memory(batch)
                row = {"size": size, "parameters": int(params), "remat": remat, "mesh": mesh_name,
                       **{f"{name}_gb": value / GB for name, value in memory.items()},
                       "fits_80gb": memory["peak"] <= 80 * GB, "fits_141gb": memory["peak"] <= 141 * GB,
                       "compile_s": time.perf_counter() - started}
                rows.append(row)
                print(f"{size:>5} {params / 1e9:5.2f}B remat {remat:<4} {mesh_name:<18} state+batch "
                      f"{row['arguments_gb']:7.2f} GB  temporaries {row['temporaries_gb']:7.2f} GB  peak "
                      f"{row['peak_gb']:7.2f} GB  80 GB {'fits' if row['fits_80gb'] else 'no':<4} "
                      f"141 GB {'fits' if row['fits_141gb'] else 'no'}  ({row['compile_s']:.0f} s)", flush=True)
    return rows


def step_times(rounds: int, steps: int) -> dict[str, list[float]]:
    model = models.build("causal_transformer", vocab_size=8192, emb_features=384, num_layers=6, num_heads=6,
                         num_kv_heads=2, head_dim=64, mlp_features=1024, max_seq_len=128, qk_norm=True)
    batch = {"text": np.random.default_rng(0).integers(0, 8192, (8, 129)).astype(np.int32)}
    runs = {}
    for name in ("replicated", "fsdp 8"):
        trainer = Trainer(LMObjective(model, seq_len=128, ema_decay=None), optax.adamw(1e-4), key=jax.random.key(0),
                          parallelism=MESHES[name], progress=False)
        state, _ = trainer.step(trainer.initial_state(), batch)  # compiled outside the timing
        runs[name] = [trainer, state]
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            started = time.perf_counter()
            for _ in range(steps):
                run[1], metrics = run[0].step(run[1], batch)
            seconds[name].append((time.perf_counter() - started) / steps)
    for name, values in seconds.items():
        print(f"12.6M decoder {name:<10} {np.median(values) * 1e3:7.1f} ms/step (median of {rounds} rounds)")
    print(f"fsdp 8 / replicated step time: {np.median(seconds['fsdp 8']) / np.median(seconds['replicated']):.2f}")
    return seconds


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(dict.fromkeys(row["size"] for row in rows))
    figure, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for axis, remat in zip(axes, ("none", "full")):
        width = 0.8 / len(MESHES)
        for index, mesh in enumerate(MESHES):
            peaks = [next(r["peak_gb"] for r in rows if r["size"] == s and r["remat"] == remat and r["mesh"] == mesh)
                     for s in sizes]
            axis.bar(np.arange(len(sizes)) + index * width, peaks, width, label=mesh)
        for limit in (80, 141):
            axis.axhline(limit, color="grey", linestyle="--", linewidth=0.8)
            axis.text(len(sizes) - 0.5, limit, f"{limit} GB", va="bottom", fontsize=8)
        axis.set_xticks(np.arange(len(sizes)) + width, sizes)
        axis.set_yscale("log")
        axis.set_title(f"GRPO step, 8 x 1024 ids, remat={remat}")
        axis.set_xlabel("Qwen3 shape")
    axes[0].set_ylabel("peak bytes per device (GB, XLA's analysis)")
    axes[0].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(QWEN3))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    if jax.device_count() != 8:
        raise SystemExit("run with XLA_FLAGS=--xla_force_host_platform_device_count=8 (8 CPU devices)")
    rows = memory_rows(args.sizes.split(","))
    seconds = step_times(args.rounds, args.steps)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "sharding.json").write_text(json.dumps({"memory": rows, "step_seconds": seconds}, indent=2))
    plot(rows, RESULTS / "sharding.png")


if __name__ == "__main__":
    main()
