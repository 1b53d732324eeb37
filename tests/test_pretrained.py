"""Pretrained against transformers: checkpoints written by transformers load into dew with equal logits.

Fixtures come from tools/parity_transformer.py (each expected.npz records the torch and
transformers versions). Llama's checkpoint is sharded, Qwen2's has attention biases,
Qwen3's has QK-norm and an explicit head_dim; Qwen2 and Qwen3 tie their embeddings.
"""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from dew import models
from dew.models.pretrained import Pretrained, load_pretrained, read_safetensors

FIXTURES = Path(__file__).parent / "fixtures"
FAMILIES = ("llama", "qwen2", "qwen3")


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_checkpoints_give_the_same_logits(family):
    directory = FIXTURES / f"hf_{family}"
    expected = np.load(directory / "expected.npz")
    model, variables = load_pretrained(directory)
    logits = jax.jit(model.apply)(variables, expected["ids"])
    difference = float(np.abs(np.asarray(logits) - expected["logits"]).max())
    print(f"{family}: largest logit difference {difference:.2e} "
          f"(transformers {expected['transformers_version']}, torch {expected['torch_version']})")
    assert difference <= 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_save_writes_what_transformers_wrote(family, tmp_path):
    directory = FIXTURES / f"hf_{family}"
    pretrained = Pretrained.from_directory(directory)
    variables = pretrained.load()
    pretrained.save(variables, tmp_path)
    original, written = read_safetensors(directory), read_safetensors(tmp_path)
    if pretrained.config["tie_word_embeddings"]:
        original.pop("lm_head.weight", None)
    assert sorted(written) == sorted(original)
    for name, value in original.items():
        assert written[name].dtype == np.float32
        np.testing.assert_array_equal(written[name], value, err_msg=name)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == json.loads((directory / "config.json").read_text())["architectures"]
    model, reloaded = load_pretrained(tmp_path)
    assert jax.tree.all(jax.tree.map(np.array_equal, reloaded, variables))


def test_bfloat16_save_sharding_and_export(tmp_path):
    pretrained = Pretrained.from_directory(FIXTURES / "hf_qwen3")
    variables = pretrained.load()
    exported = pretrained.export(variables, dtype="bfloat16")
    pretrained.save(variables, tmp_path, dtype="bfloat16", max_shard_bytes=20_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    written = read_safetensors(tmp_path)
    assert set(written) == set(exported) == set(index["weight_map"])
    for name, value in exported.items():
        assert written[name].dtype == value.dtype == jnp.bfloat16
        np.testing.assert_array_equal(written[name], value)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    # Reading bfloat16 back rounds each weight to bfloat16 and nothing else.
    back = load_pretrained(tmp_path)[1]
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(variables)):
        np.testing.assert_array_equal(a, np.asarray(b).astype(jnp.bfloat16).astype(np.float32))


def test_a_dew_model_round_trips_through_its_hugging_face_form(tmp_path):
    model = models.build("causal_transformer", vocab_size=32, emb_features=16, num_layers=2, num_heads=4,
                         num_kv_heads=2, mlp_features=24, max_seq_len=16, qk_norm=True, rope_theta=1e6)
    variables = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    pretrained = Pretrained.from_model(model)
    assert pretrained.architecture == "Qwen3ForCausalLM"
    pretrained.save(variables, tmp_path)
    loaded_model, loaded = load_pretrained(tmp_path)
    tokens = np.arange(8)[None] % 32
    np.testing.assert_array_equal(jax.jit(loaded_model.apply)(loaded, tokens), jax.jit(model.apply)(variables, tokens))
    assert set(load_file(str(tmp_path / "model.safetensors"))) == set(pretrained.export(variables))


def test_a_tied_model_saved_untied_has_its_output_layer_as_a_tensor_of_its_own(tmp_path):
    """What SafetensorsReload writes for vLLM (whose reload leaves a tied output layer stale): the same model."""
    model = models.build("causal_transformer", vocab_size=32, emb_features=16, num_layers=1, num_heads=2,
                         mlp_features=24, max_seq_len=16, qk_norm=True)
    variables = jax.jit(model.init)(jax.random.key(1), jnp.zeros((1, 4), jnp.int32))
    pretrained = Pretrained.from_model(model)
    assert pretrained.config["tie_word_embeddings"]
    pretrained.save(variables, tmp_path, untied=True)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    np.testing.assert_array_equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"])
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] is False
    loaded_model, loaded = load_pretrained(tmp_path)
    assert not loaded_model.tie_embeddings and pretrained.config["tie_word_embeddings"]  # the model's own stays tied
    tokens = np.arange(8)[None] % 32
    # the same numbers up to float32 rounding: an output kernel and the embedding read transposed sum in other orders
    np.testing.assert_allclose(jax.jit(loaded_model.apply)(loaded, tokens), jax.jit(model.apply)(variables, tokens),
                               atol=1e-6)


def test_unsupported_checkpoints_are_refused(tmp_path):
    config = json.loads((FIXTURES / "hf_llama" / "config.json").read_text())
    for change, message in (
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}, "rope scaling 'llama3'"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not implemented"),
        ({"architectures": ["GPT2LMHeadModel"]}, "holds none that dew reads"),
    ):
        (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=message):
            Pretrained.from_directory(tmp_path).model()
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor"):
        Pretrained.from_directory(FIXTURES / "hf_qwen2").load(tmp_path)
    gelu = models.build("causal_transformer", vocab_size=8, emb_features=8, num_layers=1, num_heads=2,
                        mlp_features=8, max_seq_len=4, mlp_activation="gelu")
    with pytest.raises(ValueError, match="cannot represent this model: mlp_activation='gelu'"):
        Pretrained.from_model(gelu)
