"""Token sampling: ``Sampling`` controls and the sampler that records both likelihoods.

Every draw returns the sampled id with two log-probabilities:

- ``old_log_probs``: the raw model policy, ``log_softmax(logits)[id]``, before any
  temperature or filter (what GRPO's ratio compares against);
- ``behavior_log_probs``: the distribution the id was actually drawn from, after
  temperature and the filters (0 for greedy, whose choice is certain).

Filters apply in this order, each to the renormalised result of the one before:
temperature, then top-k (``jax.lax.top_k``, a partial selection: the vocabulary is
never fully sorted), then top-p (over the top-k candidates when top-k is set, else over
the sorted vocabulary), then min-p (drop tokens whose probability is below ``min_p``
times the most likely token's). With top-k set a draw can also return its support: the
ids kept after every filter, ``[rows, top_k]`` with -1 for ids a later filter removed.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from dew.validation import integer, number, positive_int

NEG_INF = -jnp.inf


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sampling:
    """How to draw tokens. ``temperature=0`` is greedy; ``eos_id`` ends a response (one id or a tuple)."""

    eos_id: int | tuple[int, ...] | None = None
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None

    def __post_init__(self):
        number("temperature", self.temperature, at_least=0)
        if self.top_k is not None:
            positive_int("top_k", self.top_k, why="or None")
        if self.top_p is not None:
            number("top_p", self.top_p, above=0, at_most=1, why="or None")
        if self.min_p is not None:
            number("min_p", self.min_p, at_least=0, below=1, why="or None")
        for eos in self.eos_ids:
            integer("eos_id", eos, at_least=0, why="None, one id or a tuple of them")

    @property
    def eos_ids(self) -> tuple[int, ...]:
        if self.eos_id is None:
            return ()
        return tuple(self.eos_id) if isinstance(self.eos_id, (tuple, list)) else (self.eos_id,)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def transforms(self) -> bool:
        """Whether the behaviour distribution differs from the raw policy."""
        return self.temperature not in (0, 1) or any(v is not None for v in (self.top_k, self.top_p, self.min_p))


@struct.dataclass
class Sample:
    """One sampled id per row: ids [rows] int32, old/behavior log-probs [rows] float32, support or None."""

    ids: jax.Array
    old_log_probs: jax.Array
    behavior_log_probs: jax.Array
    support: jax.Array | None = None


def filtered_logits(logits: jax.Array, sampling: Sampling) -> tuple[jax.Array, jax.Array | None]:
    """Temperature-scaled logits with filtered-out ids at -inf, and the top-k support ids if top-k is set.

    logits: [rows, vocab] float32 -> ([rows, vocab], [rows, top_k] int32 or None)
    """
    scaled = logits.astype(jnp.float32) / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < logits.shape[-1]:
        kept_values, indices, support = top_k_candidates(logits, sampling)
        rows = jnp.arange(logits.shape[0])[:, None]
        return jnp.full_like(scaled, NEG_INF).at[rows, indices].set(kept_values), support
    if sampling.top_p is not None:
        order = jnp.argsort(-scaled, axis=-1)
        values = jnp.take_along_axis(scaled, order, axis=-1)
        keep = _filter_sorted(values, sampling)
        rows = jnp.arange(logits.shape[0])[:, None]
        mask = jnp.zeros(scaled.shape, bool).at[rows, order].set(keep)
        return jnp.where(mask, scaled, NEG_INF), None
    if sampling.min_p is not None:
        return jnp.where(_min_p_keep(scaled, sampling.min_p), scaled, NEG_INF), None
    return scaled, None


def top_k_candidates(logits: jax.Array, sampling: Sampling) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The top-k candidates after temperature and the later filters.

    Returns their scaled logits (-inf where top-p or min-p removed one), their ids and the
    support (ids, -1 where removed), each [rows, top_k], sorted by descending logit.
    """
    values, indices = jax.lax.top_k(logits.astype(jnp.float32) / sampling.temperature, sampling.top_k)
    keep = _filter_sorted(values, sampling)
    return jnp.where(keep, values, NEG_INF), indices, jnp.where(keep, indices, -1).astype(jnp.int32)


def _filter_sorted(values: jax.Array, sampling: Sampling) -> jax.Array:
    """Which of the descending-sorted candidate logits survive top-p and min-p: [rows, n] bool."""
    keep = jnp.ones(values.shape, bool)
    if sampling.top_p is not None:
        probs = jax.nn.softmax(values, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each candidate
        keep &= before < sampling.top_p  # keep the smallest prefix whose mass reaches top_p
    if sampling.min_p is not None:
        masked = jnp.where(keep, values, NEG_INF)
        keep &= _min_p_keep(masked, sampling.min_p)
    return keep


def _min_p_keep(scaled: jax.Array, min_p: float) -> jax.Array:
    probs = jax.nn.softmax(scaled, axis=-1)
    return probs >= min_p * probs.max(axis=-1, keepdims=True)


CDF_BLOCK = 256  # vocabulary entries per block of categorical's two-level search


def categorical(key: jax.Array, logits: jax.Array) -> jax.Array:
    """One id per row of ``logits`` [..., n] (-inf where an id is filtered out), drawn with probability
    ``softmax(logits)``: [...] int32.

    The inverse of the cumulative distribution at one uniform number per row, found in two
    levels (the block of :data:`CDF_BLOCK` ids, then the id in it), where
    ``jax.random.categorical`` draws a Gumbel number for every id: at a 49,152-id vocabulary
    and 64 rows that was 87 ms of a 180 ms decode step on this CPU, against 2 ms. An id of
    probability 0 is never drawn (a number rounded past the last block's mass falls on the
    last id with mass).
    """
    shape, n = logits.shape[:-1], logits.shape[-1]
    flat = logits.reshape(-1, n).astype(jnp.float32)
    rows = flat.shape[0]
    weights = jnp.exp(flat - jnp.max(flat, axis=-1, keepdims=True))
    weights = jnp.pad(weights, ((0, 0), (0, -n % CDF_BLOCK))).reshape(rows, -1, CDF_BLOCK)
    mass = weights.sum(-1)  # [rows, blocks]
    total = jnp.cumsum(mass, axis=-1)
    u = jax.random.uniform(key, (rows,), jnp.float32) * total[:, -1]
    block = _first_above(total, u, mass > 0)
    inside = jnp.take_along_axis(weights, block[:, None, None], axis=1)[:, 0]  # [rows, CDF_BLOCK]
    before = jnp.take_along_axis(total - mass, block[:, None], axis=-1)[:, 0]
    index = _first_above(jnp.cumsum(inside, axis=-1), u - before, inside > 0)
    return (block * CDF_BLOCK + index).astype(jnp.int32).reshape(shape)


def _first_above(cumulative: jax.Array, u: jax.Array, positive: jax.Array) -> jax.Array:
    """Per row, the first index whose cumulative mass exceeds ``u``; where rounding leaves none, the last index
    with mass."""
    above = cumulative > u[:, None]
    last = positive.shape[-1] - 1 - jnp.argmax(positive[:, ::-1], axis=-1)
    return jnp.where(above.any(-1), jnp.argmax(above & positive, axis=-1), last)


def sample(logits: jax.Array, key: jax.Array, sampling: Sampling) -> Sample:
    """Draw one id per row of ``logits`` [rows, vocab] and record both likelihoods.

    With top-k the draw happens among the k candidates only (k random numbers per row
    instead of one per vocabulary entry), which is most of a decode step's sampling cost.
    """
    logits = logits.astype(jnp.float32)
    support = None
    if sampling.greedy:
        ids = jnp.argmax(logits, axis=-1)
        behavior = jnp.zeros(ids.shape, jnp.float32)
        support = ids[:, None].astype(jnp.int32) if sampling.top_k is not None else None
    elif sampling.top_k is not None and sampling.top_k < logits.shape[-1]:
        kept, indices, support = top_k_candidates(logits, sampling)
        choice = categorical(key, kept)
        ids = jnp.take_along_axis(indices, choice[:, None], axis=-1)[:, 0]
        behavior = jnp.take_along_axis(jax.nn.log_softmax(kept, axis=-1), choice[:, None], axis=-1)[:, 0]
    else:
        filtered, _ = filtered_logits(logits, sampling)
        ids = categorical(key, filtered)
        behavior = jnp.take_along_axis(jax.nn.log_softmax(filtered, axis=-1), ids[:, None], axis=-1)[:, 0]
    return Sample(ids.astype(jnp.int32), log_softmax_at(logits, ids), behavior, support)


def log_softmax_at(logits: jax.Array, ids: jax.Array) -> jax.Array:
    """``log_softmax(logits)[row, ids[row]]`` for logits [rows, vocab], in the same operations as
    ``jax.nn.log_softmax`` but without its [rows, vocab] result: XLA's CPU fusion of the max and the
    shift wrote that array on one thread (11 ms of a 32-row decode step at a 152k vocabulary)."""
    top = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    normalizer = jnp.log(jnp.sum(jnp.exp(logits - top), axis=-1))
    return (jnp.take_along_axis(logits, ids[:, None], axis=-1) - top)[:, 0] - normalizer


def controls(sampling: Sampling) -> tuple[float, float, float, float]:
    """A Sampling's filters as one row of numbers for :func:`sample_controlled`: temperature,
    top-k (0: none), top-p (1: none), min-p (0: none)."""
    return (float(sampling.temperature), float(sampling.top_k or 0),
            1.0 if sampling.top_p is None else float(sampling.top_p), float(sampling.min_p or 0.0))


def sample_controlled(logits: jax.Array, key: jax.Array, row: jax.Array) -> Sample:
    """One draw from one row of ``logits`` [vocab] under the controls ``row`` [4] (see :func:`controls`).

    The same distribution :func:`sample` draws from for that Sampling (temperature, then
    top-k, then top-p over what is left, renormalised, then min-p), with the controls as
    traced values, so rows of one compiled step each follow their own request's Sampling.
    It sorts the whole vocabulary (where ``sample`` partially selects k candidates), so a
    server uses it only for steps whose requests do not all share the served Sampling.
    Returns a Sample of one row.
    """
    temperature, top_k, top_p, min_p = row[0], row[1].astype(jnp.int32), row[2], row[3]
    logits = logits.astype(jnp.float32)
    greedy = temperature == 0
    scaled = logits / jnp.where(greedy, 1.0, temperature)
    order = jnp.argsort(-scaled)
    values = scaled[order]
    rank = jnp.arange(values.shape[0])
    keep = rank < jnp.where(top_k > 0, top_k, values.shape[0])
    probs = jax.nn.softmax(jnp.where(keep, values, NEG_INF))
    keep &= (jnp.cumsum(probs) - probs < top_p) | (top_p >= 1)
    probs = jax.nn.softmax(jnp.where(keep, values, NEG_INF))
    keep &= probs >= min_p * probs.max()
    kept = jnp.where(keep, values, NEG_INF)
    choice = jnp.where(greedy, 0, categorical(key, kept))
    token = order[choice]
    behavior = jnp.where(greedy, 0.0, jax.nn.log_softmax(kept)[choice])
    old = jax.nn.log_softmax(logits)[token]
    return Sample(token[None].astype(jnp.int32), old[None], behavior[None], None)
