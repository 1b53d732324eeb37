"""One GRPO update of SmolLM2-135M-Instruct over shared-prompt rows, as wide as each way of fitting them makes them.

The RLVR pipeline packs a group's samples into a row of its own: the prompt once, then the samples in slots
(:class:`dew.models.packed_attention.SharedPromptRows`). Every row of a batch is as wide as the batch's layout, so
what an update computes depends on how the layout is fitted to the batch:

- ``layout``: the run's own, a slot of ``max_new_tokens + 1`` ids for every sample;
- ``shorter slots``: the same slots, each cut to the batch's longest response (a multiple of 16 ids): what the
  pipeline did before slots were shared;
- ``fitted``: ``fitted_layout``, the narrowest of the layout's rows the batch fits: shorter slots, or half as many
  longer slots in which short responses share one (what the pipeline does now).

The batch: 8 prompts of 70 random ids and 8 responses each: one that runs to ``max_new_tokens`` (cut there), the
others of lengths drawn as this model's answers to the built-in word problems run (29 ids on average, normal with
deviation 10, at least 5 and at most 48), for ``max_new_tokens`` 48 (the recipe's) and 96. One process, bfloat16
products over float32 weights, the recipe's objective (``proximal="current"``, ``behavior_importance=2.0``,
temperature 0.7); each layout's update compiled first, then timed ``--rounds`` times, the layouts taking turns.

    uv run python bench/shared_slots.py [--rounds 2]

Prints the table and writes bench/results/shared_slots.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np
from interleaved import RESULTS, ROOT

from dew.models.packed_attention import SharedPromptRows
from dew.objectives.grpo import GRPOObjective
from dew.recipes.run_inputs import load_policy
from dew.records.session_packing import fitted_layout, pack
from dew.records.session_records import Call, Session, Status, Task

sys.path.insert(0, str(ROOT / "tools"))
import smollm2  # noqa: E402 (tools/ is not a package)

PROMPT, TASKS, SAMPLES, MEAN, SPREAD, LONGEST = 70, 8, 8, 29, 10, 48


def sessions(max_new_tokens: int, seed: int = 0) -> list[Session]:
    rng = np.random.default_rng(seed)
    out = []
    for task in range(TASKS):
        prompt = rng.integers(10, 40_000, PROMPT).tolist()
        for sample in range(SAMPLES):
            length = max_new_tokens if sample == 0 else int(np.clip(rng.normal(MEAN, SPREAD), 5, LONGEST))
            sampled = rng.integers(10, 40_000, length).tolist()
            out.append(Session(Task(f"t{task}"), task, sample, 0, [Call(prompt, sampled, [-1.0] * length, "stop", 0)],
                               Status.COMPLETED, reward=float(rng.integers(0, 2))))
    return out


def layouts(batch: list[Session], max_new_tokens: int) -> dict[str, SharedPromptRows]:
    full = SharedPromptRows(PROMPT - 1, SAMPLES, max_new_tokens + 1)
    longest = 1 + max(len(s.calls[0].sampled_ids) for s in batch)  # the prompt's last id and the response
    shorter = SharedPromptRows(PROMPT - 1, SAMPLES, min(length for length in full.lengths() if length >= longest))
    return {"layout": full, "shorter slots": shorter, "fitted": fitted_layout(batch, full)}


def measure(rounds: int) -> list[dict]:
    policy = load_policy(smollm2.build(quiet=True), dtype="bfloat16")
    rows = []
    for max_new_tokens in (48, 96):
        batch = sessions(max_new_tokens)
        chosen = layouts(batch, max_new_tokens)
        full = chosen["layout"]
        objective = GRPOObjective(policy.model.clone(max_seq_len=max(policy.model.max_seq_len, full.width)),
                                  seq_len=full.width - 1, layout=full, proximal="current", behavior_importance=2.0,
                                  sampling_temperature=0.7)
        update = jax.jit(jax.value_and_grad(lambda params, b: objective.loss(params, None, b, None)[0]))
        packed = {name: {k: jax.numpy.asarray(v) for k, v in pack(batch, layout.width, rows=TASKS,
                                                                  layout=layout).items()}
                  for name, layout in chosen.items()}
        for name in chosen:
            jax.block_until_ready(update(policy.params, packed[name]))  # compiles
        seconds = {name: [] for name in chosen}
        for _ in range(rounds):
            for name in chosen:
                start = time.perf_counter()
                jax.block_until_ready(update(policy.params, packed[name]))
                seconds[name].append(time.perf_counter() - start)
        for name, layout in chosen.items():
            rows.append({"max_new_tokens": max_new_tokens, "rows": name, "slots": layout.continuations,
                         "slot_length": layout.length, "width": layout.width, "seconds": seconds[name],
                         "median": statistics.median(seconds[name])})
            print(f"max_new_tokens {max_new_tokens:>3}  {name:<13} {layout.continuations} x {layout.length:>3} "
                  f"width {layout.width:>4}  {statistics.median(seconds[name]):6.2f} s", flush=True)
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["rows"] for r in rows))
    budgets = list(dict.fromkeys(r["max_new_tokens"] for r in rows))
    figure, axis = plt.subplots(figsize=(6.4, 3.6))
    for offset, name in enumerate(names):
        values = [next(r["median"] for r in rows if r["rows"] == name and r["max_new_tokens"] == b) for b in budgets]
        axis.bar(np.arange(len(budgets)) + (offset - 1) * 0.27, values, 0.27, label=name)
    axis.set_xticks(range(len(budgets)), [f"max_new_tokens {b}" for b in budgets])
    axis.set_ylabel("seconds an update (median)")
    axis.set_title("SmolLM2-135M GRPO update, 8 x 8 samples")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    rows = measure(args.rounds)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "shared_slots.json").write_text(json.dumps(rows, indent=1))
    plot(rows, RESULTS / "shared_slots.png")
    print(f"wrote {RESULTS / 'shared_slots.json'} and shared_slots.png")


if __name__ == "__main__":
    main()
