#!/usr/bin/env bash
# The GPU checks of the rollout servers (tools/gpu_check.py), for a lent GPU machine, under 8 minutes.
# The machine reaches no network: VLLM_PYTHON must name a Python whose environment has a GPU vLLM (and
# SGLANG_PYTHON one with SGLang, to check it too). Without a GPU it says so and exits 0: nothing to check.
set -uo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "no GPU here: the GPU checks did not run"
  exit 0
fi
: "${VLLM_PYTHON:?set VLLM_PYTHON to a Python whose environment has a GPU vLLM}"
extra=()
[ -n "${SGLANG_PYTHON:-}" ] && extra=(--sglang-python "$SGLANG_PYTHON")
timeout 480 uv run --offline python tools/gpu_check.py --vllm-python "$VLLM_PYTHON" "${extra[@]}"
