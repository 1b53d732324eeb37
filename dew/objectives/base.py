"""The objective protocol the Trainer drives (see shared DESIGN, "The objective protocol").

An objective owns its model and says:

- ``init(key)``: the full Flax variables mapping to start from (``pretrained`` when given);
- ``ema_decay``: ``None`` (no averaged copy), a float in (0, 1) (a moving average) or
  exactly 1 (a frozen copy of the start: the reference of DPO, GRPO and PPO), of what
  ``reference(variables)`` picks (all of them by default; PPO's policy subtree);
- ``validate(batch)``: host-side checks of a numpy batch, raising a clear error;
- ``loss(variables, ema, batch, key) -> (loss, metrics)``: a pure function the Trainer jits;
- ``evaluate(variables, batch) -> sums`` and ``summarize(totals) -> metrics``: validation
  metrics as sums over batches, turned into averages once every batch is counted.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from dew.validation import number, positive_int

Variables = Mapping[str, Any]


class Objective:
    """Base class with the protocol's defaults; subclasses override ``loss`` (and ``init`` if
    their variables are not the model's own). ``model``, ``seq_len`` and ``pretrained`` are
    set by subclasses that train a decoder on token ids."""

    ema_decay: float | None = None
    model = None
    seq_len: int = 0
    pretrained: Variables | None = None

    def init(self, key: jax.Array) -> Variables:
        """``pretrained`` when given, else the model's initialisation for ``seq_len`` ids."""
        if self.pretrained is not None:
            return self.pretrained
        return self.model.init(key, jnp.zeros((1, self.seq_len), jnp.int32))

    def reference(self, variables: Variables) -> Variables:
        """The part of the variables the EMA slot keeps (all of them; PPO keeps only the policy subtree)."""
        return variables

    def validate(self, batch: Mapping[str, np.ndarray]) -> None:
        """Check a host batch before it reaches the compiled update."""

    def loss(self, variables: Variables, ema: Variables | None, batch, key) -> tuple[jax.Array, dict]:
        raise NotImplementedError

    def evaluate(self, variables: Variables, batch) -> dict[str, jax.Array]:
        raise NotImplementedError(f"{type(self).__name__} has no validation metrics")

    def summarize(self, totals: Mapping[str, float]) -> dict[str, float]:
        return dict(totals)


def check_ema_decay(ema_decay: float | None) -> float | None:
    if ema_decay is None:
        return None
    return number("ema_decay", ema_decay, above=0, at_most=1, why="None or a number in (0, 1]")


def check_variables(variables: Any, name: str = "pretrained") -> Variables:
    """A full Flax variables mapping with an outer ``params`` collection, or a clear error."""
    if not isinstance(variables, Mapping) or "params" not in variables:
        kind = sorted(variables) if isinstance(variables, Mapping) else type(variables).__name__
        raise ValueError(
            f"{name} must be a full Flax variables mapping with an outer 'params' collection "
            f"(for example lm_state.params), got {kind}"
        )
    return variables


def require_field(batch: Mapping[str, Any], field: str, owner: str) -> np.ndarray:
    if field not in batch:
        raise KeyError(f"{owner} needs batch field {field!r}; the batch has {sorted(batch)}")
    return batch[field]


def check_integer_field(batch: Mapping[str, Any], field: str, shape: tuple[int, ...], owner: str) -> None:
    value = batch[field]
    dtype = np.asarray(value).dtype if not hasattr(value, "dtype") else value.dtype
    if not np.issubdtype(dtype, np.integer):
        raise TypeError(f"{owner}: batch field {field!r} must hold integers, got dtype {dtype}")
    if tuple(np.shape(value)) != shape:
        raise ValueError(f"{owner}: batch field {field!r} must have shape {shape}, got {tuple(np.shape(value))}")


def check_seq_len(model, seq_len) -> int:
    """A positive ``seq_len`` within the model's ``max_seq_len``, or a ValueError naming both."""
    positive_int("seq_len", seq_len)
    max_seq_len = getattr(model, "max_seq_len", None)
    if max_seq_len is not None and seq_len > max_seq_len:
        raise ValueError(f"seq_len={seq_len} exceeds the model's max_seq_len={max_seq_len}")
    return int(seq_len)


def check_vocabulary(ids, model, owner: str, what: str) -> None:
    """Raise naming the first ``what`` (row, pair) of ``ids`` with an id outside the model's vocabulary."""
    vocab = getattr(model, "vocab_size", None)
    ids = np.asarray(ids)
    if vocab is not None and ids.size and (ids.min() < 0 or ids.max() >= vocab):
        index = int(np.argwhere((ids < 0) | (ids >= vocab))[0, 0])
        raise ValueError(f"{owner}: {what} {index} holds an id outside the vocabulary [0, {vocab})")
