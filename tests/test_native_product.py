"""dew's CPU kernel for bfloat16 weight products of few rows (dew/models/native_product.py)."""

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.models import native, native_product
from dew.models.weight_product import weight_product


@pytest.fixture(scope="module")
def kernel():
    if not native.available():
        pytest.fail(f"the kernels are off on a machine with a compiler: {native.reason()}")


def xla(x, weight, out_in):
    return jax.lax.dot_general(x, weight, (((x.ndim - 1,), (1 if out_in else 0,)), ((), ())),
                               preferred_element_type=jnp.float32)


@pytest.mark.parametrize("out_in", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 8, 9, 16, 33])
@pytest.mark.parametrize("features", [(1024, 3072), (96, 200), (130, 33), (129, 70)])
def test_product_equals_xla_bfloat16_dot(kernel, out_in, rows, features):
    # The products of two bfloat16 values are exact in float32: the kernel and XLA differ only in
    # the order of the sums. Sizes off the 16-, 32- and 64-wide paths check the remainders; 9 to 33
    # rows take the paired build's panel kernel (in_out), and 33 more than one group of 32; an odd
    # fan-in (129) takes the widening kernels, which CPUs without AVX512-BF16 run.
    fan_in, fan_out = features
    keys = jax.random.split(jax.random.key(rows), 2)
    x = jax.random.normal(keys[0], (rows, fan_in), jnp.bfloat16)
    shape = (fan_out, fan_in) if out_in else (fan_in, fan_out)
    weight = jax.random.normal(keys[1], shape, jnp.bfloat16)
    got = jax.jit(native_product.product, static_argnames="out_in")(x, weight, out_in=out_in)
    want = xla(x, weight, out_in)
    assert got.shape == (rows, fan_out) and got.dtype == jnp.float32
    # the sum of the terms' magnitudes bounds what a different order of the float32 sums can change
    magnitude = float(xla(jnp.abs(x), jnp.abs(weight), out_in).max())
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=magnitude * 2**-20)


def test_batched_rows_and_vmap(kernel):
    x = jax.random.normal(jax.random.key(0), (2, 1, 64), jnp.bfloat16)  # [batch, length, in]: 2 rows
    weight = jax.random.normal(jax.random.key(1), (64, 48), jnp.bfloat16)
    got = native_product.product(x, weight, out_in=False)
    np.testing.assert_allclose(np.asarray(got), np.asarray(xla(x, weight, False)), atol=1e-4)
    mapped = jax.vmap(lambda row: native_product.product(row, weight, out_in=False))(x)
    np.testing.assert_allclose(np.asarray(mapped), np.asarray(got), atol=1e-5)


def test_weight_product_routes_few_bfloat16_rows_and_keeps_its_gradients(kernel, monkeypatch):
    product = weight_product(jnp.bfloat16)
    dims = (((1,), (0,)), ((), ()))
    x = jax.random.normal(jax.random.key(0), (2, 64), jnp.float32)
    weight = jax.random.normal(jax.random.key(1), (64, 32), jnp.bfloat16)
    assert "dew_bf16_product" in jax.jit(lambda x, w: product(x, w, dims)).lower(x, weight).as_text()
    many = jnp.ones((native_product.max_rows() + 1, 64), jnp.float32)  # beyond the kernel's rows: XLA's dot
    assert "dew_bf16_product" not in jax.jit(lambda x, w: product(x, w, dims)).lower(many, weight).as_text()

    def loss(x, weight):
        return jnp.sum(product(x, weight, dims) ** 2)

    got = jax.jit(jax.value_and_grad(loss, (0, 1)))(x, weight)
    monkeypatch.setattr(native_product, "applies", lambda rows, limit=None: False)  # the same product through XLA
    want = jax.jit(jax.value_and_grad(loss, (0, 1)))(x, weight)
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-6)
    for a, b in zip(got[1], want[1], strict=True):  # XLA backward products; the forward differs in its sums
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2**-7, atol=1e-6)


def test_products_from_two_threads_at_once(kernel):
    # Two lanes decode at once: a product that finds the helper threads taken runs on its caller alone.
    product = jax.jit(native_product.product, static_argnames="out_in")
    inputs = [(jax.random.normal(jax.random.key(i), (2, 256), jnp.bfloat16),
               jax.random.normal(jax.random.key(10 + i), (256, 4096), jnp.bfloat16)) for i in range(2)]
    alone = [np.asarray(product(x, w, out_in=False)) for x, w in inputs]

    def repeat(index):
        x, w = inputs[index]
        return [np.asarray(product(x, w, out_in=False)) for _ in range(30)]

    with ThreadPoolExecutor(2) as pool:
        together = list(pool.map(repeat, range(2)))
    for index in range(2):
        for result in together[index]:
            np.testing.assert_array_equal(result, alone[index])


def test_bad_operands_are_refused_by_name():
    x, weight = jnp.ones((2, 32), jnp.bfloat16), jnp.ones((32, 8), jnp.bfloat16)
    with pytest.raises(TypeError, match="bfloat16 operands, got x float32 and weight bfloat16"):
        native_product.product(x.astype(jnp.float32), weight, out_in=False)
    with pytest.raises(ValueError, match=r"by a \[out, in\] weight; got x \(2, 32\) and weight \(32, 8\)"):
        native_product.product(x, weight, out_in=True)
    with pytest.raises(ValueError, match=r"by a \[in, out\] weight; got x \(2, 32\) and weight \(8,\)"):
        native_product.product(x, jnp.ones((8,), jnp.bfloat16), out_in=False)


def run_without_kernel(tmp_path, **env):
    script = (
        "import jax, jax.numpy as jnp\n"
        "from dew.models import native, native_product\n"
        "x = jnp.ones((2, 32), jnp.bfloat16); w = jnp.ones((32, 8), jnp.bfloat16)\n"
        "print(native.available(), native.reason(), float(native_product.product(x, w, False)[0, 0]))\n"
    )
    environment = {**os.environ, "DEW_NATIVE_HOME": str(tmp_path), **env}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=environment, check=True)
    return done.stdout.strip(), done.stderr


def test_a_failed_build_says_why_and_leaves_the_products_to_xla(tmp_path):
    out, err = run_without_kernel(tmp_path, CXX="/bin/false")
    assert out.startswith("False the kernels did not build or load: /bin/false failed (1)") and out.endswith(" 32.0")
    assert "XLA's operations serve instead" in err


def test_dew_native_0_turns_it_off(tmp_path):
    out, _ = run_without_kernel(tmp_path, DEW_NATIVE="0")
    assert out == "False DEW_NATIVE=0 32.0"
    assert not list(tmp_path.iterdir())  # nothing built
