"""PPO's advantage targets, on arrays: GAE and masked whitening (verl core_algos style).

- :func:`gae`: verl's ``compute_gae_advantage_return`` loop before whitening: over
  [rows, T] rewards and values with a mask, ids off the mask are skipped (their value and
  TD error do not enter), the last step bootstraps from 0;
- :func:`masked_whiten`: verl's ``masked_whiten``: mean and the unbiased (Bessel) variance
  over the mask, ``(x - mean) * rsqrt(var + 1e-8)``; it needs at least two masked entries.

The critic's own loss is :func:`dew.losses.value_loss.clipped_value_loss`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


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
