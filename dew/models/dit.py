"""``SimpleDiT``: a small diffusion transformer over image patches, and ``TokenEncoder`` for text conditions.

``SimpleDiT(output_channels, patch_size, emb_features, num_layers, num_heads, mlp_ratio)`` maps
``(x [rows, H, W, C], t [rows] in [0, 1], conditioning [rows, emb_features] or None)`` to
``[rows, H, W, output_channels]``. It is the DiT of Peebles and Xie (2023): non-overlapping
patches embedded by a dense layer plus fixed 2-D sine-cosine positions; the time (scaled by
1000, as DiT's timestep) through a sinusoidal embedding and an MLP, plus the conditioning
embedding when given; ``num_layers`` pre-norm blocks whose layer norms are modulated by that
embedding (adaLN-Zero: shift, scale and a gate per branch, all zero at initialisation); and a
modulated final layer, also zero-initialised, so an untrained model outputs exactly zero.
H and W must divide by patch_size and emb_features by num_heads.

``TokenEncoder(vocab_size, features, pad_id=0)`` embeds token ids [rows, length] and averages
the embeddings of the ids that are not ``pad_id``: a conditioning encoder for prompts that
``InputSpec.tokenize`` wrote. A prompt of padding only encodes to zeros, the null condition.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dew.validation import positive, positive_int


def timestep_embedding(t: jax.Array, features: int, max_period: float = 10000.0) -> jax.Array:
    """[rows, features] sinusoidal embedding of t [rows] (DiT's, frequencies geometric up to 1 / max_period)."""
    half = features // 2
    frequencies = jnp.exp(-math.log(max_period) * jnp.arange(half, dtype=jnp.float32) / half)
    angles = t[:, None].astype(jnp.float32) * frequencies[None]
    embedding = jnp.concatenate([jnp.cos(angles), jnp.sin(angles)], axis=-1)
    if features % 2:
        embedding = jnp.pad(embedding, ((0, 0), (0, 1)))
    return embedding


def sincos_positions(grid_h: int, grid_w: int, features: int) -> np.ndarray:
    """[grid_h * grid_w, features] fixed 2-D sine-cosine positions (MAE/DiT layout: half per axis)."""
    def axis(positions, width):
        omega = 1.0 / 10000 ** (np.arange(width // 2, dtype=np.float64) / (width / 2.0))
        angles = positions.reshape(-1)[:, None] * omega[None]
        return np.concatenate([np.sin(angles), np.cos(angles)], axis=1)

    quarter = features // 4 * 2
    rows, columns = np.meshgrid(np.arange(grid_h, dtype=np.float64), np.arange(grid_w, dtype=np.float64), indexing="ij")
    table = np.concatenate([axis(rows, quarter), axis(columns, quarter)], axis=1)
    return np.pad(table, ((0, 0), (0, features - table.shape[1]))).astype(np.float32)


def modulate(x: jax.Array, shift: jax.Array, scale: jax.Array) -> jax.Array:
    return x * (1.0 + scale[:, None]) + shift[:, None]


class DiTBlock(nn.Module):
    features: int
    num_heads: int
    mlp_ratio: float

    @nn.compact
    def __call__(self, x, embedding):
        shift1, scale1, gate1, shift2, scale2, gate2 = jnp.split(
            nn.Dense(6 * self.features, kernel_init=nn.initializers.zeros, name="modulation")(nn.silu(embedding)), 6, -1)
        h = modulate(nn.LayerNorm(use_scale=False, use_bias=False, epsilon=1e-6)(x), shift1, scale1)
        h = nn.MultiHeadDotProductAttention(num_heads=self.num_heads, qkv_features=self.features, name="attention")(h, h)
        x = x + gate1[:, None] * h
        h = modulate(nn.LayerNorm(use_scale=False, use_bias=False, epsilon=1e-6)(x), shift2, scale2)
        h = nn.Dense(int(self.features * self.mlp_ratio), name="mlp_in")(h)
        h = nn.Dense(self.features, name="mlp_out")(nn.gelu(h, approximate=True))
        return x + gate2[:, None] * h


class SimpleDiT(nn.Module):
    """A diffusion transformer over patches (see the module docstring)."""

    output_channels: int
    patch_size: int
    emb_features: int
    num_layers: int
    num_heads: int
    mlp_ratio: float = 4.0

    def __post_init__(self):
        for name in ("output_channels", "patch_size", "emb_features", "num_layers", "num_heads"):
            positive_int(name, getattr(self, name))
        positive("mlp_ratio", self.mlp_ratio)
        if self.emb_features % self.num_heads:
            raise ValueError(f"emb_features ({self.emb_features}) must divide by num_heads ({self.num_heads})")
        super().__post_init__()

    @nn.compact
    def __call__(self, x, t, conditioning=None):
        rows, height, width, channels = x.shape
        p, f = self.patch_size, self.emb_features
        if height % p or width % p:
            raise ValueError(f"SimpleDiT: the image's {height} x {width} pixels must divide by patch_size {p}")
        if t.shape != (rows,):
            raise ValueError(f"SimpleDiT: t must be [rows] = ({rows},), got {t.shape}")
        grid_h, grid_w = height // p, width // p
        patches = x.reshape(rows, grid_h, p, grid_w, p, channels).transpose(0, 1, 3, 2, 4, 5)
        h = nn.Dense(f, name="patches")(patches.reshape(rows, grid_h * grid_w, p * p * channels))
        h = h + sincos_positions(grid_h, grid_w, f)[None]
        embedding = nn.Dense(f, name="time_out")(nn.silu(nn.Dense(f, name="time_in")(timestep_embedding(1000.0 * t, f))))
        if conditioning is not None:
            if conditioning.shape != (rows, f):
                raise ValueError(f"SimpleDiT: conditioning must be [rows, emb_features] = ({rows}, {f}), "
                                 f"got {conditioning.shape}")
            embedding = embedding + conditioning
        for layer in range(self.num_layers):
            h = DiTBlock(f, self.num_heads, self.mlp_ratio, name=f"block_{layer}")(h, embedding)
        shift, scale = jnp.split(nn.Dense(2 * f, kernel_init=nn.initializers.zeros, name="final_modulation")(
            nn.silu(embedding)), 2, -1)
        h = modulate(nn.LayerNorm(use_scale=False, use_bias=False, epsilon=1e-6)(h), shift, scale)
        h = nn.Dense(p * p * self.output_channels, kernel_init=nn.initializers.zeros, name="final")(h)
        h = h.reshape(rows, grid_h, grid_w, p, p, self.output_channels).transpose(0, 1, 3, 2, 4, 5)
        return h.reshape(rows, height, width, self.output_channels)


class TokenEncoder(nn.Module):
    """Mean of the token embeddings of a prompt's non-padding ids (see the module docstring)."""

    vocab_size: int
    features: int
    pad_id: int = 0

    @nn.compact
    def __call__(self, ids):
        embedded = nn.Embed(self.vocab_size, self.features, name="embedding")(ids)
        present = (ids != self.pad_id).astype(embedded.dtype)[..., None]
        return (embedded * present).sum(axis=1) / jnp.maximum(present.sum(axis=1), 1.0)
