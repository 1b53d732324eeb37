"""Advantage estimators as pure functions of arrays (verl core_algos style).

Outcome rewards to group-relative advantages, as verl 0.9.1's
compute_grpo_outcome_advantage and compute_rloo_outcome_advantage compute them
(tools/parity_agentic.py records them; tests/test_agentic_losses.py compares at 1e-6).
PPO's GAE and its whitening are :mod:`dew.losses.gae`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

ESTIMATORS = ("group", "mean", "rloo")


def group_advantages(rewards: jax.Array, groups: jax.Array, estimator: str, epsilon: float = 1e-6) -> jax.Array:
    """Group-relative advantages of outcome rewards (verl compute_grpo_outcome_advantage and
    compute_rloo_outcome_advantage).

    rewards: [samples] float32; groups: [samples] int, a key per sample (any values, in any
    order). With n members in a sample's group, mean and unbiased std over the group:

    - "group": (r - mean) / (std + epsilon) (GRPO, norm_adv_by_std_in_grpo=True);
    - "mean": r - mean (Dr.GRPO, norm_adv_by_std_in_grpo=False);
    - "rloo": r n / (n - 1) - mean n / (n - 1), r minus the mean of the others.

    A group of one member keeps its raw reward, as in verl: mean 0 and std 1 there, so
    "group" gives r / (1 + epsilon) and "mean" and "rloo" give r. Returns [samples] float32.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
    if rewards.ndim != 1 or groups.shape != rewards.shape:
        raise ValueError(f"rewards and groups must both be [samples], got {rewards.shape} and {groups.shape}")
    same = groups[:, None] == groups[None, :]  # [samples, samples]; sums rather than a matmul keep float32 exact
    n = same.sum(axis=1).astype(rewards.dtype)
    single = n < 2
    mean = jnp.where(same, rewards[None, :], 0.0).sum(axis=1) / n
    if estimator == "group":
        deviations = jnp.where(same, (rewards[None, :] - mean[:, None]) ** 2, 0.0).sum(axis=1)
        std = jnp.sqrt(deviations / jnp.where(single, 1.0, n - 1))
        return jnp.where(single, rewards / (1.0 + epsilon), (rewards - mean) / (std + epsilon))
    if estimator == "mean":
        return jnp.where(single, rewards, rewards - mean)
    others = jnp.where(single, 1.0, n - 1)
    return jnp.where(single, rewards, rewards * n / others - mean * n / others)


def population_group_advantages(scores, groups: int, epsilon: float = 1e-4):
    """Flow-GRPO's per-prompt advantages on the host, in float64 (yifan123/flow_grpo 54809b5,
    flow_grpo/stat_tracking.py PerPromptStatTracker.update, type "grpo").

    scores: [rows] float64, rows a multiple of ``groups``, each run of ``groups`` rows one
    prompt's group. Returns [rows] float64 ``(r - mean) / (std + epsilon)`` with the population
    std (ddof 0). A group whose scores are all equal gets exactly 0 (its mean can differ from
    the scores by an ulp, which would otherwise leave a 1e-13 advantage behind).
    """
    scores = np.asarray(scores, np.float64)
    if scores.ndim != 1 or scores.size % groups:
        raise ValueError(f"scores must be [rows] with rows a multiple of groups={groups}, got shape {scores.shape}")
    grouped = scores.reshape(-1, groups)
    mean = grouped.mean(axis=1, keepdims=True)
    std = grouped.std(axis=1, keepdims=True)
    advantages = (grouped - mean) / (std + epsilon)
    advantages[np.ptp(grouped, axis=1) == 0] = 0.0
    return advantages.reshape(-1)
