"""Where dew's float32 logits on the real SmolLM2-135M-Instruct part from the float64 truth, and by how much.

    uv run python bench/smollm2_fidelity.py

Reads tests/fixtures/smollm2_parity.npz (tools/parity_smollm2.py: transformers' float32 and bfloat16 logits and a
float64 truth, at every position of 9 prompts, on a subset of the vocabulary plus the log-sum-exp over all of it)
and runs dew's forward pass on the same ids in several precisions, each in a fresh process:

- ``float32``: dew as it trains and scores in float32;
- ``float32, products in float64``: the same pass with only the weight products (every dense layer and the tied
  output layer) computed in float64 and rounded back to float32; norms, rotary, softmax and SiLU stay float32;
- ``float32, all but the products in float64``: the other way round (products float32, the rest float64);
- ``float64``: everything in float64;
- ``bfloat16 served``: the native Server's precision (bfloat16 weights and products, float32 elsewhere).

For each, the largest absolute difference from the truth over every position and subset id, beside
transformers' float32 and bfloat16 figures from the fixture. The measurement behind tests/test_smollm2.py's
explanation: the float32 gap is the rounding of XLA's CPU float32 products, not a difference of model.
Writes bench/results/smollm2_fidelity.json and prints a table.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
FIXTURE = ROOT / "tests" / "fixtures" / "smollm2_parity.npz"

# One variant in a fresh interpreter: x64 is process-wide, and the patched products must not leak into the next.
VARIANT = r"""
import json, sys
variant, fixture, directory = sys.argv[1:4]
import jax
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp, numpy as np
import dew.models.weight_product as products
import dew.models.transformer as transformer
from dew.inference.server import cast_floating
from dew.models.pretrained import Pretrained

expected = dict(np.load(fixture))
pretrained = Pretrained.from_directory(directory)
wide = variant in ("float64", "float32, all but the products in float64")
model = pretrained.model(dtype=jnp.float64 if wide else jnp.float32, param_dtype=jnp.float64 if wide else jnp.float32)
variables = pretrained.load(dtype=np.float64 if wide else np.float32)
if variant == "float32, products in float64":
    contract = products._contract
    products._contract = lambda lhs, rhs, dims: contract(lhs.astype(jnp.float64), rhs.astype(jnp.float64),
                                                         dims).astype(jnp.float32)
if variant == "float32, all but the products in float64":
    contract = products._contract
    products._contract = lambda lhs, rhs, dims: contract(lhs.astype(jnp.float32), rhs.astype(jnp.float32),
                                                         dims).astype(jnp.float64)
if variant == "bfloat16 served":
    model, variables = model.clone(matmul_dtype=jnp.bfloat16), cast_floating(variables, jnp.bfloat16)
worst = 0.0
for index in range(int(expected["prompts"])):
    ids = expected[f"prompt{index}/ids"][None]
    logits = np.asarray(jax.jit(model.apply)(variables, jnp.asarray(ids)), np.float64)[0]
    subset = np.take_along_axis(logits, expected[f"prompt{index}/subset"], -1)
    worst = max(worst, float(np.abs(subset - expected[f"prompt{index}/f64/logits"]).max()))
print(json.dumps({"variant": variant, "largest difference": worst}))
"""
VARIANTS = ("float32", "float32, products in float64", "float32, all but the products in float64", "float64",
            "bfloat16 served")


def main() -> int:
    sys.path.insert(0, str(ROOT / "tools"))
    import smollm2

    directory = smollm2.build(quiet=True)
    expected = dict(np.load(FIXTURE))
    rows = {}
    for variant in VARIANTS:
        ran = subprocess.run([sys.executable, "-c", VARIANT, variant, str(FIXTURE), str(directory)], cwd=ROOT,
                             capture_output=True, text=True)
        if ran.returncode != 0:
            raise RuntimeError(f"{variant}: {ran.stderr[-3000:]}")
        rows[f"dew, {variant}"] = json.loads(ran.stdout.strip().splitlines()[-1])["largest difference"]
    for name, key in (("transformers, float32", "f32"), ("transformers, bfloat16", "bf16")):
        rows[name] = max(float(np.abs(expected[f"prompt{i}/{key}/logits"] - expected[f"prompt{i}/f64/logits"]).max())
                         for i in range(int(expected["prompts"])))
    print("| forward pass | largest logit difference from the float64 truth |\n| --- | --- |")
    for name, value in rows.items():
        print(f"| {name} | {value:.2e} |")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "smollm2_fidelity.json").write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
