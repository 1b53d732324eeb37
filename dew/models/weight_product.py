"""The decoder's weight products: an activation times a 2-D weight, in a chosen operand precision.

:func:`weight_product` is the ``dot_general`` every dense layer of
:class:`~dew.models.transformer.CausalTransformer` (and its tied output layer) runs: operands
cast to the product's dtype (bfloat16 for bfloat16 products over float32 master weights), an
accumulation in float32 (float64 for a float64 model), and gradients that are products of the
same kind, with the operand layouts this CPU's XLA runs fastest (see the comments). A decode
step's few bfloat16 rows go to dew's native kernel (:mod:`dew.models.native_product`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from dew.models import native_product
from dew.models.packed_attention import accumulation


def weight_product(dtype, result_dtype=jnp.float32, kernel_rows: int | None = None):
    """A ``dot_general`` whose operands are cast to ``dtype``, accumulating in float32, returning ``result_dtype``.

    ``kernel_rows``: the most rows a bfloat16 product may have to go to dew's CPU kernel (None:
    :func:`dew.models.native_product.max_rows`, where it is faster than XLA's dot); the kernel
    computes each row alone, so a constant limit makes a row's numbers independent of the rows beside it.

    With bfloat16 weights this is the served-precision product: bfloat16 operands (the
    weights stay as stored; XLA folds the upcast and downcast of the kernel away) with a
    float32 result, which CPUs with AVX512-BF16 or AMX and GPUs run natively. Its
    gradients are the same kind of product (see :func:`_activation_weight_product`).
    """

    def dot_general(lhs, rhs, dimension_numbers, precision=None, **_):
        # Every weight product here contracts an activation's last axis with one axis of a
        # 2-D weight (nn.Dense's kernel, or the tied embedding read as the output layer).
        (lhs_contract, rhs_contract), batch_dims = dimension_numbers
        if batch_dims != ((), ()) or rhs.ndim != 2 or tuple(lhs_contract) != (lhs.ndim - 1,) or len(rhs_contract) != 1:
            raise ValueError(
                "weight_product contracts an activation's last axis with one axis of a 2-D weight, got "
                f"dimension_numbers={dimension_numbers} for shapes {lhs.shape} and {rhs.shape}"
            )
        product = _activation_weight_product(
            jnp.dtype(dtype), int(rhs_contract[0]), jnp.dtype(lhs.dtype), jnp.dtype(rhs.dtype), kernel_rows, lhs, rhs
        )
        return product.astype(result_dtype)

    return dot_general


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _activation_weight_product(dtype, weight_axis, x_dtype, weight_dtype, kernel_rows, x, weight):
    """``x [..., in]`` times a 2-D ``weight`` contracted on ``weight_axis``: float32 out of ``dtype`` operands.

    ``x_dtype`` and ``weight_dtype`` are the operands' own dtypes, which their gradients take.
    """
    return _forward_product(x.astype(dtype), weight.astype(dtype), weight_axis, kernel_rows)


def _contract(lhs, rhs, contracting):
    return jax.lax.dot_general(lhs, rhs, (contracting, ((), ())), preferred_element_type=accumulation(lhs.dtype))


def _forward_product(x, weight, weight_axis: int, kernel_rows: int | None):
    """The forward weight product; a decode step's few bfloat16 rows go to dew's CPU kernel (native_product)."""
    rows = math.prod(x.shape[:-1])
    if x.dtype == weight.dtype == jnp.bfloat16 and native_product.applies(rows, kernel_rows):
        return native_product.product(x, weight, out_in=weight_axis == 1)
    return _contract(x, weight, ((x.ndim - 1,), (weight_axis,)))


def _activation_weight_product_forward(dtype, weight_axis, x_dtype, weight_dtype, kernel_rows, x, weight):
    # The operands are kept as the product read them: half the memory of float32 activations
    # with bfloat16 operands, and no second cast in the backward pass.
    x_low, weight_low = x.astype(dtype), weight.astype(dtype)
    return _forward_product(x_low, weight_low, weight_axis, kernel_rows), (x_low, weight_low)


def _activation_weight_product_backward(dtype, weight_axis, x_dtype, weight_dtype, kernel_rows, saved, grad):
    # Both gradients are products of ``dtype`` operands accumulated in float32, like the forward
    # product. The barrier keeps XLA from fusing the (transposing) operand layout the weight
    # gradient wants into the elementwise code that produced ``grad`` (a SwiGLU's derivative, say):
    # a transposed write inside an elementwise loop ran several times slower than the loop and a
    # separate transpose on this CPU.
    x_low, weight_low = saved
    grad = jax.lax.optimization_barrier(grad.astype(dtype))
    grad_x = _contract(grad, weight_low, ((grad.ndim - 1,), (1 - weight_axis,)))
    rows_x, rows_grad = x_low.reshape(-1, x_low.shape[-1]), grad.reshape(-1, grad.shape[-1])
    # The weight gradient contracts the token axis. Given rows [tokens, features] to contract on
    # axis 0, XLA's CPU dot ran bfloat16 operands at its float32 rate (about 190 against 400
    # GFLOP/s at 256 tokens on this CPU); with the left operand copied transposed first (tokens x
    # features: 78 MB for the tied output layer's gradient at 256 tokens of a 151,936 vocabulary,
    # a few hundred KB elsewhere) it runs at the bfloat16 rate. float32 gained nothing from the copy.
    rows_first, rows_second = (rows_x, rows_grad) if weight_axis == 0 else (rows_grad, rows_x)
    if rows_first.dtype == jnp.bfloat16:  # weight [in, out]: x.T @ grad; [out, in] (tied output): grad.T @ x
        grad_weight = _contract(_transposed(rows_first), rows_second, ((1,), (0,)))
    else:
        grad_weight = _contract(rows_first, rows_second, ((0,), (0,)))
    return grad_x.astype(x_dtype), grad_weight.astype(weight_dtype)


def _transposed(rows: jax.Array) -> jax.Array:
    """``rows.T`` laid out row-major in memory: flattening forces the copy, which XLA would otherwise
    fold into the product as a transposed operand layout."""
    flat = jax.lax.optimization_barrier(rows.T.reshape(-1))
    return flat.reshape(rows.shape[1], rows.shape[0])


_activation_weight_product.defvjp(_activation_weight_product_forward, _activation_weight_product_backward)
