"""A causal decoder covering the Llama, Qwen2 and Qwen3 families (flax.linen).

One module serves training and generation:

- ``model.apply(variables, tokens, segment_ids=..., positions=...)`` is the full
  forward pass over a ``[batch, length]`` block of ids and returns float32 logits
  ``[batch, length, vocab]``. ``segment_ids`` (0 marks padding) and ``positions`` keep
  attention and rotary positions inside each document when several are packed into
  one row, so a packed row gives the same logits as each document alone.
  ``prefix_segments`` [batch, length] (0 for none) names, for each id, a segment of its row
  that it also attends to in full: several continuations of one shared prompt, each its
  own segment, read the prompt's segment as their prefix (positions continuing it), so the
  prompt is computed once for all of them; ``layout`` (a
  :class:`~dew.models.packed_attention.SharedPromptRows`) says the rows hold one prompt and
  its continuations in fixed slots, so attention computes only the blocks the mask allows
  (``pack(..., layout=...)`` writes such rows).
- ``model.apply(variables, tokens, cache=cache, lengths=...)`` is the decode path: it
  appends ``lengths[b]`` valid ids of each row to a :class:`KVCache` (prefill is a
  call with the whole prompt, decoding a call with one id per row) and returns
  ``(logits, cache)``. Ids past a row's valid count are neither attended to nor
  written, so a row given ``lengths=0`` keeps its cache unchanged.
- ``model.apply(variables, tokens, segment_ids=..., positions=..., cache=cache, rows=...)``
  is a packed prefill: the ids of several requests share one row of ``tokens`` as in the
  full forward pass (each attends only within its segment, not to the cache), and each
  id is written at ``positions`` of cache row ``rows`` (ids with segment 0 are padding
  and not written); the returned cache's lengths grow by the ids written to each row.
  The rows written start empty: a request's prompt is prefilled without padding it to
  the longest prompt beside it, and without computing the rows that have no prompt.
- ``logits_at=[batch, n]`` (in any of these forms) returns the logits of those
  positions only, ``[batch, n, vocab]``: a prefill needs the last prompt position's, and
  the output product over the others would be a quarter of its work on a small model.
- ``hidden=True`` (packed, no cache) returns the final normed hidden states
  ``[batch, length, emb_features]`` instead of logits, for a head of one's own (a critic).

Options for the families: grouped-query attention (``num_kv_heads``), an explicit
``head_dim``, RoPE theta, RMSNorm epsilon, SwiGLU or GELU MLP, Qwen3's QK-norm,
tied or untied embeddings, attention bias (Qwen2) and a final-logit softcap.
``matmul_dtype=jnp.bfloat16`` runs the weight products on bfloat16 operands with
float32 accumulation, in the forward pass and in both of their gradients, while norms,
rotary, attention and the residual stream stay in the compute dtype: the Server serves
that way in bfloat16, and training with float32 master weights and bfloat16 compute
(``matmul_dtype`` on a float32 model) takes the same products.
``remat="full"`` or ``"dots"`` recomputes each decoder layer's activations in the backward
pass of a training forward pass (:data:`REMAT_POLICIES`); decoding never rematerialises.
Parameter names follow Hugging Face's module names so checkpoints map one to one.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct

from dew.models.native_attention import decode_attention
from dew.models.packed_attention import SharedPromptRows, accumulation, attend, attend_shared
from dew.models.weight_product import weight_product
from dew.parallelism import constrain_rows

MLP_ACTIVATIONS = ("swiglu", "gelu")
# Rematerialisation of decoder layers in training (jax.checkpoint): what the backward pass keeps of each layer's
# forward pass. "none" keeps everything; "full" keeps only each layer's input and recomputes the layer; "dots"
# keeps the weight products' outputs (no batch dimensions) and recomputes the rest (norms, rotary, softmax).
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


@struct.dataclass
class KVCache:
    """Keys and values of every layer for decoding.

    keys: one [batch, kv_heads, head_dim, capacity] array per layer, stored transposed so
    a decode step's scores are a plain ``q @ keys`` product: XLA's CPU batched dot runs
    the transposed-operand form several times slower at these shapes
    values: one [batch, kv_heads, capacity, head_dim] array per layer
    (separate arrays per layer, so a decode step updates each in place rather than
    copying a stacked block)
    lengths: [batch] int32, the number of valid positions of each row.

    A layer's keys and values may instead be tuples of blocks that split the positions
    (block 0 the first ones): a decode step given only the first blocks reads, attends
    over and writes only those, so a server whose requests are short does not pay for
    the capacity they leave unused (slicing one array would make XLA copy the window).
    """

    keys: tuple[jax.Array | tuple[jax.Array, ...], ...]
    values: tuple[jax.Array | tuple[jax.Array, ...], ...]
    lengths: jax.Array

    @property
    def capacity(self) -> int:
        return sum(block.shape[2] for block in _blocks(self.values[0]))


def _blocks(store) -> tuple[jax.Array, ...]:
    return store if isinstance(store, tuple) else (store,)


def _written(store, rows, slots, update, axis: int):
    """``store`` (an array or its blocks along position ``axis``) with ``update`` set at (rows, slots).

    rows and slots index the batch and position axes; the indexed block is [batch, length,
    kv_heads, head_dim] in both layouts. Slots outside a block are dropped there.
    """
    update = update.astype(_blocks(store)[0].dtype)
    out, start = [], 0
    for block in _blocks(store):
        size = block.shape[axis]
        local = slots
        if isinstance(store, tuple):
            local = jnp.where((slots >= start) & (slots < start + size), slots - start, size)
        index = (rows, slice(None), slice(None), local) if axis == 3 else (rows, slice(None), local)
        out.append(block.at[index].set(update, mode="drop"))
        start += size
    return tuple(out) if isinstance(store, tuple) else out[0]


def init_cache(model: "CausalTransformer", batch: int, capacity: int, dtype=None, blocks=None) -> KVCache:
    """An empty cache for ``batch`` rows of up to ``capacity`` positions.

    With ``blocks`` (sizes that sum to ``capacity``), each layer's keys and values are
    tuples of blocks of those many positions.
    """
    if batch < 1 or capacity < 1:
        raise ValueError(f"a cache needs batch >= 1 and capacity >= 1, got batch={batch}, capacity={capacity}")
    if blocks is not None and (sum(blocks) != capacity or min(blocks) < 1):
        raise ValueError(f"blocks must be positive sizes that sum to capacity={capacity}, got {list(blocks)}")
    dtype = dtype or model.dtype
    sizes = [capacity] if blocks is None else list(blocks)

    def store(transposed: bool):
        shapes = [(model.head_size, size) if transposed else (size, model.head_size) for size in sizes]
        arrays = tuple(jnp.zeros((batch, model.kv_heads, *shape), dtype) for shape in shapes)
        return arrays if blocks is not None else arrays[0]

    return KVCache(
        keys=tuple(store(True) for _ in range(model.num_layers)),
        values=tuple(store(False) for _ in range(model.num_layers)),
        lengths=jnp.zeros((batch,), jnp.int32),
    )


def rotary_table(positions: jax.Array, dim: int, theta: float, dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
    """cos and sin of the rotary angles of ``positions`` [batch, length], each [batch, length, 1, dim] ``dtype``.

    Computed once per forward pass and shared by every layer's queries and keys; in float32 (as
    transformers does) unless the model computes in float64.
    """
    inv_freq = 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=dtype) / dim))
    angles = positions.astype(dtype)[..., None] * inv_freq  # [B, T, dim/2]
    angles = jnp.concatenate([angles, angles], -1)[:, :, None, :]
    return jnp.cos(angles), jnp.sin(angles)


def rotary(x: jax.Array, table: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Rotate halves of ``x`` [batch, length, heads, dim] by a :func:`rotary_table` (HF's rotate_half)."""
    cos, sin = table
    first, second = jnp.split(x.astype(cos.dtype), 2, axis=-1)
    rotated = jnp.concatenate([-second, first], -1)
    return (x.astype(cos.dtype) * cos + rotated * sin).astype(x.dtype)


def _product(dtype, matmul_dtype, kernel_rows=None):
    """The weight product of a layer: ``matmul_dtype`` operands with a float32 result, or the compute dtype's."""
    if matmul_dtype is None:
        return weight_product(dtype, dtype, kernel_rows)
    return weight_product(matmul_dtype, kernel_rows=kernel_rows)


def _dense(features, name, bias, dtype, param_dtype, matmul_dtype, kernel_rows=None):
    product = _product(dtype, matmul_dtype, kernel_rows)
    return nn.Dense(features, use_bias=bias, dtype=dtype, param_dtype=param_dtype, dot_general=product, name=name)


class Attention(nn.Module):
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    norm_eps: float
    qk_norm: bool
    bias: bool
    dtype: jnp.dtype
    param_dtype: jnp.dtype
    matmul_dtype: jnp.dtype | None = None
    kernel_rows: int | None = None

    @nn.compact
    def __call__(self, x, rotation, mask, write=None, layout: SharedPromptRows | None = None):
        batch, length, _ = x.shape
        dense = lambda features, name, bias: _dense(  # noqa: E731
            features, name, bias, self.dtype, self.param_dtype, self.matmul_dtype, self.kernel_rows
        )
        q = dense(self.num_heads * self.head_dim, "q_proj", self.bias)(x)
        k = dense(self.num_kv_heads * self.head_dim, "k_proj", self.bias)(x)
        v = dense(self.num_kv_heads * self.head_dim, "v_proj", self.bias)(x)
        q = q.reshape(batch, length, self.num_heads, self.head_dim)
        k = k.reshape(batch, length, self.num_kv_heads, self.head_dim)
        v = v.reshape(batch, length, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            norm = lambda name: nn.RMSNorm(  # noqa: E731
                epsilon=self.norm_eps, dtype=self.dtype, param_dtype=self.param_dtype, name=name
            )
            q, k = norm("q_norm")(q), norm("k_norm")(k)
        q = rotary(q, rotation)
        k = rotary(k, rotation)

        groups = self.num_heads // self.num_kv_heads
        q = q.reshape(batch, length, self.num_kv_heads, groups, self.head_dim)
        key_spec, value_spec = "bskd", "bskd"  # keys and values as projected, [B, S, K, D]
        if write is not None:  # stored in the cache; decoding attends over the cache blocks given (their layout)
            k, v, key_spec, value_spec = write(k, v)
        if length == 1 and key_spec == "bkds":
            # A decode step: the mask is each row's prefix of the cache (its positions so far).
            counts = mask[:, 0].sum(-1, dtype=jnp.int32)
            out = decode_attention(q[:, 0], _blocks(k), _blocks(v), counts, self.dtype)[:, None]
        elif layout is not None and write is None:
            out = attend_shared(q, k, v, mask, self.dtype, layout)
        else:
            if isinstance(k, tuple):  # a prefill that reads a blocked cache
                k, v = jnp.concatenate(k, axis=-1), jnp.concatenate(v, axis=-2)
            out = attend(q, k, v, mask, self.dtype, key_spec, value_spec)
        out = out.reshape(batch, length, self.num_heads * self.head_dim)
        return dense(x.shape[-1], "o_proj", False)(out)


class MLP(nn.Module):
    features: int
    activation: str
    dtype: jnp.dtype
    param_dtype: jnp.dtype
    matmul_dtype: jnp.dtype | None = None
    kernel_rows: int | None = None

    @nn.compact
    def __call__(self, x):
        dense = lambda features, name: _dense(  # noqa: E731
            features, name, False, self.dtype, self.param_dtype, self.matmul_dtype, self.kernel_rows
        )
        if self.activation == "swiglu":
            hidden = nn.silu(dense(self.features, "gate_proj")(x)) * dense(self.features, "up_proj")(x)
        else:
            hidden = nn.gelu(dense(self.features, "up_proj")(x), approximate=False)
        return dense(x.shape[-1], "down_proj")(hidden)


@dataclasses.dataclass(frozen=True)
class LayerOptions:
    """What one decoder layer needs of the model's options (a plain value, not a submodule)."""

    num_heads: int
    kv_heads: int
    head_size: int
    rope_theta: float
    norm_eps: float
    qk_norm: bool
    attention_bias: bool
    mlp_features: int
    mlp_activation: str
    dtype: jnp.dtype
    param_dtype: jnp.dtype
    matmul_dtype: jnp.dtype | None
    kernel_rows: int | None = None


class Block(nn.Module):
    config: LayerOptions

    @nn.compact
    def __call__(self, x, rotation, mask, write=None, layout: SharedPromptRows | None = None):
        c = self.config
        norm = lambda name: nn.RMSNorm(  # noqa: E731
            epsilon=c.norm_eps, dtype=c.dtype, param_dtype=c.param_dtype, name=name
        )
        attention = Attention(
            c.num_heads, c.kv_heads, c.head_size, c.rope_theta, c.norm_eps, c.qk_norm,
            c.attention_bias, c.dtype, c.param_dtype, c.matmul_dtype, c.kernel_rows, name="self_attn",
        )
        x = x + attention(norm("input_layernorm")(x), rotation, mask, write, layout)
        mlp = MLP(c.mlp_features, c.mlp_activation, c.dtype, c.param_dtype, c.matmul_dtype, c.kernel_rows, name="mlp")
        return x + mlp(norm("post_attention_layernorm")(x))


class CausalTransformer(nn.Module):
    """A pre-norm decoder with rotary positions; see the module docstring for the call forms."""

    vocab_size: int
    emb_features: int
    num_layers: int
    num_heads: int
    mlp_features: int
    max_seq_len: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-6
    mlp_activation: str = "swiglu"
    qk_norm: bool = False
    tie_embeddings: bool = True
    attention_bias: bool = False
    logit_softcap: float | None = None
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    matmul_dtype: jnp.dtype | None = None  # operands of the weight products; None: the compute dtype
    # bfloat16 products of at most this many rows go to dew's CPU kernel (None: where it is faster; Server)
    kernel_rows: int | None = None
    remat: str = "none"  # a key of REMAT_POLICIES: what training keeps of each layer for the backward pass

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.emb_features // self.num_heads

    @nn.compact
    def __call__(
        self, tokens, segment_ids=None, positions=None, cache: KVCache | None = None, lengths=None, rows=None,
        logits_at=None, hidden: bool = False, prefix_segments=None, layout: SharedPromptRows | None = None,
    ):
        batch, length = tokens.shape
        embed = nn.Embed(
            self.vocab_size, self.emb_features, dtype=self.dtype, param_dtype=self.param_dtype,
            embedding_init=nn.initializers.normal(0.02), name="embed_tokens",
        )
        x = constrain_rows(embed(tokens))
        if cache is None:
            mask, positions = self._packed_mask(batch, length, segment_ids, positions, prefix_segments)
            write = None
        elif rows is not None:
            if segment_ids is None or positions is None:
                raise ValueError("a packed prefill (rows=...) needs segment_ids and positions")
            mask, positions = self._packed_mask(batch, length, segment_ids, positions)
            write, lengths, written = self._packed_write(cache, rows, positions, segment_ids)
        else:
            mask, positions, write, lengths, written = self._cache_mask(cache, batch, length, positions, lengths)

        options = LayerOptions(
            self.num_heads, self.kv_heads, self.head_size, self.rope_theta, self.norm_eps, self.qk_norm,
            self.attention_bias, self.mlp_features, self.mlp_activation, self.dtype, self.param_dtype,
            self.matmul_dtype, self.kernel_rows,
        )
        rotation = rotary_table(positions, self.head_size, self.rope_theta, accumulation(self.dtype))
        block = Block
        if REMAT_POLICIES[self.remat] is not None and cache is None:
            # same names: the parameters do not change; the cache writer and the row layout are Python values
            block = nn.remat(Block, policy=REMAT_POLICIES[self.remat], static_argnums=(4, 5))
        for layer in range(self.num_layers):
            layer_write = None if write is None else functools.partial(write, layer)
            x = constrain_rows(block(options, name=f"layers_{layer}")(x, rotation, mask, layer_write, layout))
        if logits_at is not None:
            x = jnp.take_along_axis(x, logits_at[:, :, None], axis=1)
        x = nn.RMSNorm(epsilon=self.norm_eps, dtype=self.dtype, param_dtype=self.param_dtype, name="norm")(x)
        if hidden:  # the final normed hidden states, for a head of one's own (ValueHead); no cache
            if cache is not None:
                raise ValueError("hidden=True returns hidden states of a packed forward pass, not of a cached one")
            return x
        if self.tie_embeddings:
            logits = _product(self.dtype, self.matmul_dtype, self.kernel_rows)(
                x, embed.embedding, (((x.ndim - 1,), (1,)), ((), ())))
        else:
            logits = _dense(self.vocab_size, "lm_head", False, self.dtype, self.param_dtype, self.matmul_dtype,
                            self.kernel_rows)(x)
        logits = constrain_rows(logits.astype(accumulation(self.dtype)))
        if self.logit_softcap is not None:
            logits = self.logit_softcap * jnp.tanh(logits / self.logit_softcap)
        if cache is None:
            return logits
        return logits, KVCache(tuple(written["keys"]), tuple(written["values"]), cache.lengths + lengths)

    def _packed_mask(self, batch, length, segment_ids, positions, prefix_segments=None):
        if segment_ids is None:
            segment_ids = jnp.ones((batch, length), jnp.int32)
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
        causal = jnp.tril(jnp.ones((length, length), bool))
        same = segment_ids[:, :, None] == segment_ids[:, None, :]
        mask = causal[None] & same
        if prefix_segments is not None:  # and the whole of the prefix segment each id names
            mask |= (prefix_segments[:, :, None] == segment_ids[:, None, :]) & (prefix_segments[:, :, None] > 0)
        return mask, positions

    def _cache_mask(self, cache, batch, length, positions, lengths):
        start = cache.lengths  # [B]
        if lengths is None:
            lengths = jnp.full((batch,), length, jnp.int32)
        lengths = lengths.astype(jnp.int32)
        if positions is None:
            positions = start[:, None] + jnp.arange(length, dtype=jnp.int32)[None]
        capacity = cache.capacity
        # Query t of row b sees every cached slot before it and the new ids up to itself.
        slots = jnp.arange(capacity)[None, None, :]
        mask = slots <= (start[:, None] + jnp.arange(length)[None, :])[:, :, None]
        valid = jnp.arange(length)[None, :] < lengths[:, None]  # [B, T]

        # One scatter per array and layer: row b, slots start[b] + t for its valid ids; invalid
        # ids point past the end and are dropped, so a finished row's cache stays as it was.
        rows = jnp.broadcast_to(jnp.arange(batch)[:, None], (batch, length))
        slots_written = jnp.where(valid, start[:, None] + jnp.arange(length)[None, :], capacity)
        written = {"keys": list(cache.keys), "values": list(cache.values)}

        def write(layer, k, v):
            written["keys"][layer] = _written(written["keys"][layer], rows, slots_written, k, axis=3)
            written["values"][layer] = _written(written["values"][layer], rows, slots_written, v, axis=2)
            return written["keys"][layer], written["values"][layer], "bkds", "bksd"

        return mask, positions, write, lengths, written

    def _packed_write(self, cache, rows, positions, segment_ids):
        # Padding (segment 0) points past the end and is dropped, like finished rows when decoding.
        slots_written = jnp.where(segment_ids > 0, positions, cache.capacity)
        written = {"keys": list(cache.keys), "values": list(cache.values)}

        def write(layer, k, v):
            written["keys"][layer] = _written(written["keys"][layer], rows, slots_written, k, axis=3)
            written["values"][layer] = _written(written["values"][layer], rows, slots_written, v, axis=2)
            return k, v, "bskd", "bskd"  # the packed ids attend among themselves

        counts = jnp.zeros_like(cache.lengths).at[rows].add((segment_ids > 0).astype(jnp.int32), mode="drop")
        return write, counts, written


def validate_config(model: CausalTransformer) -> None:
    """Raise ValueError naming the first inconsistent option of a decoder config."""
    positive = ("vocab_size", "emb_features", "num_layers", "num_heads", "mlp_features", "max_seq_len")
    for name in positive:
        value = getattr(model, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if model.num_kv_heads is not None and (model.num_kv_heads < 1 or model.num_heads % model.num_kv_heads):
        raise ValueError(
            f"num_kv_heads must divide num_heads={model.num_heads}, got {model.num_kv_heads}"
        )
    if model.head_dim is None and model.emb_features % model.num_heads:
        raise ValueError(
            f"emb_features={model.emb_features} is not divisible by num_heads={model.num_heads}; "
            "pass head_dim explicitly"
        )
    if model.head_size % 2:
        raise ValueError(f"head_dim must be even for rotary positions, got {model.head_size}")
    if model.mlp_activation not in MLP_ACTIVATIONS:
        raise ValueError(f"mlp_activation must be one of {MLP_ACTIVATIONS}, got {model.mlp_activation!r}")
    if model.logit_softcap is not None and model.logit_softcap <= 0:
        raise ValueError(f"logit_softcap must be positive or None, got {model.logit_softcap}")
    if model.remat not in REMAT_POLICIES:
        raise ValueError(f"remat must be one of {tuple(REMAT_POLICIES)}, got {model.remat!r}")
    if model.norm_eps <= 0:
        raise ValueError(f"norm_eps must be positive, got {model.norm_eps}")

