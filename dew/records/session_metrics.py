"""``session_metrics``: what a batch of sessions says about the rollouts behind it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from dew.records.session_packing import chains_of
from dew.records.session_records import Session, Status, check_truncation, training_reward


def session_metrics(
    sessions: Sequence[Session],
    batch: Mapping[str, np.ndarray],
    latencies: Sequence[float] | None = None,
    version: int | None = None,
    truncation: str = "mask",
) -> dict[str, float]:
    """What a batch of sessions says about the rollouts behind it.

    ``sessions/calls_per_chain``; ``masked_share/<status>``: the share of all sampled ids
    that belong to sessions of that status and do not train; ``reward/mean`` over
    trained sessions and ``reward/<component>`` means; with ``latencies`` (seconds)
    ``latency/p50``, ``latency/p90``, ``latency/p99``, ``latency/max``; with the current
    ``version``, ``version_lag/mean`` and ``version_lag/max`` over the batch's sampled ids.
    """
    check_truncation(truncation)
    metrics: dict[str, float] = {}
    calls = chains = 0
    sampled_total = 0
    masked: dict[str, int] = {status.name.lower(): 0 for status in Status}
    rewards, components = [], {}
    for number, session in enumerate(sessions):
        sampled = sum(len(c.sampled_ids) for c in session.calls)
        sampled_total += sampled
        reward = training_reward(session, truncation)
        if reward is None:
            masked[session.status.name.lower()] += sampled
            continue
        rewards.append(reward)
        for name, value in session.components.items():
            components.setdefault(name, []).append(float(value))
        session_chains = chains_of(session, number)
        chains += len(session_chains)
        calls += len({i for chain in session_chains for i in chain.calls if i >= 0})
    metrics["sessions/calls_per_chain"] = calls / chains if chains else 0.0
    for status, count in masked.items():
        metrics[f"masked_share/{status}"] = count / sampled_total if sampled_total else 0.0
    metrics["reward/mean"] = float(np.mean(rewards)) if rewards else float("nan")
    for name, values in components.items():
        metrics[f"reward/{name}"] = float(np.mean(values))
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
