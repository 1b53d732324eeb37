"""Batched generation with a KV cache: ``TextGeneration`` and its ``Generation`` result.

``TextGeneration(model, variables)`` is the inference policy RL collectors bind to the
trainer's weights (``bind(snapshot)``). A call takes the exact context ids of each row,
a response budget, a key and a :class:`~dew.sampling.Sampling`, and returns every
sampled id with its raw (``old_log_probs``) and behaviour log-probability.

The padded batch is prefilled once: each row's real ids are packed at the start of its
cache row (``lengths``), so contexts of different valid lengths share one compiled
shape (widths are rounded up to a power of two). Decoding then feeds one id per row;
a row that sampled EOS stops: its later steps write nothing to its cache and emit
nothing. Row ``r`` draws with ``fold_in(key, r)``, token ``t`` with
``fold_in(that, t)``, so a row's tokens do not depend on the other rows' randomness.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dew.models.transformer import init_cache
from dew.sampling import Sampling, sample, sample_controlled
from dew.validation import positive_int


@struct.dataclass
class Generation:
    """Sampled responses: ids, old_log_probs, behavior_log_probs [rows, budget] (0 past each row's end),
    lengths [rows] (ids emitted, EOS included), eos [rows] (EOS ended the row)."""

    ids: jax.Array
    old_log_probs: jax.Array
    behavior_log_probs: jax.Array
    lengths: jax.Array
    eos: jax.Array

    def response(self, row: int) -> list[int]:
        return np.asarray(self.ids[row, : int(self.lengths[row])]).tolist()


def bucket(width: int, least: int = 8) -> int:
    """The power of two at or above ``width`` (at least ``least``), so shapes and compilations repeat."""
    size = least
    while size < width:
        size *= 2
    return size


def pack_contexts(contexts: Sequence[Sequence[int]], vocab_size: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Contexts as ``[rows, bucket]`` int32 ids packed at the start of each row, and their lengths."""
    if len(contexts) == 0:
        raise ValueError("generation needs at least one context")
    lengths = np.array([len(c) for c in contexts], np.int32)
    if (lengths == 0).any():
        raise ValueError(f"context {int(np.argmin(lengths))} is empty; every row needs at least one id")
    tokens = np.zeros((len(contexts), bucket(int(lengths.max()))), np.int32)
    for row, context in enumerate(contexts):
        ids = np.asarray(context, np.int64)
        if vocab_size is not None and (ids.min() < 0 or ids.max() >= vocab_size):
            raise ValueError(f"context {row} holds an id outside the vocabulary [0, {vocab_size})")
        tokens[row, : len(ids)] = ids
    return tokens, lengths


def row_keys(key: jax.Array, rows: int) -> jax.Array:
    return jax.vmap(lambda r: jax.random.fold_in(key, r))(jnp.arange(rows))


def sample_rows(logits: jax.Array, keys: jax.Array, steps: jax.Array, sampling: Sampling):
    """One draw per row, row r with ``fold_in(keys[r], steps[r])`` (``steps`` a scalar or [rows])."""
    def one(row_logits, key, step):
        return sample(row_logits[None], jax.random.fold_in(key, step), sampling)

    steps = jnp.broadcast_to(steps, logits.shape[:1])
    drawn = jax.vmap(one)(logits, keys, steps)
    return jax.tree.map(lambda x: x[:, 0], drawn)


def sample_controlled_rows(logits: jax.Array, keys: jax.Array, steps: jax.Array, controls: jax.Array):
    """As :func:`sample_rows`, each row under its own controls [rows, 4] (``dew.sampling.controls``)."""
    def one(row_logits, key, step, row):
        return sample_controlled(row_logits, jax.random.fold_in(key, step), row)

    drawn = jax.vmap(one)(logits, keys, jnp.broadcast_to(steps, logits.shape[:1]), controls)
    return jax.tree.map(lambda x: x[:, 0], drawn)


@partial(jax.jit, static_argnames=("model", "budget", "sampling"))
def _generate(model, variables, tokens, lengths, keys, budget: int, sampling: Sampling) -> Generation:
    rows = tokens.shape[0]
    cache = init_cache(model, rows, tokens.shape[1] + budget)
    logits, cache = model.apply(variables, tokens, cache=cache, lengths=lengths, logits_at=(lengths - 1)[:, None])
    last = logits[:, 0]
    eos_ids = jnp.asarray(sampling.eos_ids or (-1,), jnp.int32)

    def step(carry, t):
        cache, last, done = carry
        drawn = sample_rows(last, keys, t, sampling)
        emit = ~done
        ended = emit & jnp.isin(drawn.ids, eos_ids)
        feed = emit & ~ended
        logits, cache = model.apply(variables, drawn.ids[:, None], cache=cache, lengths=feed.astype(jnp.int32))
        last = jnp.where(feed[:, None], logits[:, 0], last)
        out = (
            jnp.where(emit, drawn.ids, 0),
            jnp.where(emit, drawn.old_log_probs, 0.0),
            jnp.where(emit, drawn.behavior_log_probs, 0.0),
            emit,
            ended,
        )
        return (cache, last, done | ended), out

    _, (ids, old, behavior, emitted, ended) = jax.lax.scan(
        step, (cache, last, jnp.zeros(rows, bool)), jnp.arange(budget)
    )
    return Generation(
        ids=ids.T, old_log_probs=old.T, behavior_log_probs=behavior.T,
        lengths=emitted.sum(0).astype(jnp.int32), eos=ended.any(0),
    )


class TextGeneration:
    """A decoder and its variables as a sampling policy (see the module docstring)."""

    def __init__(self, model, variables=None):
        self.model = model
        self.variables = variables

    def bind(self, variables) -> "TextGeneration":
        """The same policy over ``variables`` (a full Flax variables mapping)."""
        return TextGeneration(self.model, variables)

    def __call__(
        self, contexts: Sequence[Sequence[int]], max_new_tokens: int, key: jax.Array, sampling: Sampling
    ) -> Generation:
        if self.variables is None:
            raise ValueError("TextGeneration has no variables; call bind(variables) first")
        positive_int("max_new_tokens", max_new_tokens)
        tokens, lengths = pack_contexts(contexts, getattr(self.model, "vocab_size", None))
        keys = row_keys(key, len(lengths))
        return _generate(self.model, self.variables, tokens, lengths, keys, max_new_tokens, sampling)
