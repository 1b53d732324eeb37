"""A decode step's attention: a native XLA FFI kernel on the CPU, XLA's batched products elsewhere.

A decode step's query (one position per row) attends over the row's cache. XLA runs that as
two batched products per layer over every position of the cache blocks the step reads, so
each row pays for the longest row, and reads the float32 cache at 7 to 11 GB/s on this
machine. ``native_attention.cc`` reads each row's keys and values once, only up to the row's
own length, with the softmax in between. The 28 layers' attention of 32 rows at Qwen3-0.6B's
heads on this machine: 24 to 30 ms against XLA's 61 at 65 to 128 positions, 121 against 336 ms
at 257 to 384 (docs/benchmarks.md).

It lives in dew's native library (:mod:`dew.models.native`); where the library is off, or the
query or cache is not float32, or on a GPU, the XLA products serve (the same results up to
the order of the sums).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dew.models import native

TARGET = "dew_decode_attention"


def decode_attention(q: jax.Array, keys, values, counts: jax.Array, dtype=jnp.float32) -> jax.Array:
    """``q [B, H, G, D]`` attending over positions ``[0, counts[b])`` of the cache blocks: ``[B, H, G, D]``.

    keys: blocks [B, H, D, S_i] (dew's transposed keys), values: blocks [B, H, S_i, D], both in
    position order; ``counts`` [B] int32, each at least 1 and at most the blocks' total. Scores
    and the softmax are float32; ``dtype`` is the model's compute dtype: the softmax weights and
    the values are cast to it for their product, whose dtype the result has.
    """
    keys, values = tuple(keys), tuple(values)
    if len(keys) != len(values) or not keys:
        raise ValueError(f"decode_attention takes as many value blocks as key blocks, got {len(keys)} and "
                         f"{len(values)}")
    result = jax.ShapeDtypeStruct(q.shape, dtype)

    def xla(q, counts, *blocks):
        return xla_attention(q, blocks[:len(blocks) // 2], blocks[len(blocks) // 2:], counts, dtype)

    def kernel(q, counts, *blocks):
        return jax.ffi.ffi_call(TARGET, result, vmap_method="sequential")(q, counts, *blocks)

    counts = counts.astype(jnp.int32)
    native_dtypes = {q.dtype, jnp.dtype(dtype), *(block.dtype for block in (*keys, *values))} == {jnp.dtype("float32")}
    if not (native_dtypes and native.available()):
        return xla(q, counts, *keys, *values)
    return jax.lax.platform_dependent(q, counts, *keys, *values, cpu=kernel, default=xla)


def xla_attention(q: jax.Array, keys, values, counts: jax.Array, dtype) -> jax.Array:
    """:func:`decode_attention` as XLA's batched products, over every position of the blocks, masked."""
    # [B, H, G, D] @ [B, H, D, S] per block: XLA's CPU batched dot runs this plain form several
    # times faster than one that has to transpose an operand.
    scores = jnp.concatenate([jnp.matmul(q, block.astype(q.dtype), preferred_element_type=jnp.float32)
                              for block in keys], axis=-1)
    scores = scores / jnp.sqrt(jnp.float32(q.shape[-1]))
    visible = jnp.arange(scores.shape[-1])[None, :] < counts[:, None]
    scores = jnp.where(visible[:, None, None, :], scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(dtype)
    out, start = 0, 0
    for block in values:
        out = out + jnp.matmul(weights[..., start:start + block.shape[2]], block.astype(dtype))
        start += block.shape[2]
    return out
