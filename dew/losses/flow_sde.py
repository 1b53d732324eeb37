"""The rectified-flow SDE transition of Flow-GRPO as pure functions of arrays.

Rectified flow interpolates ``x_t = (1 - t) x_0 + t eps``: data at t = 0, noise at t = 1, and
the model predicts the velocity ``v = eps - x_0``. Sampling runs from t = 1 down to t = 0. The
ODE step is ``x + v dt`` (dt = t_next - t < 0). Flow-GRPO (Liu et al. 2025, eq. 8-9) turns it
into an SDE with the same marginals; each step is then a Gaussian transition

    mean = x + dt * (v + sigma_t**2 / (2 t) * (x + (1 - t) v))
    std  = sigma_t * sqrt(-dt),        sigma_t = a * sqrt(t / (1 - t))

with the noise level ``a``. At t = 1 the ratio t / (1 - t) has no finite value; as the released
trainer does (yifan123/flow_grpo 54809b5, flow_grpo/diffusers_patch/sd3_sde_with_logprob.py),
the grid's second point stands in for t in the denominator there. Formulas follow that file.

Every density here is per coordinate: ``gaussian_log_density`` returns one value per
coordinate and the losses average them over a row's coordinates, so an image's ratio does not
grow with its pixel count. ``transition_kl`` is the closed-form KL of two such transitions with
the same variance (section 4 of the paper), the elapsed time -dt inside that variance; the
released trainer divides by sigma_t**2 alone, a time-reweighted regularizer, so its beta values
do not carry over.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

_HALF_LOG_TWO_PI = 0.5 * math.log(2.0 * math.pi)


def sde_noise(times: jax.Array, noise_level: float) -> jax.Array:
    """sigma_t of each transition of a time grid: ``a * sqrt(t / (1 - t))``.

    times: [points] float32, from 1 down to 0 (at least two points). Returns [points - 1]: the
    noise of each transition at its start time, with the grid's second point standing in for t
    in ``1 - t`` where t == 1 (so the first transition of a grid starting at 1 is finite).
    """
    start = times[:-1]
    denominator = 1.0 - jnp.where(start == 1.0, times[1], start)
    return noise_level * jnp.sqrt(start / denominator)


def sde_transition(x: jax.Array, velocity: jax.Array, t: jax.Array, t_next: jax.Array,
                   sigma: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(mean, std) of the Gaussian step from ``x`` at time t to t_next.

    x, velocity: [rows, ...] float32; t, t_next, sigma: [rows] float32 (sigma from
    :func:`sde_noise`). With sigma == 0 the mean is the ODE step ``x + v dt`` and std is 0.
    Returns mean [rows, ...] and std [rows] (``sigma * sqrt(t - t_next)``).
    """
    shape = (-1,) + (1,) * (x.ndim - 1)
    dt = (t_next - t).reshape(shape)
    s, tt = sigma.reshape(shape), t.reshape(shape)
    drift = s**2 / (2.0 * tt) * (x + (1.0 - tt) * velocity)
    mean = x + dt * (velocity + drift)
    return mean, sigma * jnp.sqrt(t - t_next)


def gaussian_log_density(value: jax.Array, mean: jax.Array, std: jax.Array) -> jax.Array:
    """Per-coordinate log N(value; mean, std**2): [rows, ...] from value and mean [rows, ...], std [rows] > 0."""
    s = std.reshape((-1,) + (1,) * (value.ndim - 1))
    return -((value - mean) ** 2) / (2.0 * s**2) - jnp.log(s) - _HALF_LOG_TWO_PI


def coordinate_mean(values: jax.Array) -> jax.Array:
    """[rows] means over every axis but the first: a row's per-coordinate average."""
    return values.reshape(values.shape[0], -1).mean(axis=1)


def transition_kl(mean: jax.Array, reference_mean: jax.Array, std: jax.Array) -> jax.Array:
    """Per-coordinate KL(policy || reference) of two Gaussian transitions sharing ``std``.

    mean, reference_mean: [rows, ...]; std: [rows] (sigma_t * sqrt(-dt), the elapsed time
    included). Returns [rows]: ``mean over coordinates of (mean - reference_mean)**2 / (2 std**2)``,
    which equals ``-dt / 2 * (sigma_t (1 - t) / (2 t) + 1 / sigma_t)**2 * mean((v - v_ref)**2)``.
    """
    s = std.reshape((-1,) + (1,) * (mean.ndim - 1))
    return coordinate_mean((mean - reference_mean) ** 2 / (2.0 * s**2))
