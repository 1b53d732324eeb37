"""Critic math for PPO, on arrays: GAE, masked whitening and the clipped value loss (verl core_algos style).

- :func:`gae`: verl's ``compute_gae_advantage_return`` loop before whitening: over
  [rows, T] rewards and values with a mask, ids off the mask are skipped (their value and
  TD error do not enter), the last step bootstraps from 0;
- :func:`masked_whiten`: verl's ``masked_whiten``: mean and the unbiased (Bessel) variance
  over the mask, ``(x - mean) * rsqrt(var + 1e-8)``; it needs at least two masked entries;
- :func:`clipped_value_loss`: verl's ``compute_value_loss`` with token-mean aggregation:
  ``0.5 * mean(max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2))`` over the mask.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dew.losses.policy import aggregate


def gae(rewards: jax.Array, values: jax.Array, mask: jax.Array, gamma: float, lam: float
        ) -> tuple[jax.Array, jax.Array]:
    """(advantages, returns), both [rows, T] float32, before whitening (see the module docstring)."""
    rewards, values, mask = (jnp.asarray(x, jnp.float32) for x in (rewards, values, mask))

    def step(carry, column):
        next_value, last = carry
        reward, value, on = column
        delta = reward + gamma * next_value - value
        advantage = delta + gamma * lam * last
        next_value = value * on + (1 - on) * next_value
        last = advantage * on + (1 - on) * last
        return (next_value, last), last

    zeros = jnp.zeros(rewards.shape[0], jnp.float32)
    _, reversed_advantages = jax.lax.scan(step, (zeros, zeros), (rewards.T[::-1], values.T[::-1], mask.T[::-1]))
    advantages = reversed_advantages[::-1].T
    return advantages, advantages + values


def masked_whiten(values: jax.Array, mask: jax.Array) -> jax.Array:
    """``(values - mean) * rsqrt(var + 1e-8)`` with the mean and unbiased variance over ``mask`` (>= 2 entries)."""
    mask = jnp.asarray(mask, jnp.float32)
    count = mask.sum()
    mean = (values * mask).sum() / count
    variance = (((values - mean) ** 2) * mask).sum() / count * (count / (count - 1))
    return (values - mean) * jax.lax.rsqrt(variance + 1e-8)


def clipped_value_loss(predictions: jax.Array, returns: jax.Array, old_values: jax.Array, mask: jax.Array,
                       clip: float) -> tuple[jax.Array, jax.Array]:
    """(loss, clipfrac): the half squared error, clipped around the recorded values, token-mean over ``mask``."""
    mask = jnp.asarray(mask, jnp.float32)
    returns, old_values = jax.lax.stop_gradient(returns), jax.lax.stop_gradient(old_values)
    clipped = jnp.clip(predictions, old_values - clip, old_values + clip)
    unclipped_loss = (predictions - returns) ** 2
    clipped_loss = (clipped - returns) ** 2
    loss = 0.5 * aggregate(jnp.maximum(unclipped_loss, clipped_loss), mask, "token-mean")
    return loss, aggregate((clipped_loss > unclipped_loss).astype(jnp.float32), mask, "token-mean")
