"""``ValueHead``: a scalar critic on a decoder's hidden states (PPO's critic).

``ValueHead(backbone)(ids, segment_ids=..., positions=...)`` returns one float32 value per
position, ``[rows, length]``: a Dense(1) on the backbone's final hidden states. A
``CausalTransformer`` gives those with ``hidden=True``; any other backbone must return
``[rows, length, features]`` from ``(ids, segment_ids=..., positions=...)``.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from dew.models.transformer import CausalTransformer


class ValueHead(nn.Module):
    """A scalar Dense head on ``backbone``'s hidden states: one value per position, [rows, length] float32."""

    backbone: nn.Module

    @nn.compact
    def __call__(self, ids, segment_ids=None, positions=None):
        if isinstance(self.backbone, CausalTransformer):
            hidden = self.backbone(ids, segment_ids=segment_ids, positions=positions, hidden=True)
        else:
            hidden = self.backbone(ids, segment_ids=segment_ids, positions=positions)
        return nn.Dense(1, name="value")(hidden)[..., 0].astype(jnp.float32)
