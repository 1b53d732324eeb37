"""Inference: batched generation, continuous batching, the rollout-server interface, and the engines behind it.

Native: :class:`Server` and :class:`NativeRolloutServer`. Remote: :class:`OpenAIRolloutServer`
(vLLM or SGLang ``/v1/completions``) and :class:`VLLMGenerateServer` (vLLM's token route).
Publishing to remote engines: :class:`SafetensorsReload` (through the disk) or
:class:`NCCLPush` (by NCCL broadcast) as the push of a :class:`Publication`, checked by a
:class:`LandingCheck`. Agentic sessions: the recording :class:`Gateway` and the
:class:`SessionProxy` sandboxes reach it through. :class:`VLLMEngine` starts a real vLLM
from its own environment.
"""

from dew.inference.engines import VLLMEngine, engine_python
from dew.inference.gateway import Gateway, GatewayError
from dew.inference.generation import Generation, TextGeneration
from dew.inference.http import OpenAIFront
from dew.inference.landing import LandingCheck, LandingError
from dew.inference.nccl_push import NCCLPush
from dew.inference.openai_server import (
    Completion,
    CompletionChoice,
    OpenAICompletion,
    OpenAIRolloutServer,
    engine_client,
)
from dew.inference.publisher import WeightPublisher
from dew.inference.reload import Publication, SafetensorsReload
from dew.inference.remote import EnginePool, EngineRolloutServer, VLLMGenerateServer
from dew.inference.rollout import Draw, DrawFuture, NativeRolloutServer, RolloutServer, ServerDied
from dew.inference.server import Finished, Server, ServingTask
from dew.inference.session_proxy import SessionProxy
from dew.inference.wire import EngineError

__all__ = [
    "Completion", "CompletionChoice", "Draw", "DrawFuture", "EngineError", "EnginePool", "EngineRolloutServer",
    "Finished", "Gateway", "GatewayError", "Generation", "LandingCheck", "LandingError", "NCCLPush",
    "NativeRolloutServer", "OpenAICompletion", "OpenAIFront", "OpenAIRolloutServer", "Publication", "RolloutServer",
    "SafetensorsReload", "Server", "ServerDied", "ServingTask", "SessionProxy", "TextGeneration", "VLLMEngine",
    "VLLMGenerateServer", "WeightPublisher", "engine_client", "engine_python",
]
