"""Asynchronous against synchronous RLVR over several seeds: examples/train_rlvr.py's core, both modes per seed.

For each seed, one SFT warm start, then ``run(RLVRConfig(...))`` of examples/train_rlvr.py
(GRPO through RolloutScheduler over a PromptSource on the NativeRolloutServer, code tasks
run in a SandboxFleet) in each mode, interleaved seed by seed so that both modes see the
same machine load (the first of them alternates seed by seed):

- async, ``max_lag=1, ahead=1``: the next batch's rollouts run while the trainer updates;
- sync, ``max_lag=0, ahead=0``: each batch is drawn when the trainer asks for it, under
  the weights it trains.

``--token-lag`` runs three other modes instead, into ``rlvr_token_lag.{json,png}``: asynchronous
two batches ahead (``max_lag=2, ahead=2``) as it is, with ``max_token_lag=1`` (GRPOObjective
drops the sampled ids drawn two or more updates before the weights that train on them), and
with those ids weighed 0.5 instead (``stale_token_weight=0.5``).

``--repeats R`` runs every mode R times per seed from the seed's one warm start. A run need
not repeat itself exactly: which draws share a prefill is decided by timing, the engine's
behaviour log-probabilities (which the update weighs by) depend on it in their last bits,
and over 80 updates a tiny policy can carry such a difference far. A seed's figures are the
mean of its repeats.

Reported per mode over the seeds: the held-out gain (reward after GRPO minus after SFT, on
the held-out split, same tasks and sampling seeds) as mean and standard error over seeds,
the spread of one seed's gain between repeats (standard deviation), the GRPO wall time,
the share of trained ids drawn 0, 1, and 2 or more updates behind the weights that train
on them (the ids ``max_token_lag`` would weigh; the bound keeps those at or under it), and
the trainer's wait share after its first update (the scheduler records' ``waited`` seconds
from the second call on, over the wall time from the second call's start to the end of
training). The plot has the training reward per update, mean over seeds with a band of one
standard error, one line per mode. Rollout generation, verification and the update share
this machine's cores, so overlap buys less than it would with the rollouts on other devices.

    uv run python bench/rlvr_async.py [--seeds 0 1 2 3 4] [--repeats R] [--steps N] [--token-lag]

Prints a table and writes bench/results/rlvr_async.{json,png} (the JSON after every run).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import textwrap
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from train_rlvr import RLVRConfig, run, warm_start  # noqa: E402  (examples/ is not a package)

from dew.losses.policy import LAG_BUCKETS  # noqa: E402

MODES = {"async (max_lag=1, ahead=1)": {"max_lag": 1, "ahead": 1},
         "sync (max_lag=0, ahead=0)": {"max_lag": 0, "ahead": 0}}
TOKEN_LAG_MODES = {"async 2 ahead (max_lag=2, ahead=2)": {"max_lag": 2, "ahead": 2},
                   "async 2 ahead, max_token_lag=1": {"max_lag": 2, "ahead": 2, "max_token_lag": 1},
                   "async 2 ahead, lag 2+ weighed 0.5": {"max_lag": 2, "ahead": 2, "max_token_lag": 1,
                                                         "stale_token_weight": 0.5}}
COLOURS = ("#228833", "#777777", "#ee6677")
OUT = ROOT / "bench" / "results"


def mean_and_error(values) -> tuple[float, float]:
    """The mean and its standard error (sample standard deviation over sqrt(n); NaN for one value)."""
    values = np.asarray(values, np.float64)
    error = values.std(ddof=1) / math.sqrt(len(values)) if len(values) > 1 else float("nan")
    return float(values.mean()), float(error)


def run_row(result) -> dict:
    """What the bench keeps of one run."""
    return {
        "reward_start": result.reward_before, "reward_end": result.reward_after,
        "gain": result.reward_after - result.reward_before,
        "family_start": result.family_before, "family_end": result.family_after,
        "wait_share": result.wait_share, "waited_seconds": result.waited,
        "grpo_seconds": result.seconds["grpo"], "total_seconds": result.seconds["total"],
        "max_lag_seen": max((r.lag for r in result.records if r.lag is not None), default=0),
        "resubmissions": sum(sum(r.resubmissions.values()) for r in result.records),
        "train_rewards": result.train_rewards[: result.config.steps],
        "lag_shares": {name: float(np.mean([shares[name] for shares in result.lag_shares]))
                       for name in LAG_BUCKETS},
    }


def per_seed(rows: list[dict], field: str) -> float:
    """A seed's value of ``field``: the mean over its repeats (asynchronous runs differ from repeat to repeat)."""
    return float(np.mean([row[field] for row in rows]))


def summarise(runs: dict[str, dict[int, list[dict]]]) -> dict[str, dict]:
    """Per mode: gain, start, end, wall time, wait share and lag shares over the seeds run so far.

    Each seed counts once, with the mean of its repeats; the standard error is over seeds.
    ``repeat_spread`` is the mean over seeds of the standard deviation of a seed's gains
    between repeats (None with one repeat): how far one run of the mode lands from another.
    """
    summary = {}
    for mode, by_seed in runs.items():
        seeds = list(by_seed.values())
        gain, gain_error = mean_and_error([per_seed(rows, "gain") for rows in seeds])
        spreads = [np.std([row["gain"] for row in rows], ddof=1) for rows in seeds if len(rows) > 1]
        summary[mode] = {
            "seeds": sorted(by_seed), "repeats": [len(rows) for rows in seeds], "gain": gain, "gain_error": gain_error,
            "repeat_spread": float(np.mean(spreads)) if spreads else None,
            **{field: mean_and_error([per_seed(rows, field) for rows in seeds])[0]
               for field in ("reward_start", "reward_end", "grpo_seconds", "wait_share")},
            "lag_shares": {name: float(np.mean([row["lag_shares"][name] for rows in seeds for row in rows]))
                           for name in LAG_BUCKETS},
        }
    return summary


def print_table(summary: dict[str, dict], runs: dict[str, dict[int, list[dict]]], steps: int) -> None:
    print(f"\n{steps} GRPO updates per run, {os.cpu_count()} CPU cores; held-out reward: "
          f"{RLVRConfig().eval_tasks} held-out tasks x {RLVRConfig().eval_samples} samples at temperature 1")
    print(f"{'mode':<34} {'seeds':>5} {'held-out gain':>15} {'repeat s.d.':>11} {'start':>6} {'end':>6} {'GRPO s':>7} "
          f"{'wait share':>10} {'ids at lag 0 / 1 / 2+':>22}")
    for mode, row in summary.items():
        lags = " / ".join(f"{100 * row['lag_shares'][name]:.1f}" for name in LAG_BUCKETS)
        spread = "-" if row["repeat_spread"] is None else f"{row['repeat_spread']:.3f}"
        print(f"{mode:<34} {len(row['seeds']):>5} {row['gain']:>+8.3f} ± {row['gain_error']:.3f} "
              f"{spread:>11} {row['reward_start']:>6.3f} {row['reward_end']:>6.3f} "
              f"{row['grpo_seconds']:>7.1f} {100 * row['wait_share']:>9.1f}% {lags:>21}%")
    for mode, by_seed in runs.items():
        gains = ", ".join(f"seed {seed} " + " ".join(f"{row['gain']:+.3f}" for row in rows)
                          for seed, rows in sorted(by_seed.items()))
        print(f"{mode:<34} {gains}")


def plot(runs: dict[str, dict[int, list[dict]]], summary: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (rewards, gains) = plt.subplots(1, 2, figsize=(11, 3.6), gridspec_kw={"width_ratios": [2, 1]})
    for (mode, by_seed), colour in zip(runs.items(), COLOURS):
        # a seed's curve is the mean of its repeats; the band is one standard error over seeds
        curves = np.array([np.mean([row["train_rewards"] for row in rows], axis=0) for rows in by_seed.values()],
                          np.float64)
        mean = np.nanmean(curves, axis=0)
        error = (np.nanstd(curves, axis=0, ddof=1) / math.sqrt(len(curves)) if len(curves) > 1
                 else np.zeros_like(mean))
        steps = np.arange(1, len(mean) + 1)
        rewards.plot(steps, mean, color=colour, label=f"{mode} ({len(curves)} seeds)")
        rewards.fill_between(steps, mean - error, mean + error, color=colour, alpha=0.25, linewidth=0)
        row = summary[mode]
        x = list(runs).index(mode)
        every = [r["gain"] for rows in by_seed.values() for r in rows]
        gains.scatter([x] * len(every), every, color=colour, s=14, alpha=0.6)
        gains.errorbar([x + 0.15], [row["gain"]], yerr=[0 if math.isnan(row["gain_error"]) else row["gain_error"]],
                       color=colour, marker="s", capsize=4)
    rewards.set_xlabel("update")
    rewards.set_ylabel("training batch reward (mean ± s.e.)")
    rewards.legend(fontsize=8)
    gains.set_xticks(range(len(runs)), [textwrap.fill(mode.split(" (")[0], 16) for mode in runs], fontsize=8)
    gains.axhline(0, color="#cccccc", linewidth=0.8)
    gains.set_ylabel("held-out gain (runs; seeds' mean ± s.e.)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=RLVRConfig.model_fields["steps"].default)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--repeats", type=int, default=1, help="runs of each mode per seed, from its one warm start")
    parser.add_argument("--token-lag", action="store_true", help="the max_token_lag modes instead (module docstring)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    modes, name = (TOKEN_LAG_MODES, "rlvr_token_lag") if args.token_lag else (MODES, "rlvr_async")
    runs: dict[str, dict[int, list[dict]]] = {mode: {} for mode in modes}
    configs = {}
    OUT.mkdir(parents=True, exist_ok=True)
    for seed in args.seeds:
        warm = warm_start(RLVRConfig(steps=args.steps, seed=seed, progress=False))  # every mode begins alike
        print(f"seed {seed}: SFT warm start {warm.seconds:.1f} s", flush=True)
        # Alternate which mode runs first: a run's first compilations and the machine's state drift favour neither.
        order = list(modes.items())
        for repeat in range(args.repeats):
            turn = args.seeds.index(seed) * args.repeats + repeat
            for mode, options in (order if turn % 2 == 0 else order[::-1]):
                config = RLVRConfig(steps=args.steps, seed=seed, progress=False, **options)
                result = run(config, warm=warm)
                runs[mode].setdefault(seed, []).append(run_row(result))
                configs[mode] = {k: v for k, v in config.model_dump().items() if k != "seed"}
                print(f"seed {seed} {mode}: held-out {result.reward_before:.3f} -> {result.reward_after:.3f}, "
                      f"GRPO {result.seconds['grpo']:.1f} s, wait share {100 * result.wait_share:.1f}%", flush=True)
                summary = summarise({m: r for m, r in runs.items() if r})
                (OUT / f"{name}.json").write_text(json.dumps(
                    {"steps": args.steps, "seeds": args.seeds, "repeats": args.repeats, "cpu_cores": os.cpu_count(),
                     "config": configs, "summary": summary, "runs": runs}, indent=2))
    print_table(summary, runs, args.steps)
    plot(runs, summary, OUT / f"{name}.png")
    print(f"wrote {OUT / f'{name}.json'} and {OUT / f'{name}.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
