"""What a finished RLVR pipeline run shows a person: the summary lines, the plot ``rlvr.png`` and the note a run
that never scored gets."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # the pipeline writes files; it never opens a window
import matplotlib.pyplot as plt  # noqa: E402


SMOOTHING = 10  # updates in the training reward's moving average
SOURCE_COLORS = ["#66ccee", "#aa3377", "#ccbb44", "#ee6677"]  # the held-out curve of each data source


def zero_reward_note(builtin: bool, sft_steps: int) -> str:
    """summary.json's ``note`` for a run whose held-out draws all scored 0, before and after: why, and what to look
    at (``builtin``: the built-in decoder, warm-started for ``sft_steps``)."""
    why = (f"for the built-in decoder the warm start (sft_steps={sft_steps}) sets the starting reward: the default "
           "400 steps start near 0.4, a few dozen leave it at 0" if builtin else
           "a random or untrained model, a response budget (max_new_tokens) too short for the answer, or a reward "
           "that does not read the model's format are the usual causes")
    return (f"every held-out draw scored 0 before and after: the policy never produced a rewarded answer ({why}), "
            "and GRPO cannot learn from groups whose rewards are all equal (rollout/reward/equal_group_share in "
            "metrics.jsonl)")


def moving_average(values: list[float], window: int) -> list[float]:
    """The mean of each value and the ``window - 1`` before it (fewer at the start); NaNs (no reward) are skipped."""
    out = []
    for i in range(len(values)):
        recent = [v for v in values[max(0, i - window + 1) : i + 1] if v == v]
        out.append(sum(recent) / len(recent) if recent else float("nan"))
    return out


def plot(rows: list[dict], summary: dict, path: Path, title: str) -> None:
    """The training reward per update (raw and smoothed) with the held-out reward curve (and one per data source
    when there are several), and throughput."""
    steps = [row["step"] for row in rows]
    figure, (reward, speed) = plt.subplots(1, 2, figsize=(10, 3.4))
    train = [row.get("rollout/reward/mean", float("nan")) for row in rows]
    reward.plot(steps, train, marker=".", linestyle="none", color="#bbbbbb", label="training batch")
    reward.plot(steps, moving_average(train, SMOOTHING), color="#228833",
                label=f"training, mean of {SMOOTHING} updates")
    curve = summary["held_out"]
    held = [point["step"] for point in curve]
    reward.plot(held, [point["reward"]["all"] for point in curve], marker="o", color="#4477aa", label="held-out tasks")
    sources = source_names(curve[0]["reward"])
    for name, color in zip(sources if len(sources) > 1 else [], SOURCE_COLORS * len(sources)):  # each data source
        reward.plot(held, [point["reward"].get(name, float("nan")) for point in curve], marker="o", markersize=3,
                    linestyle="--", linewidth=1, color=color, label=f"held-out {name}")
    reward.set_xlabel("update")
    reward.set_ylabel("mean reward")
    reward.set_ylim(0, 1)
    reward.legend(fontsize=8)
    speed.plot(steps, [row.get("train/tokens", 0) / row["wall"] for row in rows], marker=".", color="#228833")
    speed.set_xlabel("update")
    speed.set_ylabel("sampled tokens trained per second")
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def source_names(reward: dict) -> list[str]:
    """The data sources of a held-out summary: its keys other than "all", "stderr" and the pass@k ones."""
    return [name for name in reward if name not in ("all", "stderr") and not name.startswith("pass@")]


def print_summary(summary: dict) -> None:
    before, after = summary["reward_before"], summary["reward_after"]
    families = ", ".join(f"{name} {before[name]:.3f} -> {after[name]:.3f}" for name in source_names(before))
    share = summary["wait_share"]
    print(f"held-out reward {before['all']:.3f} -> {after['all']:.3f} ({families}) after {summary['steps']} updates")
    if "stderr" in before and "stderr" in after:
        print(f"held-out standard error {before['stderr']:.3f} before, {after['stderr']:.3f} after (over its prompts)")
    passes = [name for name in before if name.startswith("pass@") and "/" not in name]
    if passes:
        print(f"held-out {passes[0]} {before[passes[0]]:.3f} -> {after[passes[0]]:.3f}")
    if summary.get("note"):
        print(f"note: {summary['note']}")
    curve = ", ".join(f"{point['step']}: {point['reward']['all']:.3f}" for point in summary["held_out"])
    print(f"held-out reward by update {curve}")
    print(f"rollout tokens trained per second {summary['rollout_tokens_per_second']:.0f}; trainer waited "
          f"{'n/a' if share is None else f'{share:.1%}'} of the wall time after its first update")
    print(f"run directory {summary['run_dir']} (policy/ as Hugging Face safetensors, rlvr.png, metrics.jsonl); "
          f"{summary['seconds']:.0f} s in all")
