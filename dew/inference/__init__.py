"""Native inference: batched generation with a KV cache."""

from dew.inference.generation import Generation, TextGeneration

__all__ = ["Generation", "TextGeneration"]
