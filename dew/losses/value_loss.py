"""The critic's loss for PPO, on arrays (verl core_algos style).

:func:`clipped_value_loss` is verl's ``compute_value_loss`` with token-mean aggregation:
``0.5 * mean(max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2))`` over the mask. The
targets ``R`` come from :func:`dew.losses.gae.gae`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dew.losses.policy import aggregate


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
