"""``FlowGRPOObjective``: GRPO on the stochastic transitions of rectified-flow samples (Flow-GRPO).

``FlowGRPOObjective(model, process, inputs, guidance=None, beta=0.0, steps=10, sampler="ode",
clip_range=1e-4, advantage_clip=5.0, metrics=(), pretrained=None)`` trains on the batches
:class:`~dew.collection.flow_rollout.FlowRollout` builds: for each sample row and each selected
transition k, the state x_k at time t_k, the state x_{k+1} the sampler drew, sigma_t, the
per-coordinate log density the sampling policy gave that draw, the row's group advantage and a
0/1 transition mask (cleared for deterministic transitions and zero-advantage rows).

The loss follows the released trainer (yifan123/flow_grpo 54809b5, scripts/train_sd3.py):

- the log density of x_{k+1} under the live policy's Gaussian transition, averaged over
  coordinates (:mod:`dew.losses.flow_sde`), against the recorded one: a per-coordinate ratio;
- the clipped surrogate of :func:`dew.losses.policy.ppo_surrogate` (``clip_range`` both ways, no
  dual clip) on advantages clipped to +-``advantage_clip``, averaged over the masked
  transitions ("token-mean" of :func:`~dew.losses.policy.aggregate`);
- with ``beta > 0``, plus beta times ``transition_kl`` to the frozen start: the closed-form
  per-coordinate Gaussian KL with the elapsed time in the variance (the released trainer's
  regularizer leaves the time out, so its betas differ). A positive beta freezes the start in
  the EMA slot; zero keeps no reference. An ``ema_decay`` override is refused.

Metrics: "policy_loss", "transition_kl" (0 without a reference), "clipfrac", "ppo_kl",
"transitions" (trainable transitions in the batch) and "reward" (the float32 mean of the
rows' rewards: a diagnostic that can round away differences the float64 advantages keep).
Evaluation and previews sample with the live policy and the objective's own ``steps`` and
``sampler`` (see :class:`~dew.objectives.diffusion.FlowModel`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dew.flow.inputs import InputSpec
from dew.flow.process import Process
from dew.losses.flow_sde import coordinate_mean, gaussian_log_density, sde_transition, transition_kl
from dew.losses.policy import aggregate, ppo_surrogate
from dew.objectives.diffusion import FlowModel, batch_rows
from dew.validation import number

_UNSET = object()
TRANSITION_FIELDS = ("states", "next_states")
COLUMN_FIELDS = ("times", "next_times", "noise", "log_densities", "transition_mask")


class FlowGRPOObjective(FlowModel):
    """Flow-GRPO (see the module docstring)."""

    def __init__(self, model, process: Process, inputs: InputSpec, guidance: float | None = None, beta: float = 0.0,
                 steps: int = 10, *, sampler: str = "ode", clip_range: float = 1e-4, advantage_clip: float = 5.0,
                 metrics: Sequence[Callable] = (), pretrained=None, ema_decay=_UNSET):
        if ema_decay is not _UNSET:
            raise ValueError("FlowGRPOObjective keeps its reference in the EMA slot (decay 1 when beta > 0, none "
                             f"otherwise); got ema_decay={ema_decay!r}")
        super().__init__(model, process, inputs, steps=steps, sampler=sampler, guidance=guidance, metrics=metrics,
                         pretrained=pretrained)
        if process.prediction != "velocity":
            raise ValueError(f"FlowGRPOObjective needs a rectified-flow Process with velocity prediction, got "
                             f"prediction={process.prediction!r}")
        if process.noise_level == 0:
            raise ValueError("FlowGRPOObjective needs a Process with noise_level > 0: an ODE sampler has no "
                             "transition densities to train on")
        self.beta = number("beta", beta, at_least=0)
        self.clip_range = number("clip_range", clip_range, above=0, below=1)
        self.advantage_clip = number("advantage_clip", advantage_clip, above=0)
        self.ema_decay = 1.0 if self.beta > 0 else None

    # ----- host checks -----------------------------------------------------------------------

    def validate(self, batch) -> None:
        """A FlowRollout batch (it has ``transition_mask``), or a source batch for validation."""
        owner = "FlowGRPOObjective"
        if "transition_mask" not in batch:
            self.inputs.rows(batch, f"{owner} (a source batch for validation)")
            return
        for name in (*TRANSITION_FIELDS, *COLUMN_FIELDS, "advantages"):
            if name not in batch:
                raise KeyError(f"{owner} needs batch field {name!r} (a FlowRollout batch); the batch has {sorted(batch)}")
        rows, transitions = np.shape(batch["transition_mask"])[:2] if np.ndim(batch["transition_mask"]) == 2 else (0, 0)
        if rows == 0 or transitions == 0:
            raise ValueError(f"{owner}: transition_mask must be [rows, transitions], got {np.shape(batch['transition_mask'])}")
        latent = self.inputs.latent_shape
        for name in TRANSITION_FIELDS:
            if tuple(np.shape(batch[name])) != (rows, transitions, *latent):
                raise ValueError(f"{owner}: batch field {name!r} must be {(rows, transitions, *latent)}, "
                                 f"got {tuple(np.shape(batch[name]))}")
        for name in COLUMN_FIELDS:
            if tuple(np.shape(batch[name])) != (rows, transitions):
                raise ValueError(f"{owner}: batch field {name!r} must be {(rows, transitions)}, got {np.shape(batch[name])}")
        if tuple(np.shape(batch["advantages"])) != (rows,):
            raise ValueError(f"{owner}: batch field 'advantages' must be ({rows},), got {np.shape(batch['advantages'])}")
        for name in (*TRANSITION_FIELDS, *COLUMN_FIELDS, "advantages"):
            value = np.asarray(batch[name])
            if not np.isfinite(value).all():
                row = int(np.argwhere(~np.isfinite(value))[0, 0])
                raise ValueError(f"{owner}: batch field {name!r} holds a non-finite value in row {row}")
        for condition in self.inputs.conditions:
            if condition.name not in batch:
                raise KeyError(f"{owner} needs the condition field {condition.name!r}; the batch has {sorted(batch)}")
            value = np.asarray(batch[condition.name])
            if value.shape != (rows, *condition.shape) or not np.issubdtype(value.dtype, np.integer):
                raise ValueError(f"{owner}: condition field {condition.name!r} must be integers of shape "
                                 f"{(rows, *condition.shape)}, got {value.dtype} {value.shape}")

    # ----- the loss --------------------------------------------------------------------------

    def transition_log_densities(self, variables, batch):
        """Per-coordinate log densities [rows, K] of the recorded draws, and the transition means and stds."""
        rows, transitions = batch["transition_mask"].shape
        flat = lambda name: batch[name].reshape(rows * transitions, *batch[name].shape[2:])  # noqa: E731
        x, x_next = flat("states"), flat("next_states")
        t, t_next, sigma = flat("times"), flat("next_times"), flat("noise")
        conditions = {name: jnp.repeat(value, transitions, axis=0)
                      for name, value in self.inputs.condition_columns(batch).items()}
        mean, std = sde_transition(x, self.velocity(variables, conditions)(x, t), t, t_next, sigma)
        safe = jnp.where(std > 0, std, 1.0)  # deterministic transitions are masked; keep their values finite
        log_densities = coordinate_mean(gaussian_log_density(x_next, mean, safe)).reshape(rows, transitions)
        return log_densities, (x, t, t_next, sigma, conditions, mean, safe)

    def loss(self, variables, ema, batch, key):
        mask = batch["transition_mask"].astype(jnp.float32)
        rows, transitions = mask.shape
        log_densities, (x, t, t_next, sigma, conditions, mean, std) = self.transition_log_densities(variables, batch)
        advantages = jnp.clip(batch["advantages"].astype(jnp.float32), -self.advantage_clip, self.advantage_clip)
        advantages = jnp.broadcast_to(advantages[:, None], (rows, transitions))
        losses, metrics = ppo_surrogate(log_densities, batch["log_densities"], advantages, mask,
                                        self.clip_range, self.clip_range, None)
        policy_loss = aggregate(losses, mask, "token-mean")
        kl = jnp.zeros((), jnp.float32)
        if self.beta > 0:
            reference = jax.lax.stop_gradient(ema)
            ref_velocity = self.velocity(reference, conditions)(x, t)
            ref_mean, _ = sde_transition(x, ref_velocity, t, t_next, sigma)
            kl = aggregate(transition_kl(mean, jax.lax.stop_gradient(ref_mean), std).reshape(rows, transitions),
                           mask, "token-mean")
        loss = policy_loss + self.beta * kl
        metrics = {**metrics, "policy_loss": policy_loss, "transition_kl": kl, "transitions": mask.sum()}
        if "rewards" in batch:
            metrics["reward"] = batch["rewards"].astype(jnp.float32).mean()
        return loss, metrics

    def evaluate(self, variables, batch):
        return {"samples": jnp.asarray(batch_rows(batch, self.inputs), jnp.float32), **self.sample_metrics(variables, batch)}
