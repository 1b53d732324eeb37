"""Attention over a packed row of ids: every query against the keys its mask allows, and the shared-prompt layout.

:func:`attend` is the plain form: one ``[length, length]`` score block per row and kv head,
masked by segments (causal within each) and softmaxed in float32 (float64 for a float64 model).

A GRPO group's samples share one prompt. :class:`SharedPromptRows` is a row that holds the
prompt once and the samples after it in slots: the first ``prompt`` ids are the prompt but its
last id, then ``continuations`` slots of ``length`` ids, each holding one or more samples back to
back, every one of them the prompt's last id and one sample (``pack(..., layout=...)`` writes it;
its segments and ``prefix_segments`` say who attends to whom). The prompt's queries attend only
within the prompt, and a sample's queries only to the prompt and their own sample, which lies
in one slot, so :func:`attend_shared` computes the prompt's ``prompt x prompt`` block and each
slot's ``length x (prompt + length)`` block instead of the row's ``width x width``: for 8
samples of 48 ids after a 60-id prompt, a ninth of the scores, which dominate the attention's
time on a CPU (their softmax and its gradient are elementwise passes over every score).

A batch's rows need only the slots its samples fill: :meth:`SharedPromptRows.narrower` lists
the layouts a layout's rows may shrink to (all slots but shorter, or half the slots, each holding
several short samples), one for each width, so that a batch's width alone names its layout
(:meth:`SharedPromptRows.with_width`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

SLOT_STEP = 16  # SharedPromptRows.lengths: the slot lengths a batch may take are multiples of this (and the longest)
# SharedPromptRows._shapes also offers rows of half the layout's slots, each longer, where short continuations share a
# slot. Half, not fewer: a slot's scores grow with its square, and on SmolLM2 (8 samples after a 69-id prompt, an
# update in one process) 2 slots of 144 took 11.3 s, 4 of 80 11.8 s, 1 of 288 13.4 s, 2 of 224 21.5 s against
# 8 of 64 20.6 s.


@dataclasses.dataclass(frozen=True)
class SharedPromptRows:
    """A row of one shared prompt and its continuations (module docstring): ``prompt`` ids for the prompt but its
    last id, then ``continuations`` slots of ``length`` ids, each holding one or more continuations."""

    prompt: int
    continuations: int
    length: int

    def __post_init__(self):
        for name in ("prompt", "continuations", "length"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"SharedPromptRows.{name} must be a positive integer, got {value!r}")

    @property
    def width(self) -> int:
        return self.prompt + self.continuations * self.length

    def lengths(self) -> list[int]:
        """The slot lengths this layout's rows may take, longest first: this layout's own and every shorter
        multiple of ``SLOT_STEP``, so the few a run's batches take compile once each."""
        return [self.length, *range(-(-self.length // SLOT_STEP) * SLOT_STEP - SLOT_STEP, 0, -SLOT_STEP)]

    def _shapes(self) -> list[tuple[int, int]]:
        """(slots, length) of the rows this layout's may shrink to, by priority: all its slots, each as long as
        :meth:`lengths` allows; then half its slots, of any multiple of ``SLOT_STEP`` ids, each holding several
        short continuations, where they make narrower rows."""
        half = self.continuations // 2
        longer = range(SLOT_STEP, -(-self.continuations * self.length // max(half, 1)), SLOT_STEP)
        return ([(self.continuations, length) for length in self.lengths()]
                + [(half, length) for length in longer if half])

    def with_width(self, width: int) -> SharedPromptRows:
        """The layout of this one's rows that are ``width`` ids wide: the first of :meth:`_shapes` that fills
        ``width``."""
        for slots, length in self._shapes():
            if self.prompt + slots * length == width:
                return dataclasses.replace(self, continuations=slots, length=length)
        raise ValueError(f"rows of {width} ids are not {self.prompt} prompt ids and {self.continuations} slots of at "
                         f"most {self.length} ids, nor {self.continuations // 2} slots of a multiple of {SLOT_STEP} ids")

    def narrower(self) -> list[SharedPromptRows]:
        """Every layout this one's rows may shrink to (fewer or shorter slots), narrowest first, one for each width
        (the one :meth:`with_width` names): this layout last."""
        widths = {self.prompt + slots * length for slots, length in self._shapes()}
        return [self.with_width(width) for width in sorted(widths)]


def accumulation(dtype) -> jnp.dtype:
    """What products and scores of ``dtype`` accumulate in: float32, or float64 for a float64 model."""
    return jnp.promote_types(dtype, jnp.float32)


def _scores(q, k, spec: str, head_dim: int):
    wide = accumulation(q.dtype)
    return jnp.einsum(spec, q, k.astype(q.dtype), preferred_element_type=wide) / jnp.sqrt(wide.type(head_dim))


def _masked(scores, mask):
    return jnp.where(mask, scores, jnp.finfo(scores.dtype).min)


def attend(q, k, v, mask, dtype, key_spec: str = "bskd", value_spec: str = "bskd"):
    """q [B, T, K, G, D] against keys and values laid out as ``key_spec``/``value_spec`` (``bskd``, or a cache's
    ``bkds``/``bksd``) under ``mask`` [B, T, S]: [B, T, K, G, D] in ``dtype``."""
    # Scores as [B, K, T, G, S]: moving the kv-head axis ahead of the positions moves runs of G x D values, where
    # [B, K, G, T, S] would transpose single values (several times slower in XLA's CPU loops, forward and backward).
    scores = _masked(_scores(q, k, f"btkgd,{key_spec}->bktgs", q.shape[-1]), mask[:, None, :, None])
    weights = jax.nn.softmax(scores, axis=-1).astype(dtype)
    return jnp.einsum(f"bktgs,{value_spec}->btkgd", weights, v.astype(dtype))


def attend_shared(q, k, v, mask, dtype, layout: SharedPromptRows):
    """:func:`attend` for rows in ``layout``: only the blocks its mask can allow (module docstring). ``mask`` is the
    row's full [B, T, T] mask, of which only those blocks are read."""
    batch, width = q.shape[:2]
    if width != layout.width:
        raise ValueError(f"rows of {width} ids do not have the shared-prompt layout's width {layout.width}")
    p, n, length = layout.prompt, layout.continuations, layout.length
    head_dim = q.shape[-1]
    prompt = attend(q[:, :p], k[:, :p], v[:, :p], mask[:, :p, :p], dtype)
    slots = lambda x: x[:, p:].reshape(batch, n, length, *x.shape[2:])  # noqa: E731 -- [B, N, L, ...]
    qs, ks, vs = slots(q), slots(k), slots(v)
    own = mask[:, p:, p:].reshape(batch, n, length, n, length)
    own = jnp.moveaxis(own[:, jnp.arange(n), :, jnp.arange(n), :], 0, 1)  # each slot's block of itself [B, N, L, L]
    to_prompt = mask[:, p:, :p].reshape(batch, n, length, p)
    scores = jnp.concatenate([
        _masked(_scores(qs, k[:, :p], "bntkgd,bskd->bnktgs", head_dim), to_prompt[:, :, None, :, None, :]),
        _masked(_scores(qs, ks, "bntkgd,bnskd->bnktgs", head_dim), own[:, :, None, :, None, :]),
    ], axis=-1)
    weights = jax.nn.softmax(scores, axis=-1).astype(dtype)
    out = (jnp.einsum("bnktgs,bskd->bntkgd", weights[..., :p], v[:, :p].astype(dtype))
           + jnp.einsum("bnktgs,bnskd->bntkgd", weights[..., p:], vs.astype(dtype)))
    return jnp.concatenate([prompt, out.reshape(batch, n * length, *out.shape[3:])], axis=1)
