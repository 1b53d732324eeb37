"""Inference: batched generation, continuous batching, the rollout-server interface, and the engines behind it.

Native: :class:`Server` and :class:`NativeRolloutServer`. Remote: :class:`OpenAIRolloutServer`
(vLLM or SGLang ``/v1/completions``) and :class:`VLLMGenerateServer` (vLLM's token route).
Replicas: :class:`ReplicaPool` (least busy first, liveness, set-aside and rejoin), which
:class:`EnginePool` spreads draws over engines with, and the Ray layer its actors with.
Publishing to remote engines: :class:`SafetensorsReload` (through the disk) or
:class:`NCCLPush` (by NCCL broadcast) as the push of a :class:`Publication`, checked by a
:class:`LandingCheck`. Agentic sessions: the recording :class:`Gateway` and the
:class:`SessionProxy` sandboxes reach it through. :class:`VLLMEngine` starts a real vLLM
from its own environment.

The names load on first use (PEP 562), so a module that needs one piece (the objectives
need only native generation) does not import the HTTP clients, servers and publishers.
"""

import importlib

_HOMES = {
    "Completion": "dew.inference.openai_server",
    "CompletionChoice": "dew.inference.openai_server",
    "Draw": "dew.inference.rollout_server",
    "DrawFuture": "dew.inference.rollout_server",
    "engine_client": "dew.inference.openai_server",
    "engine_python": "dew.inference.engines",
    "EngineError": "dew.inference.wire",
    "EnginePool": "dew.inference.engine_pool",
    "EngineRolloutServer": "dew.inference.engine_rollout_server",
    "Finished": "dew.inference.server",
    "Gateway": "dew.inference.gateway",
    "GatewayError": "dew.inference.gateway",
    "Generation": "dew.inference.generation",
    "LandingCheck": "dew.inference.landing",
    "LandingError": "dew.inference.landing",
    "PooledRolloutServer": "dew.inference.replica_pool",
    "NativeRolloutServer": "dew.inference.rollout_server",
    "NCCLPush": "dew.inference.nccl_push",
    "OpenAICompletion": "dew.inference.openai_server",
    "OpenAIFront": "dew.inference.http",
    "OpenAIRolloutServer": "dew.inference.openai_server",
    "Publication": "dew.inference.safetensors_reload",
    "ReplicaPool": "dew.inference.replica_pool",
    "RolloutServer": "dew.inference.rollout_server",
    "SafetensorsReload": "dew.inference.safetensors_reload",
    "Server": "dew.inference.server",
    "ServerDied": "dew.inference.rollout_server",
    "ServingTask": "dew.inference.server",
    "SessionProxy": "dew.inference.session_proxy",
    "TextGeneration": "dew.inference.generation",
    "VLLMEngine": "dew.inference.engines",
    "VLLMGenerateServer": "dew.inference.vllm_generate_server",
    "WeightPublisher": "dew.inference.publisher",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'dew.inference' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))
