"""PPO with a critic: ``ValueHead``, ``PPOObjective`` and the policy view collectors bind.

The variables are one tree with two subtrees, ``{"policy": ..., "critic": ...}``, trained
by the ordinary optimizer; the critic is initialised separately from the policy (its own
key). The policy loss is GRPO's clipped surrogate on the batch's per-token ``advantages``
(:class:`~dew.objectives.grpo.GRPOObjective`: the same clipping, KL and
behaviour-importance controls); with ``beta > 0`` the frozen reference in the EMA slot is
the policy subtree only (``reference``). The critic loss is
:func:`dew.losses.value_loss.clipped_value_loss`: half the squared error to ``returns``, its
predictions clipped to ``old_values +- value_clip``, times ``value_coefficient``. Both
losses reduce over the same action-token mass (token-mean; other aggregations and
sequence masks are refused).

A critic is a Flax module called as ``critic(ids, segment_ids=..., positions=...)`` on
packed rows that returns one float per position, ``[rows, length]``: the value of the
state after reading that id. ``ValueHead(backbone)`` is one: a scalar Dense head on a
decoder's final hidden states (a ``CausalTransformer`` gives them with ``hidden=True``; any
other backbone must return ``[rows, length, features]``). The value aligned with column t
of ``input_ids`` is the critic's output at t - 1, the state the action at t was sampled in,
as ``packed_log_probs`` aligns log p(id_t | prefix).

``objective.policy(variables)`` is what EpisodeRollout samples from: a TextGeneration over
the policy subtree of whatever tree it is bound to (native generation needs only the model
and the sampler, below this layer).
"""

from __future__ import annotations

from collections.abc import Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dew.inference.generation import TextGeneration
from dew.losses.value_loss import clipped_value_loss
from dew.models.value_head import ValueHead
from dew.objectives.base import Variables, require_field
from dew.objectives.grpo import GRPOObjective
from dew.validation import number

TARGETS = ("old_values", "advantages", "returns")
__all__ = ["PPOObjective", "PolicyView", "ValueHead"]


class PolicyView:
    """The policy subtree of a PPO tree as a bindable TextGeneration (what ``PPOObjective.policy`` returns)."""

    def __init__(self, model, variables=None):
        self.model, self.variables = model, variables

    def bind(self, variables) -> TextGeneration:
        if not isinstance(variables, Mapping) or "policy" not in variables:
            raise ValueError("a PPO policy binds a tree with a 'policy' subtree (the Trainer's PPOObjective "
                             f"variables); got {sorted(variables) if isinstance(variables, Mapping) else variables!r}")
        return TextGeneration(self.model, variables["policy"])


class PPOObjective(GRPOObjective):
    """PPO on packed rows with a critic (see the module docstring)."""

    def __init__(self, model, seq_len: int, critic: nn.Module, value_coefficient: float = 0.5,
                 value_clip: float = 0.2, beta: float = 0.0, epsilon_low: float = 0.2, epsilon_high: float = 0.2,
                 dual_clip: float | None = 3.0, behavior_importance: float | tuple[float, float] | None = None,
                 aggregation: str = "token-mean", sequence_mask=None, geometric_mask=None, pretrained=None):
        if aggregation != "token-mean":
            raise ValueError(f"PPOObjective keeps token-mean aggregation (the policy and critic losses reduce over "
                             f"the same action-token mass); got aggregation={aggregation!r}")
        for name, value in (("sequence_mask", sequence_mask), ("geometric_mask", geometric_mask)):
            if value is not None:
                raise ValueError(f"PPOObjective refuses {name}: a masked chain would leave the critic's loss mass "
                                 "and the policy's apart")
        if not isinstance(critic, nn.Module):
            raise TypeError(f"critic must be a Flax module returning one value per position, got "
                            f"{type(critic).__name__}")
        super().__init__(model, seq_len, beta=beta, epsilon_low=epsilon_low, epsilon_high=epsilon_high,
                         dual_clip=dual_clip, behavior_importance=behavior_importance)
        self.pretrained_policy = pretrained
        self.critic = critic
        self.value_coefficient = number("value_coefficient", value_coefficient, at_least=0)
        self.value_clip = number("value_clip", value_clip, above=0)

    # ----- variables -----------------------------------------------------------------------------

    def init(self, key: jax.Array) -> Variables:
        policy_key, critic_key = jax.random.split(key)  # the critic starts on its own key
        ids = jnp.zeros((1, self.seq_len), jnp.int32)
        policy = self.pretrained_policy if self.pretrained_policy is not None else self.model.init(policy_key, ids)
        return {"policy": policy, "critic": self.critic.init(critic_key, ids)}

    def reference(self, variables: Variables) -> Variables:
        """What the frozen EMA slot holds: the policy subtree only."""
        return variables["policy"]

    def policy(self, variables: Variables | None = None) -> PolicyView:
        """The bindable sampling policy over the policy subtree (EpisodeRollout binds the Trainer's snapshot)."""
        return PolicyView(self.model, variables)

    # ----- values --------------------------------------------------------------------------------

    def values(self, critic_variables: Variables, batch) -> jax.Array:
        """V(prefix before id t) at column t, [rows, width] float32 (0 where an id has no prefix in its chain)."""
        ids, segments = batch["input_ids"], batch["text_segment_ids"]
        out = self.critic.apply(critic_variables, ids[:, :-1], segment_ids=segments[:, :-1],
                                positions=batch["text_positions"][:, :-1])
        expected = (ids.shape[0], ids.shape[1] - 1)
        if out.shape != expected:
            raise ValueError(f"the critic returned values of shape {tuple(out.shape)}; one per position, {expected}, "
                             "is needed")
        valid = (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] != 0)
        out = jnp.where(valid, out.astype(jnp.float32), 0.0)
        return jnp.concatenate([jnp.zeros((ids.shape[0], 1), jnp.float32), out], axis=1)

    # ----- host checks and loss ----------------------------------------------------------------

    def validate(self, batch) -> None:
        super().validate(batch)
        width = self.seq_len + 1
        for field in TARGETS:
            value = np.asarray(require_field(batch, field, "PPOObjective"), np.float64)
            if value.shape != np.shape(batch["input_ids"]) or value.shape[1] != width:
                raise ValueError(f"PPOObjective: batch field {field!r} must be shaped like input_ids "
                                 f"{np.shape(batch['input_ids'])}, got {value.shape}")
            if not np.isfinite(value).all():
                row, column = (int(i) for i in np.argwhere(~np.isfinite(value))[0])
                raise ValueError(f"PPOObjective: {field} holds a non-finite value at row {row}, column {column}")

    def loss(self, variables, ema, batch, key):
        policy_loss, metrics = super().loss(variables["policy"], ema, batch, key)
        mask = (batch["response_mask"][:, 1:] != 0).astype(jnp.float32)
        predictions = self.values(variables["critic"], batch)[:, 1:]
        value_loss, clipfrac = clipped_value_loss(predictions, batch["returns"][:, 1:], batch["old_values"][:, 1:],
                                                  mask, self.value_clip)
        metrics.update({"value_loss": value_loss, "value/clipfrac": clipfrac,
                        "value/mean": (predictions * mask).sum() / jnp.maximum(mask.sum(), 1.0)})
        return policy_loss + self.value_coefficient * value_loss, metrics
