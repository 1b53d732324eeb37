"""Preference losses as pure functions of arrays (no model calls): DPO's sigmoid loss, checked against TRL."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sequence_log_probs(token_log_probs: jax.Array, mask: jax.Array) -> jax.Array:
    """Sum of per-token log-probabilities under a 0/1 (or weight) mask along the last axis.

    token_log_probs, mask: [..., width] -> [...]
    """
    return (token_log_probs * mask).sum(axis=-1)


def dpo_loss(
    policy_log_probs: jax.Array, reference_log_probs: jax.Array, beta: float
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Direct preference optimisation's sigmoid loss (Rafailov et al.; TRL's ``loss_type="sigmoid"``).

    policy_log_probs, reference_log_probs: [pairs, 2] float32 sequence log-probabilities of
    the completions, index 0 chosen and 1 rejected. Returns the mean of
    ``-log sigmoid(beta * ((pc - rc) - (pr - rr)))`` and the metrics ``rewards/chosen``,
    ``rewards/rejected`` (beta times each side's log-ratio, averaged), ``rewards/margins``
    and ``rewards/accuracies`` (the share of pairs whose chosen reward is higher).
    """
    reference_log_probs = jax.lax.stop_gradient(reference_log_probs)
    ratios = policy_log_probs - reference_log_probs  # [pairs, 2]
    loss = -jax.nn.log_sigmoid(beta * (ratios[:, 0] - ratios[:, 1])).mean()
    rewards = beta * jax.lax.stop_gradient(ratios)
    metrics = {
        "rewards/chosen": rewards[:, 0].mean(),
        "rewards/rejected": rewards[:, 1].mean(),
        "rewards/margins": (rewards[:, 0] - rewards[:, 1]).mean(),
        "rewards/accuracies": (rewards[:, 0] > rewards[:, 1]).astype(jnp.float32).mean(),
    }
    return loss, metrics
