"""``session_metrics``: what a batch of sessions says about the rollouts behind it; ``reward_metrics``: the
rewards and response lengths every GRPO and PPO path logs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from dew.records.session_packing import chains_of
from dew.records.session_records import Session, Status, check_truncation, training_reward


def reward_metrics(sessions: Sequence[Session], rewards: Sequence[float] | None = None) -> dict[str, float]:
    """What a batch's rewards and responses say: how a GRPO run is judged.

    ``reward/mean`` and ``reward/std`` over ``rewards`` (default: each session's reward);
    ``reward/equal_group_share``, the share of groups (sessions of one task and group) whose
    rewards are all equal, which give no advantage; ``response/length_mean``,
    ``response/length_max`` (sampled ids per session) and ``response/truncated_share`` (the
    share whose last call hit its length budget); ``reward/source/<data_source>``, the mean
    per data source of the task.
    """
    values = np.asarray([s.reward for s in sessions] if rewards is None else rewards, np.float64)
    if len(values) != len(sessions):
        raise ValueError(f"need one reward per session, got {len(values)} for {len(sessions)}")
    out: dict[str, float] = {}
    if not len(values):
        return {"reward/mean": float("nan")}
    out["reward/mean"], out["reward/std"] = float(values.mean()), float(values.std())
    groups: dict[tuple, list[float]] = {}
    sources: dict[str, list[float]] = {}
    for session, value in zip(sessions, values):
        groups.setdefault(session.key, []).append(float(value))
        source = session.task.data.get("data_source")
        if source is not None:
            sources.setdefault(str(source), []).append(float(value))
    out["reward/equal_group_share"] = float(np.mean([max(g) == min(g) for g in groups.values()]))
    lengths = np.asarray([sum(len(c.sampled_ids) for c in s.calls) for s in sessions], np.float64)
    out["response/length_mean"], out["response/length_max"] = float(lengths.mean()), float(lengths.max())
    out["response/truncated_share"] = float(np.mean([bool(s.calls) and s.calls[-1].finish_reason == "length"
                                                     for s in sessions]))
    for source, scores in sorted(sources.items()):
        out[f"reward/source/{source}"] = float(np.mean(scores))
    return out


def session_metrics(
    sessions: Sequence[Session],
    batch: Mapping[str, np.ndarray],
    latencies: Sequence[float] | None = None,
    version: int | None = None,
    truncation: str = "mask",
) -> dict[str, float]:
    """What a batch of sessions says about the rollouts behind it.

    ``sessions/calls_per_chain``; ``masked_share/<status>``: the share of all sampled ids
    that belong to sessions of that status and do not train; :func:`reward_metrics` over
    trained sessions and ``reward/<component>`` means; with ``latencies`` (seconds)
    ``latency/p50``, ``latency/p90``, ``latency/p99``, ``latency/max``; with the current
    ``version``, ``version_lag/mean`` and ``version_lag/max`` over the batch's sampled ids;
    for multi-turn sessions (those with ``episode_metrics``), ``episode/<name>`` means over
    them (``episode/turns``, ``episode/truncated`` and the environment's own, such as
    ``episode/tool_errors``) and ``episode/turns_max``.
    """
    check_truncation(truncation)
    metrics: dict[str, float] = {}
    calls = chains = 0
    sampled_total = 0
    masked: dict[str, int] = {status.name.lower(): 0 for status in Status}
    rewards, components, trained = [], {}, []
    for number, session in enumerate(sessions):
        sampled = sum(len(c.sampled_ids) for c in session.calls)
        sampled_total += sampled
        reward = training_reward(session, truncation)
        if reward is None:
            masked[session.status.name.lower()] += sampled
            continue
        rewards.append(reward)
        trained.append(session)
        for name, value in session.components.items():
            components.setdefault(name, []).append(float(value))
        session_chains = chains_of(session, number)
        chains += len(session_chains)
        calls += len({i for chain in session_chains for i in chain.calls if i >= 0})
    metrics["sessions/calls_per_chain"] = calls / chains if chains else 0.0
    for status, count in masked.items():
        metrics[f"masked_share/{status}"] = count / sampled_total if sampled_total else 0.0
    metrics.update(reward_metrics(trained, rewards))
    for name, values in components.items():
        metrics[f"reward/{name}"] = float(np.mean(values))
    episodes = [session.episode_metrics for session in sessions if session.episode_metrics]
    for name in sorted({name for episode in episodes for name in episode}):
        metrics[f"episode/{name}"] = float(np.mean([episode.get(name, 0.0) for episode in episodes]))
    if episodes:
        metrics["episode/turns_max"] = float(max(episode.get("turns", 0.0) for episode in episodes))
    if latencies:
        values = np.asarray(latencies, np.float64)
        for q in (50, 90, 99):
            metrics[f"latency/p{q}"] = float(np.percentile(values, q))
        metrics["latency/max"] = float(values.max())
    if version is not None:
        mask = np.asarray(batch["response_mask"]) == 1
        if mask.any():
            lag = version - np.asarray(batch["versions"])[mask]
            metrics["version_lag/mean"] = float(lag.mean())
            metrics["version_lag/max"] = float(lag.max())
    return metrics
