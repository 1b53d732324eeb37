"""Record tiny random Llama, Qwen2 and Qwen3 checkpoints and their logits with transformers.

Run in the reference environment (tools/requirements-ref.txt), from the repository root:

    .venv-ref/bin/python tools/parity_transformer.py

For each family writes tests/fixtures/hf_<family>/: the checkpoint as transformers'
save_pretrained writes it (config.json and safetensors; Llama sharded into several
files with an index, to cover sharded reading), and expected.npz with two rows of
input ids, the float32 logits and the torch and transformers versions. Norm weights
and biases are randomised too, so a misplaced norm or bias cannot hide behind
all-ones or all-zeros values. tests/test_pretrained.py loads each checkpoint with
dew's Pretrained and compares logits at 1e-5.
"""

import shutil
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures"
COMMON = dict(
    vocab_size=96, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=80, max_position_embeddings=64, rms_norm_eps=1e-5,
)
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=False), 500000.0, "60KB"),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=True), 1000000.0, None),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(tie_word_embeddings=True, head_dim=16), 1000000.0, None),
}


def main() -> None:
    for index, (family, (config_class, model_class, extra, theta, shard)) in enumerate(FAMILIES.items()):
        torch.manual_seed(index)
        config = config_class(
            **COMMON, **extra, rope_parameters={"rope_type": "default", "rope_theta": theta},
        )
        model = model_class(config).eval()
        with torch.no_grad():
            for name, tensor in model.named_parameters():
                if name.endswith("norm.weight"):
                    tensor.uniform_(0.5, 1.5)
                elif name.endswith(".bias"):
                    tensor.normal_(0, 0.1)
        ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(7))
        with torch.no_grad():
            logits = model(input_ids=ids).logits.float().numpy()
        directory = OUT / f"hf_{family}"
        shutil.rmtree(directory, ignore_errors=True)
        model.save_pretrained(directory, **({"max_shard_size": shard} if shard else {}))
        np.savez(
            directory / "expected.npz", ids=ids.numpy(), logits=logits,
            torch_version=np.str_(torch.__version__), transformers_version=np.str_(transformers.__version__),
        )
        print(family, sorted(p.name for p in directory.iterdir()))


if __name__ == "__main__":
    main()
