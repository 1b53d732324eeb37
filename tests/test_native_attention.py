"""A decode step's attention: dew's CPU kernel and XLA's products (dew/models/native_attention.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.models import native
from dew.models.native_attention import decode_attention, xla_attention


@pytest.fixture(scope="module")
def kernel():
    if not native.available():
        pytest.fail(f"the kernels are off on a machine with a compiler: {native.reason()}")


def case(batch, heads, groups, size, blocks, seed=0):
    keys = jax.random.split(jax.random.key(seed), 2 + 2 * len(blocks))
    q = 3 * jax.random.normal(keys[0], (batch, heads, groups, size), jnp.float32)
    key_blocks = tuple(jax.random.normal(keys[2 + i], (batch, heads, size, s), jnp.float32)
                       for i, s in enumerate(blocks))
    value_blocks = tuple(jax.random.normal(keys[2 + len(blocks) + i], (batch, heads, s, size), jnp.float32)
                         for i, s in enumerate(blocks))
    counts = jax.random.randint(keys[1], (batch,), 1, sum(blocks) + 1).at[0].set(1).at[-1].set(sum(blocks))
    return q, key_blocks, value_blocks, counts


def exact(q, keys, values, counts):
    """The attention in float64 over each row's first counts[b] positions."""
    q = np.asarray(q, np.float64)
    k = np.concatenate([np.asarray(block, np.float64) for block in keys], axis=-1)  # [B, H, D, S]
    v = np.concatenate([np.asarray(block, np.float64) for block in values], axis=-2)  # [B, H, S, D]
    out = np.zeros(q.shape)
    for b, count in enumerate(np.asarray(counts)):
        scores = q[b] @ k[b, :, :, :count] / np.sqrt(q.shape[-1])  # [H, G, count]
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        out[b] = (weights / weights.sum(-1, keepdims=True)) @ v[b, :, :count]
    return out


@pytest.mark.parametrize("shape", [
    (5, 8, 2, 128, (64, 64, 128)),  # Qwen3-0.6B's heads over a server's first blocks
    (3, 2, 7, 64, (64,)),  # Qwen2.5-0.5B's 7 query heads per kv head
    (4, 3, 1, 24, (5, 7, 13)),  # sizes off the 16-wide vectors
    (2, 1, 3, 16, (1,)),
])
def test_kernel_and_xla_equal_the_exact_attention(kernel, shape):
    q, keys, values, counts = case(*shape)
    want = exact(q, keys, values, counts)
    # float32 sums of up to 256 terms of magnitude ~3 per score: differences in the order of the sums
    # and in exp's last bits stay below 2**-16 of the values' scale
    for got in (jax.jit(decode_attention)(q, keys, values, counts), xla_attention(q, keys, values, counts, jnp.float32)):
        assert got.shape == q.shape and got.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=2**-16)


def test_a_row_reads_only_its_own_positions(kernel):
    # what lies past a row's count (another request's leftovers, NaN) does not reach its output
    q, keys, values, counts = case(3, 2, 2, 32, (16, 16))
    counts = jnp.array([1, 9, 17], jnp.int32)
    clean = decode_attention(q, keys, values, counts)
    positions = jnp.arange(32)
    poisoned_keys = tuple(jnp.where(positions[start:start + 16] >= counts[:, None, None, None], jnp.nan, block)
                          for start, block in zip((0, 16), keys))
    poisoned_values = tuple(jnp.where(positions[start:start + 16, None] >= counts[:, None, None, None], jnp.nan, block)
                            for start, block in zip((0, 16), values))
    np.testing.assert_array_equal(np.asarray(decode_attention(q, poisoned_keys, poisoned_values, counts)),
                                  np.asarray(clean))


def test_large_score_gaps_give_exact_zeros_and_ones(kernel):
    # a score 200 above the rest takes all the weight; exp underflows to 0 for the rest, as in float32
    q = jnp.zeros((1, 1, 1, 16), jnp.float32).at[..., 0].set(1.0)
    k = jnp.zeros((1, 1, 16, 20), jnp.float32).at[0, 0, 0, 7].set(800.0)  # score 800 / 4 = 200
    v = jnp.arange(20 * 16, dtype=jnp.float32).reshape(1, 1, 20, 16)
    got = decode_attention(q, (k,), (v,), jnp.array([20], jnp.int32))
    np.testing.assert_array_equal(np.asarray(got)[0, 0, 0], np.asarray(v)[0, 0, 7])


def test_mismatched_blocks_are_refused_by_name():
    q, keys, values, counts = case(2, 1, 1, 16, (8,))
    with pytest.raises(ValueError, match="as many value blocks as key blocks, got 1 and 0"):
        decode_attention(q, keys, (), counts)
