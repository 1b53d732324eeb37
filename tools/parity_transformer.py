"""Record transformers' logits for tiny random Llama, Qwen2 and Qwen3 decoders.

Run in the reference environment (tools/requirements-ref.txt), from the repository root:

    .venv-ref/bin/python tools/parity_transformer.py

Writes tests/fixtures/transformer_<family>.npz with every weight of the model (Hugging
Face names), the config values dew needs, two rows of input ids, the float32 logits
and the versions of torch and transformers that produced them. Norm weights are
randomised too, so a wrong norm placement cannot hide behind all-ones scales.
tests/test_transformer_parity.py loads the weights into dew's causal_transformer and
compares logits at 1e-5.
"""

from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures"
COMMON = dict(
    vocab_size=96, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=80, max_position_embeddings=64, rms_norm_eps=1e-5, attn_implementation="eager",
)
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=False, rope_theta=500000.0)),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=True, rope_theta=1000000.0)),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(tie_word_embeddings=True, rope_theta=1000000.0, head_dim=16)),
}


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for index, (family, (config_class, model_class, extra)) in enumerate(FAMILIES.items()):
        torch.manual_seed(index)
        options = {**COMMON, **extra}
        rope_theta = options.pop("rope_theta")
        config = config_class(**options, rope_parameters={"rope_type": "default", "rope_theta": rope_theta})
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
        weights = {f"weight/{name}": t.detach().numpy() for name, t in model.state_dict().items()}
        np.savez(
            OUT / f"transformer_{family}.npz",
            ids=ids.numpy(), logits=logits, rope_theta=np.float64(rope_theta),
            head_dim=np.int64(getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)),
            tie=np.bool_(config.tie_word_embeddings), torch_version=np.str_(torch.__version__),
            transformers_version=np.str_(transformers.__version__), **weights,
        )
        print(family, logits.shape, sorted(weights)[:3], "...")


if __name__ == "__main__":
    main()
