"""Direct preference optimisation: ``DPOObjective``.

The policy is the model being trained; the reference is its starting variables, kept
frozen in ``TrainState.ema`` (the objective fixes ``ema_decay`` at 1 and refuses an
override). For each pair the objective sums next-token log-probabilities over each
completion (the mask weights of the targets) under both, and applies the sigmoid loss
of :func:`dew.losses.dpo_loss.dpo_loss`.

Batch fields (from ``PreferencePairs.load``): ``input_ids`` and ``completion_mask``,
both ``[pairs, 2, seq_len + 1]``, index 0 chosen and 1 rejected.

Memory: a DPO step holds the policy parameters, the reference parameters (a second
full copy, in the EMA slot), the optimizer state (two more copies for Adam),
the gradients, the activations of the policy's forward and backward pass over
``2 x pairs`` sequences, and the reference's forward activations (no backward).
Keeping the reference in the EMA slot saves a second model object, not its memory;
bench/dpo_step.py measures the peak against an SFT step of the same model.

Validation reports the loss and perplexity of the chosen completions under the policy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dew.objectives.base import (
    Objective,
    Variables,
    check_integer_field,
    check_seq_len,
    check_variables,
    check_vocabulary,
    require_field,
)
from dew.objectives.lm import token_log_probs
from dew.losses.dpo_loss import dpo_loss, sequence_log_probs
from dew.validation import positive

_UNSET = object()


class DPOObjective(Objective):
    """DPO against the frozen starting policy.

    seq_len: predicted positions, one fewer than ``PreferencePairs.seq_len``.
    beta: strength of the comparison with the reference; must be positive.
    pretrained: a full Flax variables mapping to start from; it also becomes the reference.
    """

    ema_decay = 1.0

    def __init__(self, model, seq_len: int, beta: float = 0.1, pretrained: Variables | None = None, ema_decay=_UNSET):
        if ema_decay is not _UNSET:
            raise ValueError(
                f"DPOObjective keeps its reference in the EMA slot with ema_decay fixed at 1; got ema_decay={ema_decay!r}"
            )
        seq_len = check_seq_len(model, seq_len)
        positive("beta", beta)
        self.model = model
        self.seq_len = seq_len
        self.beta = float(beta)
        self.pretrained = None if pretrained is None else check_variables(pretrained)

    def validate(self, batch) -> None:
        owner = f"DPOObjective(seq_len={self.seq_len})"
        for field in ("input_ids", "completion_mask"):
            value = require_field(batch, field, owner)
            shape = np.shape(value)
            if len(shape) != 3 or shape[1:] != (2, self.seq_len + 1):
                raise ValueError(
                    f"{owner}: batch field {field!r} must be [pairs, 2, seq_len + 1] = [pairs, 2, {self.seq_len + 1}], "
                    f"got {shape}"
                )
            check_integer_field(batch, field, shape, owner)
        check_vocabulary(batch["input_ids"], self.model, owner, "'input_ids' pair")

    def token_log_probs(self, variables, batch) -> tuple[jax.Array, jax.Array]:
        """Per-target log-probabilities and target weights, both [pairs, 2, seq_len]."""
        ids = batch["input_ids"]
        pairs, _, width = ids.shape
        flat = ids.reshape(pairs * 2, width)
        logits = self.model.apply(variables, flat[:, :-1])
        scores = token_log_probs(logits, flat[:, 1:]).reshape(pairs, 2, width - 1)
        return scores, batch["completion_mask"][:, :, 1:].astype(jnp.float32)

    def loss(self, variables, ema, batch, key):
        policy, weights = self.token_log_probs(variables, batch)
        reference, _ = self.token_log_probs(ema, batch)
        return dpo_loss(sequence_log_probs(policy, weights), sequence_log_probs(reference, weights), self.beta)

    def evaluate(self, variables, batch):
        scores, weights = self.token_log_probs(variables, batch)
        return {"nll_sum": -(scores[:, 0] * weights[:, 0]).sum(), "target_tokens": weights[:, 0].sum()}

    def summarize(self, totals):
        tokens = totals["target_tokens"]
        loss = totals["nll_sum"] / tokens if tokens else float("nan")
        return {"chosen_loss": loss, "chosen_perplexity": float(np.exp(loss)), "chosen_tokens": tokens}
