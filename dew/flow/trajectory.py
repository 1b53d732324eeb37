"""``sample_trajectory``: a rectified-flow sampling run with the density of every stochastic step.

``sample_trajectory(velocity, process, keys, shape, steps, stochastic=True)`` starts each row
from its own noise at t = 1 and takes ``steps - 1`` transitions down to t = 0 on
``process.times(steps)``. Row i draws only from ``keys[i]`` (its start from
``fold_in(keys[i], 0)``, transition k's noise from ``fold_in(keys[i], k + 1)``), so a row's
trajectory does not depend on which other rows share the batch or which device holds it.

``stochastic`` picks the SDE transitions: True (every one with sigma_t > 0), False (the ODE
sampler), or one bool per transition. A deterministic transition is the ODE step
``x + v dt``: it has no Gaussian density, its log density is recorded as 0 and its mark is
False, and Flow-GRPO never trains on it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dew.flow.process import Process
from dew.losses.flow_sde import gaussian_log_density, sde_transition


@struct.dataclass
class FlowTrajectory:
    """One sampling run. states: ``[rows, points, *shape]`` (states[:, 0] the noise, states[:, -1]
    the sample); times: [points] from 1 to 0; log_densities: [rows, points - 1] the joint log
    density (summed over coordinates) of each transition, 0 where it was deterministic;
    stochastic: [points - 1] bool, the marks of stochastic support; noise: [points - 1] the
    sigma_t each transition used (0 where deterministic)."""

    states: jax.Array
    times: jax.Array
    log_densities: jax.Array
    stochastic: jax.Array
    noise: jax.Array

    @property
    def samples(self) -> jax.Array:
        return self.states[:, -1]


def transition_marks(stochastic: bool | Sequence[bool], transitions: int) -> np.ndarray:
    """[transitions] bool from True, False or one bool per transition (a clear error otherwise)."""
    if isinstance(stochastic, (bool, np.bool_)):
        return np.full(transitions, bool(stochastic))
    marks = list(stochastic)
    if len(marks) != transitions or not all(isinstance(m, (bool, np.bool_)) for m in marks):
        raise ValueError(f"stochastic must be True, False or {transitions} bools (one per transition), got {stochastic!r}")
    return np.asarray(marks, bool)


def sample_trajectory(velocity: Callable[[jax.Array, jax.Array], jax.Array], process: Process, keys: jax.Array,
                      shape: Sequence[int], steps: int, stochastic: bool | Sequence[bool] = True) -> FlowTrajectory:
    """Sample ``len(keys)`` rows of ``shape`` (see the module docstring); jit-compatible.

    ``velocity(x [rows, *shape], t [rows]) -> [rows, *shape]`` is the model's velocity field.
    """
    times = jnp.asarray(process.times(steps))
    marks = jnp.asarray(transition_marks(stochastic, steps - 1))
    sigmas = jnp.where(marks, process.noise(times), 0.0)
    rows = keys.shape[0]
    start = jax.vmap(lambda key: jax.random.normal(jax.random.fold_in(key, 0), tuple(shape)))(keys)

    def transition(x, inputs):
        k, t, t_next, sigma = inputs
        column = jnp.full((rows,), t)
        mean, std = sde_transition(x, velocity(x, column), column, jnp.full((rows,), t_next), jnp.full((rows,), sigma))
        eps = jax.vmap(lambda key: jax.random.normal(jax.random.fold_in(key, k + 1), tuple(shape)))(keys)
        x_next = mean + std.reshape((-1,) + (1,) * len(shape)) * eps
        drawn = std > 0
        safe = jnp.where(drawn, std, 1.0)
        joint = gaussian_log_density(x_next, mean, safe).reshape(rows, -1).sum(axis=1)
        return x_next, (x_next, jnp.where(drawn, joint, 0.0))

    indices = jnp.arange(steps - 1)
    _, (states, log_densities) = jax.lax.scan(transition, start, (indices, times[:-1], times[1:], sigmas))
    states = jnp.concatenate([start[None], states], axis=0)  # [points, rows, *shape]
    return FlowTrajectory(
        states=jnp.moveaxis(states, 0, 1),
        times=times,
        log_densities=log_densities.T,
        stochastic=sigmas > 0,
        noise=sigmas,
    )
