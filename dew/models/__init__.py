"""Model registry: ``dew.models.build(name, **config)`` returns a flax.linen module."""

from __future__ import annotations

from collections.abc import Callable

from dew.models.dit import SimpleDiT, TokenEncoder
from dew.models.pretrained import Pretrained, load_pretrained
from dew.models.transformer import CausalTransformer, KVCache, init_cache, validate_config

_REGISTRY: dict[str, Callable] = {}


def register(name: str, factory: Callable) -> None:
    """Make ``build(name, ...)`` call ``factory(**config)``."""
    _REGISTRY[name] = factory


def build(name: str, **config):
    """Build a registered model, checking its options.

    >>> model = build("causal_transformer", vocab_size=8, emb_features=16, num_layers=1,
    ...               num_heads=2, mlp_features=32, max_seq_len=4)
    """
    if name not in _REGISTRY:
        raise ValueError(f"unknown model {name!r}; registered models: {sorted(_REGISTRY)}")
    return _REGISTRY[name](**config)


def _causal_transformer(**config) -> CausalTransformer:
    try:
        model = CausalTransformer(**config)
    except TypeError as error:
        raise TypeError(f"causal_transformer: {error}") from None
    validate_config(model)
    return model


register("causal_transformer", _causal_transformer)

__all__ = ["CausalTransformer", "KVCache", "Pretrained", "SimpleDiT", "TokenEncoder", "build", "init_cache",
           "load_pretrained", "register"]
