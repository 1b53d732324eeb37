"""causal_transformer against transformers' Llama, Qwen2 and Qwen3 on the same random weights.

Fixtures come from tools/parity_transformer.py (torch and transformers versions are
recorded in each file). The mapping below is the plain renaming Hugging Face names
imply: a ``Linear`` weight [out, in] is a Dense kernel [in, out].
"""

from pathlib import Path

import jax
import numpy as np
import pytest

from dew import models

FIXTURES = Path(__file__).parent / "fixtures"
FAMILY_OPTIONS = {
    "llama": dict(tie_embeddings=False),
    "qwen2": dict(attention_bias=True),
    "qwen3": dict(qk_norm=True),
}


def load_variables(weights: dict[str, np.ndarray], layers: int, tied: bool) -> dict:
    params = {"embed_tokens": {"embedding": weights["model.embed_tokens.weight"]},
              "norm": {"scale": weights["model.norm.weight"]}}
    if not tied:
        params["lm_head"] = {"kernel": weights["lm_head.weight"].T}
    for layer in range(layers):
        prefix = f"model.layers.{layer}."
        block = {"input_layernorm": {"scale": weights[prefix + "input_layernorm.weight"]},
                 "post_attention_layernorm": {"scale": weights[prefix + "post_attention_layernorm.weight"]},
                 "self_attn": {}, "mlp": {}}
        for part, names in (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                            ("mlp", ("gate_proj", "up_proj", "down_proj"))):
            for name in names:
                dense = {"kernel": weights[f"{prefix}{part}.{name}.weight"].T}
                if f"{prefix}{part}.{name}.bias" in weights:
                    dense["bias"] = weights[f"{prefix}{part}.{name}.bias"]
                block[part][name] = dense
        for norm in ("q_norm", "k_norm"):
            if f"{prefix}self_attn.{norm}.weight" in weights:
                block["self_attn"][norm] = {"scale": weights[f"{prefix}self_attn.{norm}.weight"]}
        params[f"layers_{layer}"] = block
    return {"params": params}


@pytest.mark.parametrize("family", sorted(FAMILY_OPTIONS))
def test_logits_match_transformers(family):
    fixture = np.load(FIXTURES / f"transformer_{family}.npz")
    weights = {key.removeprefix("weight/"): fixture[key] for key in fixture.files if key.startswith("weight/")}
    vocab, hidden = weights["model.embed_tokens.weight"].shape
    model = models.build(
        "causal_transformer", vocab_size=vocab, emb_features=hidden, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=int(fixture["head_dim"]), mlp_features=80, max_seq_len=64, rope_theta=float(fixture["rope_theta"]),
        norm_eps=1e-5, **FAMILY_OPTIONS[family],
    )
    variables = load_variables(weights, layers=2, tied=bool(fixture["tie"]))
    expected_shapes = jax.tree.map(lambda x: x.shape, jax.eval_shape(model.init, jax.random.key(0), fixture["ids"]))
    assert jax.tree.map(lambda x: x.shape, variables) == expected_shapes  # every parameter mapped, none extra
    logits = jax.jit(model.apply)(variables, fixture["ids"])
    difference = float(np.abs(np.asarray(logits) - fixture["logits"]).max())
    print(f"{family}: largest logit difference {difference:.2e} "
          f"(transformers {fixture['transformers_version']}, torch {fixture['torch_version']})")
    assert difference <= 1e-5
