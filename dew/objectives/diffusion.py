"""``DiffusionObjective``: flow matching on images, and the pieces Flow-GRPO reuses.

``DiffusionObjective(model, process, inputs, *, steps=20, sampler="ode", guidance=None,
condition_dropout=0.0, metrics=(), ema_decay=None, pretrained=None)`` trains ``model`` (for
example ``models.SimpleDiT``) to predict the Process's target at a random time: the batch's
generated field in [-1, 1] (encoded when the InputSpec has an autoencoder) mixed with Gaussian
noise, the loss the mean squared error over every coordinate ("mse").

What Flow-GRPO shares with it (:class:`FlowModel`):

- the variables: ``{"params": {"model": ..., "encoders_<name>": ...}}``, one :class:`Denoiser`
  over the model and the InputSpec's conditioning encoders (``pretrained`` replaces them);
- ``velocity(params, conditions)``: the velocity field a sampler steps along. With
  ``guidance=g`` it is classifier-free guidance, ``v_null + g (v_cond - v_null)``, where the
  null condition is a zero embedding (train it with ``condition_dropout`` > 0);
- ``generate(variables, batch, keys, steps, stochastic)``: a :func:`sample_trajectory` run;
- ``preview(variables, batch, key=None)``: decoded samples in [-1, 1] as numpy, drawn with the
  objective's ``steps`` and ``sampler`` ("ode": deterministic; "sde": the Process's noise);
- ``evaluate``: with ``metrics``, each a function ``metric(samples, batch) -> {name: sum over
  rows}`` of decoded samples drawn as ``preview`` draws them (a fixed key per batch row, so
  validations compare), reported as means per sample; DiffusionObjective adds the batch's
  flow-matching loss at fixed times and noise ("loss").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dew.flow.inputs import InputSpec
from dew.flow.process import Process
from dew.flow.trajectory import FlowTrajectory, sample_trajectory
from dew.objectives.base import Objective, check_ema_decay, check_variables
from dew.validation import integer, number, one_of

SAMPLERS = ("ode", "sde")
EVALUATION_KEY = 0  # validation draws from fold_in(key(0), row): the same noise at every validation


class Denoiser(nn.Module):
    """The model and its conditioning encoders as one module: (x, t, conditions, drop) -> model output."""

    model: nn.Module
    encoders: Mapping[str, nn.Module]

    @nn.compact
    def __call__(self, x, t, conditions: Mapping | None = None, drop=None):
        embedding = None
        for name in sorted(self.encoders):
            encoded = self.encoders[name](conditions[name])
            embedding = encoded if embedding is None else embedding + encoded
        if embedding is not None and drop is not None:
            embedding = jnp.where(drop[:, None], 0.0, embedding)
        return self.model(x, t, embedding)


class FlowModel(Objective):
    """What DiffusionObjective and FlowGRPOObjective share (see the module docstring)."""

    def __init__(self, model, process: Process, inputs: InputSpec, *, steps: int, sampler: str,
                 guidance: float | None, metrics: Sequence[Callable], pretrained=None):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a flax.linen Module such as models.SimpleDiT, got {type(model).__name__}")
        if not isinstance(process, Process):
            raise TypeError(f"process must be a dew Process (presets.Flow()()), got {type(process).__name__}")
        if not isinstance(inputs, InputSpec):
            raise TypeError(f"inputs must be a dew.InputSpec, got {type(inputs).__name__}")
        integer("steps", steps, at_least=2, why="time points including both endpoints")
        one_of("sampler", sampler, SAMPLERS)
        if guidance is not None:
            number("guidance", guidance, at_least=0, why="the classifier-free guidance scale, or None")
            if not inputs.conditions:
                raise ValueError("guidance needs a condition field in the InputSpec to guide by; use guidance=None")
        metrics = tuple(metrics)
        for metric in metrics:
            if not callable(metric):
                raise TypeError(f"metrics must be callables metric(samples, batch) -> {{name: sum}}, got {metric!r}")
        self.model = model
        self.process = process
        self.inputs = inputs
        self.steps = steps
        self.sampler = sampler
        self.guidance = None if guidance is None else float(guidance)
        self.metrics = metrics
        self.pretrained = None if pretrained is None else check_variables(pretrained)
        self.denoiser = Denoiser(model, dict(inputs.encoders))
        self._preview = jax.jit(self._decoded_samples, static_argnums=(3,))

    def init(self, key):
        if self.pretrained is not None:
            return self.pretrained
        x = jnp.zeros((1, *self.inputs.latent_shape), jnp.float32)
        conditions = {c.name: jnp.zeros((1, *c.shape), jnp.int32) for c in self.inputs.conditions}
        return self.denoiser.init(key, x, jnp.zeros((1,), jnp.float32), conditions)

    # ----- the velocity field and sampling ----------------------------------------------------

    def velocity(self, variables, conditions: Mapping) -> Callable[[jax.Array, jax.Array], jax.Array]:
        """v(x, t) of the denoiser at ``variables`` for these condition columns (guided when asked)."""
        def field(x, t):
            if self.guidance is None:
                return self.process.velocity(self.denoiser.apply(variables, x, t, conditions), x, t)
            rows = x.shape[0]
            doubled = {name: jnp.concatenate([value, value]) for name, value in conditions.items()}
            drop = jnp.arange(2 * rows) < rows  # first half: the null condition
            both = self.denoiser.apply(variables, jnp.concatenate([x, x]), jnp.concatenate([t, t]), doubled, drop)
            both = self.process.velocity(both, jnp.concatenate([x, x]), jnp.concatenate([t, t]))
            null, conditioned = both[:rows], both[rows:]
            return null + self.guidance * (conditioned - null)

        return field

    def generate(self, variables, batch, keys: jax.Array, steps: int, stochastic=True) -> FlowTrajectory:
        """A sampling run for the batch's rows (one key each) with the denoiser at ``variables``."""
        field = self.velocity(variables, self.inputs.condition_columns(batch))
        return sample_trajectory(field, self.process, keys, self.inputs.latent_shape, steps, stochastic)

    def row_keys(self, key: jax.Array, rows: int) -> jax.Array:
        return jax.vmap(lambda row: jax.random.fold_in(key, row))(jnp.arange(rows))

    def _decoded_samples(self, variables, batch, key, rows: int):
        keys = self.row_keys(key, rows)
        trajectory = self.generate(variables, batch, keys, self.steps, self.sampler == "sde")
        return self.inputs.decode(trajectory.samples)

    def preview(self, variables, batch, key: jax.Array | None = None) -> np.ndarray:
        """``[rows, *field shape]`` decoded samples in [-1, 1] for the batch's rows (its conditions, if any)."""
        rows = self.inputs.rows(batch, f"{type(self).__name__}.preview")
        key = jax.random.key(EVALUATION_KEY) if key is None else key
        columns = {c.name: jnp.asarray(batch[c.name], jnp.int32) for c in self.inputs.conditions}
        return np.asarray(self._preview(variables, columns, key, rows))

    # ----- validation ------------------------------------------------------------------------

    def sample_metrics(self, variables, batch) -> dict:
        if not self.metrics:
            return {}
        rows = batch_rows(batch, self.inputs)
        samples = self._decoded_samples(variables, batch, jax.random.key(EVALUATION_KEY), rows)
        sums = {"samples": jnp.asarray(rows, jnp.float32)}
        for metric in self.metrics:
            for name, value in dict(metric(samples, batch)).items():
                sums[f"sample/{name}"] = jnp.asarray(value, jnp.float32).sum()
        return sums

    def summarize(self, totals):
        samples = totals.get("samples")
        metrics = {}
        for name, value in totals.items():
            if name.startswith("sample/"):
                metrics[name] = value / samples
        if samples is not None:
            metrics["samples"] = samples
        return metrics


def batch_rows(batch, inputs: InputSpec) -> int:
    """The row count of the first InputSpec field the batch holds (a source batch may lack the generated one)."""
    for item in inputs.fields:
        if item.name in batch:
            return batch[item.name].shape[0]
    raise KeyError(f"the batch holds none of the InputSpec's fields {[f.name for f in inputs.fields]}")


class DiffusionObjective(FlowModel):
    """Flow matching on the batch's generated field (see the module docstring)."""

    def __init__(self, model, process: Process, inputs: InputSpec, *, steps: int = 20, sampler: str = "ode",
                 guidance: float | None = None, condition_dropout: float = 0.0, metrics: Sequence[Callable] = (),
                 ema_decay: float | None = None, pretrained=None):
        super().__init__(model, process, inputs, steps=steps, sampler=sampler, guidance=guidance, metrics=metrics,
                         pretrained=pretrained)
        self.condition_dropout = number("condition_dropout", condition_dropout, at_least=0, below=1)
        if self.condition_dropout and not inputs.conditions:
            raise ValueError("condition_dropout needs a condition field in the InputSpec")
        self.ema_decay = check_ema_decay(ema_decay)

    def validate(self, batch) -> None:
        self.inputs.rows(batch, "DiffusionObjective", need_generated=True)

    def _errors(self, params, batch, key, dropout: float):
        x0 = self.inputs.data(batch)
        rows = x0.shape[0]
        time_key, noise_key, drop_key = jax.random.split(key, 3)
        t = self.process.training_times(time_key, rows)
        eps = jax.random.normal(noise_key, x0.shape)
        drop = jax.random.bernoulli(drop_key, dropout, (rows,)) if dropout else None
        output = self.denoiser.apply(params, self.process.interpolate(x0, eps, t), t,
                                     self.inputs.condition_columns(batch), drop)
        return ((output - self.process.target(x0, eps)) ** 2).reshape(rows, -1).mean(axis=1)

    def loss(self, variables, ema, batch, key):
        mse = self._errors(variables, batch, key, self.condition_dropout).mean()
        return mse, {"mse": mse}

    def evaluate(self, variables, batch):
        errors = self._errors(variables, batch, jax.random.key(EVALUATION_KEY), 0.0)
        return {"loss_sum": errors.sum(), "rows": jnp.asarray(errors.shape[0], jnp.float32),
                **self.sample_metrics(variables, batch)}

    def summarize(self, totals):
        return {"loss": totals["loss_sum"] / totals["rows"], **super().summarize(totals)}
