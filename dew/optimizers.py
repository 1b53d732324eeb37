"""Optimizer wrappers the recipes build with: what optax leaves to the caller.

:func:`skip_empty_updates` holds the weights still on a gradient that is exactly zero.
Adam given a zero gradient still moves every weight along its momentum (and keeps doing
so, decaying, for tens of updates), so a batch with nothing to learn from would keep
pushing the policy the way the last real batches did. A GRPO batch gives an exactly zero
gradient when its objective masks every sampled id (``max_token_lag`` below the lag of
everything the schedule drew) or when every group's samples got one reward. PyTorch's
Adam moves the weights on a zero gradient tensor the same way; only a missing gradient
(``None``) skips a parameter there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def skip_empty_updates(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """``inner``, except that an all-zero gradient leaves the parameters and ``inner``'s state unchanged.

    The test is the gradient's global norm, so it agrees on every device and process of
    a data-parallel update; a skipped update does not advance ``inner``'s step count (a
    learning-rate schedule resumes where it was).
    """

    def update(grads, state, params=None):
        def skip(_):
            return jax.tree.map(jnp.zeros_like, grads), state

        def apply(_):
            return inner.update(grads, state, params)

        return jax.lax.cond(optax.tree.norm(grads) == 0, skip, apply, None)

    return optax.GradientTransformation(inner.init, update)
