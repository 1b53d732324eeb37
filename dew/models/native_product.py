"""The CPU's bfloat16 weight product for few rows: a native XLA FFI kernel, built on first use.

A decode step multiplies a handful of rows by every weight of the model, so its time is
the time to read the weights. XLA's CPU dot reads bfloat16 weights at about 15 GB/s at
2 to 8 rows and converts every weight to float32 first at 1 row (8 to 10 times slower),
so serving a 0.6B model in bfloat16 was no faster than in float32. ``native_product.cc``
reads the weights once for all the rows: on CPUs with AVX512-BF16 it multiplies bfloat16
pairs (``vdpbf16ps``) for up to 32 rows, elsewhere it widens each weight to float32 for up
to 2 rows (in AVX-512 vectors, or AVX2 ones on CPUs without AVX-512: on a 2-core AMD EPYC a
decode step of SmolLM2-135M at one request took 101 ms with scalar widening, 45 ms on XLA's
dot and 43 ms with AVX2 vectors). The weight products of a 0.6B decode step at 1 row read 31 GB/s on this
machine's 2 cores, whose plain streaming read reaches 29 to 33 GB/s (docs/benchmarks.md).

It lives in dew's native library (:mod:`dew.models.native`: how it is built, where, and
how to turn it off); where the library is off, the products stay XLA's (the same results up
to the order of the sums). On a GPU, :func:`product` lowers to XLA's dot.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dew.models import native

TARGET = "dew_bf16_product"
# Rows up to which the kernel serves, as measured on a 2-core Intel Xeon with AMX (12-06, jaxlib 0.10.2, whose XLA
# runs bfloat16 dots through YNNPACK): a decode layer's weight products at SmolLM2-135M's shape took 284-318 us
# against XLA's 384-399 at 1 row, 375-384 against 508-531 at 2, but 558-605 against 451-504 at 4 and 2 to 4 times
# XLA's time at 8 to 32 rows; at Qwen3-0.6B's shape 1.07 against 1.93 ms at 1 row, 1.43 against 2.45 at 2, even at
# 4, then 3.3 against 2.0 at 8 and 9.9 against 3.0 at 32.
# Earlier jaxlibs' XLA read bfloat16 weights at about 15 GB/s at 2 to 8 rows, when the kernel won up to 32 rows.
# Prefill's packed rows (up to 256) stay with XLA's dot.
PAIRED_ROWS = 2
WIDENED_ROWS = 2
# A batch-invariant Server's decode products go to the kernel up to this many rows whatever is faster: the kernel
# computes each row alone, so a request's numbers do not depend on how many rows its steps have.
INVARIANT_ROWS = 32


def max_rows() -> int:
    """The most rows a product may have to go to the kernel: 32 where it multiplies bfloat16 pairs, else 2
    (0 where the kernel is off)."""
    if not native.available():
        return 0
    return PAIRED_ROWS if native.paired_products() else WIDENED_ROWS


def applies(rows: int, limit: int | None = None) -> bool:
    """Whether a product of ``rows`` rows (with a weight in either layout) goes to the kernel: up to ``limit`` rows
    where the kernel is built (None: :func:`max_rows`, where it is the faster)."""
    if limit is None:
        return rows <= max_rows()
    return native.available() and rows <= limit


def product(x: jax.Array, weight: jax.Array, out_in: bool) -> jax.Array:
    """``x [..., in]`` (bfloat16) times a bfloat16 ``weight`` ([in, out], or [out, in] with ``out_in``): float32.

    On the CPU the native kernel (XLA's dot where it is off); on other platforms XLA's dot.
    """
    if x.dtype != jnp.bfloat16 or weight.dtype != jnp.bfloat16:
        raise TypeError(f"native_product takes bfloat16 operands, got x {x.dtype} and weight {weight.dtype}")
    axis = 1 if out_in else 0
    if weight.ndim != 2 or x.ndim < 1 or weight.shape[axis] != x.shape[-1]:
        layout = "[out, in]" if out_in else "[in, out]"
        raise ValueError(f"native_product multiplies x [..., in] by a {layout} weight; got x {x.shape} and "
                         f"weight {weight.shape}")
    features = weight.shape[1 - axis]

    def xla(x, weight):
        return jax.lax.dot_general(x, weight, (((x.ndim - 1,), (axis,)), ((), ())),
                                   preferred_element_type=jnp.float32)

    def kernel(x, weight):
        result = jax.ShapeDtypeStruct((*x.shape[:-1], features), jnp.float32)
        return jax.ffi.ffi_call(TARGET, result, vmap_method="sequential")(x, weight, out_in=out_in)

    if not native.available():
        return xla(x, weight)
    return jax.lax.platform_dependent(x, weight, cpu=kernel, default=xla)
