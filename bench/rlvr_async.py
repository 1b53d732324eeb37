"""Asynchronous against synchronous RLVR: examples/train_rlvr.py's core twice with the same seed.

Runs ``run(RLVRConfig(...))`` of examples/train_rlvr.py (SFT warm start, GRPO through
RolloutScheduler over a PromptSource on the NativeRolloutServer, code tasks run in a
SandboxFleet) once asynchronously, ``max_lag=1, ahead=1``: the next batch's rollouts
run while the trainer updates, and once synchronously, ``max_lag=0, ahead=0``: each
batch is submitted when the trainer asks for it, under the weights it trains. Both start
from one SFT warm start on the same tasks.

Reported per mode: the held-out mean reward after SFT and after GRPO (the same tasks and
sampling seeds), and the share of the trainer's wall time after its first update spent
waiting for rollouts: the scheduler records' ``waited`` seconds from the second call on,
over the time from the second call's start to the end of training. Rollout generation,
verification and the update all share this machine's cores, so overlap buys less than it
would with the rollouts on other devices.

    uv run python bench/rlvr_async.py [--steps 120] [--seed 0]

Prints a table and writes bench/results/rlvr_async.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from train_rlvr import RLVRConfig, run, warm_start  # noqa: E402  (examples/ is not a package)

MODES = {"async (max_lag=1, ahead=1)": (1, 1), "sync (max_lag=0, ahead=0)": (0, 0)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=RLVRConfig.model_fields["steps"].default)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    results = {}
    warm = warm_start(RLVRConfig(steps=args.steps, seed=args.seed))  # one warm start: both modes begin alike
    print(f"SFT warm start: {warm.seconds:.1f} s", flush=True)
    for mode, (max_lag, ahead) in MODES.items():
        print(f"{mode}: {args.steps} GRPO updates, seed {args.seed}", flush=True)
        results[mode] = run(RLVRConfig(steps=args.steps, seed=args.seed, max_lag=max_lag, ahead=ahead), warm=warm)
    cores = os.cpu_count()
    print(f"\n{args.steps} GRPO updates, seed {args.seed}, {cores} CPU cores "
          f"(evaluation reward: {RLVRConfig().eval_tasks} tasks x {RLVRConfig().eval_samples} samples at temperature 1)")
    header = (f"{'mode':<28} {'reward start':>12} {'reward end':>10} {'wait share':>10} {'waited s':>9} "
              f"{'after 1st s':>11} {'GRPO s':>7} {'run s':>7}")
    print(header)
    summary = {}
    for mode, result in results.items():
        summary[mode] = {
            "reward_start": result.reward_before, "reward_end": result.reward_after,
            "family_start": result.family_before, "family_end": result.family_after,
            "wait_share": result.wait_share, "waited_seconds": result.waited,
            "after_first_update_seconds": result.rl_after_first_seconds,
            "grpo_seconds": result.seconds["grpo"], "total_seconds": result.seconds["total"],
            "waits_per_step": [r.waited for r in result.records],
            "max_lag_seen": max((r.lag for r in result.records if r.lag is not None), default=0),
            "resubmissions": sum(sum(r.resubmissions.values()) for r in result.records),
            "train_rewards": result.train_rewards,
        }
        row = summary[mode]
        print(f"{mode:<28} {row['reward_start']:>12.3f} {row['reward_end']:>10.3f} {100 * row['wait_share']:>9.1f}% "
              f"{row['waited_seconds']:>9.1f} {row['after_first_update_seconds']:>11.1f} {row['grpo_seconds']:>7.1f} "
              f"{row['total_seconds']:>7.1f}")
    for mode, row in summary.items():
        families = ", ".join(f"{family} {row['family_start'][family]:.3f} -> {row['family_end'][family]:.3f}"
                             for family in row["family_start"] if family != "all")
        print(f"{mode:<28} {families}")
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "rlvr_async.json").write_text(json.dumps(
        {"steps": args.steps, "seed": args.seed, "cpu_cores": cores,
         "config": {mode: result.summary()["config"] for mode, result in results.items()}, "summary": summary},
        indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (waits, rewards) = plt.subplots(1, 2, figsize=(10, 3.2))
    colours = {mode: colour for mode, colour in zip(MODES, ("#228833", "#bbbbbb"))}
    for mode, row in summary.items():
        waits.plot(range(1, len(row["waits_per_step"]) + 1), row["waits_per_step"], color=colours[mode],
                   label=f"{mode}: {100 * row['wait_share']:.1f}% waiting")
        rewards.plot(range(1, len(row["train_rewards"]) + 1), row["train_rewards"], color=colours[mode], label=mode)
    waits.set_xlabel("scheduler call")
    waits.set_ylabel("seconds waited for rollouts")
    waits.legend(fontsize=8)
    rewards.set_xlabel("update")
    rewards.set_ylabel("mean reward of the batch")
    rewards.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(out / "rlvr_async.png", dpi=120)
    print(f"wrote {out / 'rlvr_async.json'} and {out / 'rlvr_async.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
