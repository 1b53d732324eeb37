"""The decoder shapes the benchmarks measure, as dew's ``causal_transformer`` options (plain Python: the peers'
environment reads them too).

- ``bench``: the 12.6M-parameter Qwen3-shaped bench decoder (vocabulary 8,192);
- ``qwen3-0.6b``: Qwen3-0.6B's shape (596M parameters, vocabulary 151,936, tied embeddings), randomly initialised.
"""

MODEL_SHAPES = {
    "bench": dict(vocab_size=8192, emb_features=384, num_layers=6, num_heads=6, num_kv_heads=2, head_dim=64,
                  mlp_features=1024, qk_norm=True),
    "qwen3-0.6b": dict(vocab_size=151936, emb_features=1024, num_layers=28, num_heads=16, num_kv_heads=8,
                       head_dim=128, mlp_features=3072, qk_norm=True, rope_theta=1e6),
}


def qwen3_config(shape: str) -> dict:
    """The same shape as transformers' ``Qwen3Config`` arguments (tied embeddings)."""
    s = MODEL_SHAPES[shape]
    return dict(vocab_size=s["vocab_size"], hidden_size=s["emb_features"], num_hidden_layers=s["num_layers"],
                num_attention_heads=s["num_heads"], num_key_value_heads=s["num_kv_heads"], head_dim=s["head_dim"],
                intermediate_size=s["mlp_features"], tie_word_embeddings=True,
                **({"rope_theta": s["rope_theta"]} if "rope_theta" in s else {}))


def weight_count(shape: str) -> int:
    """Parameters of the weight products (the tied output layer once): what the model FLOPs count."""
    s = MODEL_SHAPES[shape]
    attention, kv = s["num_heads"] * s["head_dim"], s["num_kv_heads"] * s["head_dim"]
    per_layer = s["emb_features"] * (2 * attention + 2 * kv) + 3 * s["emb_features"] * s["mlp_features"]
    return s["num_layers"] * per_layer + s["vocab_size"] * s["emb_features"]
