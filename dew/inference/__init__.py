"""Native inference: batched generation, continuous batching and the rollout-server interface."""

from dew.inference.generation import Generation, TextGeneration
from dew.inference.http import OpenAIFront
from dew.inference.publisher import WeightPublisher
from dew.inference.rollout import Draw, DrawFuture, NativeRolloutServer, RolloutServer
from dew.inference.server import Finished, Server, ServingTask

__all__ = [
    "Draw", "DrawFuture", "Finished", "Generation", "NativeRolloutServer", "OpenAIFront", "RolloutServer", "Server", "ServingTask",
    "TextGeneration", "WeightPublisher",
]
