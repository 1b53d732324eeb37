"""The rectified-flow ``Process`` and its presets (``dew.presets.Flow``).

A Process says how data and noise mix at a time t in [0, 1], what the model predicts, how
training draws times, and how a sampler steps from noise (t = 1) to data (t = 0):

- ``interpolate(x0, eps, t)``: ``(1 - t) x0 + t eps``;
- ``target(x0, eps)``: the regression target, ``eps - x0`` for ``prediction="velocity"`` and
  ``x0`` for ``prediction="data"``;
- ``velocity(output, x, t)``: the model's output as a velocity (a data prediction x0_hat gives
  ``(x - x0_hat) / t``, finite at every t a sampler visits, all > 0);
- ``times(steps)``: ``steps`` evenly spaced points from 1 down to 0, both endpoints included;
- ``noise(times)``: each transition's SDE noise sigma_t (:func:`dew.losses.flow_sde.sde_noise`).

``presets.Flow(noise_level=0.7, prediction="velocity", time_sampling="uniform")`` is the
preset; calling it builds the Process, so ``presets.Flow()()`` is the Flow-GRPO process. The
noise level 0.7 is the released Flow-GRPO SD3 configuration's.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from dew.losses.flow_sde import sde_noise
from dew.validation import integer, number, one_of

PREDICTIONS = ("velocity", "data")
TIME_SAMPLING = ("uniform", "logit_normal")


@dataclass(frozen=True)
class Process:
    """A rectified-flow process (see the module docstring); build it with ``presets.Flow()()``."""

    noise_level: float = 0.7
    prediction: str = "velocity"
    time_sampling: str = "uniform"

    def __post_init__(self):
        number("noise_level", self.noise_level, at_least=0, why="the SDE noise scale a of sigma_t = a sqrt(t / (1 - t))")
        one_of("prediction", self.prediction, PREDICTIONS)
        one_of("time_sampling", self.time_sampling, TIME_SAMPLING)

    kind = "rectified_flow"

    def interpolate(self, x0: jax.Array, eps: jax.Array, t: jax.Array) -> jax.Array:
        """x_t for x0, eps [rows, ...] and t [rows]."""
        tt = t.reshape((-1,) + (1,) * (x0.ndim - 1))
        return (1.0 - tt) * x0 + tt * eps

    def target(self, x0: jax.Array, eps: jax.Array) -> jax.Array:
        return eps - x0 if self.prediction == "velocity" else x0

    def velocity(self, output: jax.Array, x: jax.Array, t: jax.Array) -> jax.Array:
        if self.prediction == "velocity":
            return output
        return (x - output) / t.reshape((-1,) + (1,) * (x.ndim - 1))

    def training_times(self, key: jax.Array, rows: int) -> jax.Array:
        """[rows] times in (0, 1) for a training batch: uniform, or the logit-normal of SD3 (mean 0, std 1)."""
        if self.time_sampling == "uniform":
            return jax.random.uniform(key, (rows,), minval=1e-5, maxval=1.0)
        return jax.nn.sigmoid(jax.random.normal(key, (rows,)))

    def times(self, steps: int) -> np.ndarray:
        """[steps] float32 time points from 1 to 0, both included (steps - 1 transitions)."""
        integer("steps", steps, at_least=2, why="time points including both endpoints: at least one transition")
        return np.linspace(1.0, 0.0, steps, dtype=np.float32)

    def noise(self, times) -> jax.Array:
        """[points - 1] sigma_t of each transition of ``times``."""
        return sde_noise(jnp.asarray(times, jnp.float32), self.noise_level)


@dataclass(frozen=True)
class Flow:
    """The rectified-flow preset: ``Flow(...)()`` is a :class:`Process` with these options."""

    noise_level: float = 0.7
    prediction: str = "velocity"
    time_sampling: str = "uniform"

    def __call__(self) -> Process:
        return Process(noise_level=self.noise_level, prediction=self.prediction, time_sampling=self.time_sampling)
