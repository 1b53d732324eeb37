"""Check that transformers loads what dew's Pretrained.save writes, with the same logits.

Run in the reference environment, from the repository root:

    .venv-ref/bin/python tools/check_export.py

For Llama, Qwen2 and Qwen3 shapes it asks dew (through `uv run`) to build a random
decoder, save it with Pretrained.save in float32 and bfloat16 and record its logits,
then loads each directory with transformers' AutoModelForCausalLM and prints the
largest logit difference (float32: at most 1e-5; bfloat16: dew's own logits of the
rounded weights, also at most 1e-5). Exits non-zero on a mismatch.
"""

import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

DEW_SIDE = r"""
import sys, jax, jax.numpy as jnp, numpy as np
from dew import models
from dew.models.pretrained import Pretrained, load_pretrained
out = sys.argv[1]
options = {"llama": {"tie_embeddings": False}, "qwen2": {"attention_bias": True}, "qwen3": {"qk_norm": True}}
for index, (family, extra) in enumerate(options.items()):
    model = models.build("causal_transformer", vocab_size=64, emb_features=32, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=16, mlp_features=48, max_seq_len=32, rope_theta=1e6, **extra)
    variables = jax.jit(model.init)(jax.random.key(index), jnp.zeros((1, 4), jnp.int32))
    variables = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(9), x.shape), variables)
    ids = np.random.default_rng(index).integers(0, 64, (2, 10))
    for dtype in ("float32", "bfloat16"):
        directory = f"{out}/{family}-{dtype}"
        Pretrained.from_model(model).save(variables, directory, dtype=dtype)
        loaded_model, loaded = load_pretrained(directory)
        np.savez(f"{directory}/dew_logits.npz", ids=ids, logits=np.asarray(loaded_model.apply(loaded, ids)))
"""


def main() -> int:
    root = Path(__file__).resolve().parents[1]
    failed = False
    with tempfile.TemporaryDirectory() as out:
        subprocess.run(["uv", "run", "python", "-c", DEW_SIDE, out], cwd=root, check=True)
        for directory in sorted(Path(out).iterdir()):
            expected = np.load(directory / "dew_logits.npz")
            model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
            with torch.no_grad():
                logits = model(input_ids=torch.tensor(expected["ids"])).logits.numpy()
            difference = float(np.abs(logits - expected["logits"]).max())
            failed |= difference > 1e-5
            print(f"{directory.name}: {type(model).__name__}, largest logit difference {difference:.2e}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
