"""What a finished RLVR pipeline run shows a person: the summary lines and the plot ``rlvr.png``."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # the pipeline writes files; it never opens a window
import matplotlib.pyplot as plt  # noqa: E402


def plot(rows: list[dict], summary: dict, path: Path, title: str) -> None:
    """Mean reward of the admitted rollouts per update, with the held-out reward before and after, and throughput."""
    steps = [row["step"] for row in rows]
    figure, (reward, speed) = plt.subplots(1, 2, figsize=(10, 3.2))
    reward.plot(steps, [row.get("rollout/reward/mean", float("nan")) for row in rows], marker=".")
    reward.axhline(summary["reward_before"]["all"], color="#999999", linestyle="--", label="held-out before")
    reward.axhline(summary["reward_after"]["all"], color="#4477aa", linestyle="--", label="held-out after")
    reward.set_xlabel("update")
    reward.set_ylabel("mean reward of admitted rollouts")
    reward.legend()
    speed.plot(steps, [row.get("train/tokens", 0) / row["wall"] for row in rows], marker=".", color="#228833")
    speed.set_xlabel("update")
    speed.set_ylabel("sampled tokens trained per second")
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def print_summary(summary: dict) -> None:
    before, after = summary["reward_before"], summary["reward_after"]
    families = ", ".join(f"{name} {before[name]:.3f} -> {after[name]:.3f}" for name in before if name != "all")
    share = summary["wait_share"]
    print(f"held-out reward {before['all']:.3f} -> {after['all']:.3f} ({families}) after {summary['steps']} updates")
    print(f"rollout tokens trained per second {summary['rollout_tokens_per_second']:.0f}; trainer waited "
          f"{'n/a' if share is None else f'{share:.1%}'} of the wall time after its first update")
    print(f"run directory {summary['run_dir']} (policy/ as Hugging Face safetensors, rlvr.png, metrics.jsonl); "
          f"{summary['seconds']:.0f} s in all")
