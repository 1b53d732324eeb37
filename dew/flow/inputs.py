"""What a diffusion objective reads from a batch: ``Field``, ``InputSpec`` and the optional autoencoder.

``Field(name, shape, dtype="uint8")`` names one batch column of ``shape`` per row:

- ``"uint8"``: pixels 0..255, the generated field, scaled to [-1, 1] as ``x / 127.5 - 1``;
- ``"float32"``: values already in [-1, 1], the generated field;
- ``"int32"``: a condition (token ids or a class id), read by the conditioning encoder
  ``encoders[name]`` gives for it.

``InputSpec(*fields, encoders=None, autoencoder=None, tokenizer=None, pad_id=0)`` holds exactly
one generated field and any number of conditions, each with its encoder: a Flax module
mapping the column to [rows, emb_features] (for example ``models.TokenEncoder``), trained with
the model. The condition embeddings add up and join the model's time embedding. An
``autoencoder`` (any object with ``encode(x)``, ``decode(z)`` and ``latent_shape(shape)``; its
weights, if any, stay fixed) moves the model into its latent space: training encodes the data
and every sample is decoded before a reward or a metric sees it, clipped to [-1, 1].

``inputs.tokenize(prompts)`` gives the condition columns for a prompt-only run: the ids of
``tokenizer`` (a Hugging Face tokenizer or any callable from text to ids), padded with
``pad_id`` to the field's length. A prompt with more ids than that is refused, never cut.
A batch may then leave the generated field out: its rows count from the conditions.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from dew.validation import distinct, one_of, positive_int

DTYPES = ("uint8", "float32", "int32")


@dataclass(frozen=True)
class Field:
    """One batch column (see the module docstring)."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "uint8"

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Field name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.shape, tuple) or not self.shape:
            raise ValueError(f"Field {self.name!r}: shape must be a non-empty tuple of positive integers, got {self.shape!r}")
        for size in self.shape:
            positive_int(f"Field {self.name!r} shape entries", size)
        one_of(f"Field {self.name!r} dtype", self.dtype, DTYPES)

    @property
    def condition(self) -> bool:
        return self.dtype == "int32"


class PatchAutoencoder:
    """A fixed, exactly invertible autoencoder: each ``factor`` x ``factor`` patch becomes one latent pixel
    with ``factor**2`` times the channels (space to depth), and back. For tests and small runs."""

    def __init__(self, factor: int):
        self.factor = positive_int("factor", factor)

    def latent_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        height, width, channels = shape
        if height % self.factor or width % self.factor:
            raise ValueError(f"PatchAutoencoder: an image of {height} x {width} does not divide by factor {self.factor}")
        return (height // self.factor, width // self.factor, channels * self.factor**2)

    def encode(self, x: jax.Array) -> jax.Array:
        rows, height, width, channels = x.shape
        f = self.factor
        x = x.reshape(rows, height // f, f, width // f, f, channels).transpose(0, 1, 3, 2, 4, 5)
        return x.reshape(rows, height // f, width // f, f * f * channels)

    def decode(self, z: jax.Array) -> jax.Array:
        rows, height, width, depth = z.shape
        f = self.factor
        z = z.reshape(rows, height, width, f, f, depth // (f * f)).transpose(0, 1, 3, 2, 4, 5)
        return z.reshape(rows, height * f, width * f, depth // (f * f))


@dataclass(frozen=True)
class InputSpec:
    """The generated field, its conditions and their encoders (see the module docstring)."""

    fields: tuple[Field, ...]
    encoders: Mapping = field(default_factory=dict)
    autoencoder: object = None
    tokenizer: Callable | None = None
    pad_id: int = 0

    def __init__(self, *fields: Field, encoders: Mapping | None = None, autoencoder=None,
                 tokenizer: Callable | None = None, pad_id: int = 0):
        for item in fields:
            if not isinstance(item, Field):
                raise TypeError(f"InputSpec takes dew.Field objects, got {type(item).__name__}")
        distinct("InputSpec field names", [item.name for item in fields])
        generated = [item for item in fields if not item.condition]
        if len(generated) != 1:
            raise ValueError(f"InputSpec needs exactly one generated field (dtype uint8 or float32), got {len(generated)}")
        encoders = dict(encoders or {})
        conditions = [item.name for item in fields if item.condition]
        if sorted(encoders) != sorted(conditions):
            raise ValueError(f"InputSpec needs one encoder per condition field: conditions {sorted(conditions)}, "
                             f"encoders {sorted(encoders)}")
        if autoencoder is not None and not all(hasattr(autoencoder, n) for n in ("encode", "decode", "latent_shape")):
            raise TypeError("autoencoder must have encode(x), decode(z) and latent_shape(shape)")
        if tokenizer is not None and not callable(tokenizer) and not hasattr(tokenizer, "encode"):
            raise TypeError(f"tokenizer must be a Hugging Face tokenizer or callable from text to ids, got {tokenizer!r}")
        if autoencoder is not None and len(generated[0].shape) != 3:
            raise ValueError(f"an autoencoder needs an image field [H, W, C], got shape {generated[0].shape}")
        object.__setattr__(self, "fields", tuple(fields))
        object.__setattr__(self, "encoders", encoders)
        object.__setattr__(self, "autoencoder", autoencoder)
        object.__setattr__(self, "tokenizer", tokenizer)
        object.__setattr__(self, "pad_id", int(pad_id))

    # ----- what the spec describes ---------------------------------------------------------

    @property
    def generated(self) -> Field:
        return next(item for item in self.fields if not item.condition)

    @property
    def conditions(self) -> tuple[Field, ...]:
        return tuple(item for item in self.fields if item.condition)

    @property
    def latent_shape(self) -> tuple[int, ...]:
        """The shape the model samples in: the generated field's, or the autoencoder's latent of it."""
        shape = self.generated.shape
        return shape if self.autoencoder is None else tuple(self.autoencoder.latent_shape(shape))

    def tokenize(self, prompts: Sequence[str]) -> dict[str, np.ndarray]:
        """The condition column for ``prompts``: int32 [len(prompts), length] ids, padded with pad_id."""
        if len(self.conditions) != 1:
            raise ValueError(f"tokenize needs exactly one condition field to write, this InputSpec has "
                             f"{[c.name for c in self.conditions]}")
        if self.tokenizer is None:
            raise ValueError("tokenize needs InputSpec(..., tokenizer=...)")
        if isinstance(prompts, str) or not isinstance(prompts, Sequence):
            raise TypeError(f"tokenize takes a sequence of prompt strings, got {type(prompts).__name__}")
        condition = self.conditions[0]
        (length,) = condition.shape if len(condition.shape) == 1 else (None,)
        if length is None:
            raise ValueError(f"tokenize writes a [length] field; {condition.name!r} has shape {condition.shape}")
        encode = self.tokenizer.encode if hasattr(self.tokenizer, "encode") else self.tokenizer
        ids = np.full((len(prompts), length), self.pad_id, np.int32)
        for row, prompt in enumerate(prompts):
            if not isinstance(prompt, str):
                raise TypeError(f"tokenize: prompt {row} must be a string, got {type(prompt).__name__}")
            tokens = list(encode(prompt))
            if len(tokens) > length:
                raise ValueError(f"tokenize: prompt {row} has {len(tokens)} ids, more than field "
                                 f"{condition.name!r} holds ({length})")
            ids[row, :len(tokens)] = tokens
        return {condition.name: ids}

    # ----- batches ---------------------------------------------------------------------------

    def rows(self, batch: Mapping[str, np.ndarray], owner: str, need_generated: bool = False) -> int:
        """The batch's row count after checking every field it holds; the generated field may be absent
        (a prompt-only batch) unless ``need_generated``, and every condition must be there."""
        if not isinstance(batch, Mapping):
            raise TypeError(f"{owner} needs a batch mapping, got {type(batch).__name__}")
        wanted = [self.generated] if need_generated or not self.conditions else []
        present = [item for item in self.fields if item.name in batch]
        for item in (*self.conditions, *wanted):
            if item.name not in batch:
                raise KeyError(f"{owner} needs batch field {item.name!r}; the batch has {sorted(batch)}")
        counts = set()
        for item in present:
            value = np.asarray(batch[item.name])
            if value.shape[1:] != item.shape:
                raise ValueError(f"{owner}: batch field {item.name!r} must be [rows, {', '.join(map(str, item.shape))}], "
                                 f"got {value.shape}")
            kind = np.dtype(item.dtype)
            if item.condition and not np.issubdtype(value.dtype, np.integer):
                raise TypeError(f"{owner}: batch field {item.name!r} must hold integers, got dtype {value.dtype}")
            if not item.condition and value.dtype != kind:
                raise TypeError(f"{owner}: batch field {item.name!r} must be {kind}, got {value.dtype}")
            if item.dtype == "float32" and value.size and not (np.isfinite(value).all() and np.abs(value).max() <= 1):
                bad = int(np.argwhere(~(np.abs(value) <= 1)).flat[0])
                raise ValueError(f"{owner}: batch field {item.name!r} row {bad} holds a value outside [-1, 1]")
            counts.add(value.shape[0])
        if len(counts) != 1:
            raise ValueError(f"{owner}: the batch fields have different row counts {sorted(counts)}")
        rows = counts.pop()
        if rows == 0:
            raise ValueError(f"{owner}: the batch has no rows")
        return rows

    def data(self, batch) -> jax.Array:
        """The generated field in the model's space: [-1, 1] values, encoded when there is an autoencoder."""
        value = batch[self.generated.name]
        x = value.astype(jnp.float32) / 127.5 - 1.0 if self.generated.dtype == "uint8" else value.astype(jnp.float32)
        return x if self.autoencoder is None else self.autoencoder.encode(x)

    def decode(self, latents: jax.Array) -> jax.Array:
        """Samples as the reward sees them: decoded when there is an autoencoder, clipped to [-1, 1]."""
        x = latents if self.autoencoder is None else self.autoencoder.decode(latents)
        return jnp.clip(x, -1.0, 1.0)

    def condition_columns(self, batch) -> dict:
        return {item.name: batch[item.name] for item in self.conditions}
