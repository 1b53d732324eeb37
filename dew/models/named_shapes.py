"""Named model shapes that more than one place builds.

``TINY_QWEN3``: the smallest Qwen3 the real engines here serve (vLLM's CPU attention needs
a head size such as 64): 2 layers, hidden 128, 2 heads of 64 with one KV head, vocabulary
512, tied embeddings. The real-engine tests, the landing-check benchmark and the GPU check
export it with ``Pretrained.save``.
"""

from __future__ import annotations

from dew.models import build

TINY_QWEN3 = dict(vocab_size=512, emb_features=128, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=64,
                  mlp_features=256, max_seq_len=256, qk_norm=True, rope_theta=1e6, tie_embeddings=True)


def tiny_qwen3(**changes):
    """The TINY_QWEN3 decoder, with ``changes`` to its shape (for example ``tie_embeddings=False``)."""
    return build("causal_transformer", **{**TINY_QWEN3, **changes})
