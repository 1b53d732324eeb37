"""What the torch and TRL peers of the step benchmarks share (run in .venv-ref).

A Qwen3-shaped decoder of one of the benchmarks' shapes (bench/shapes.py: the 12.6M-parameter bench decoder or
Qwen3-0.6B's), randomly initialised, a word-level tokenizer over its ids (``w0`` ... ``w<vocab-1>``; TRL needs a
processing class, the ids are given already tokenized or as those words), TRL's two configurations and a callback
that times TRL's steps.
"""

import resource
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM, TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from shapes import MODEL_SHAPES, qwen3_config  # noqa: E402  (bench/shapes.py, plain Python)

# float32 without checkpointing is the like-for-like peer; TRL 1.16's defaults are bf16=True
# (CPU autocast) and gradient checkpointing, what a user gets without tuning.
TRL_MODES = {"float32": {"bf16": False, "gradient_checkpointing": False}, "defaults": {}}


def vocab(shape: str) -> int:
    return MODEL_SHAPES[shape]["vocab_size"]


def bench_model(width: int, threads: int = 2, shape: str = "bench") -> Qwen3ForCausalLM:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(**qwen3_config(shape), max_position_embeddings=width))


def word_tokenizer(shape: str = "bench") -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab(shape))}, unk_token="w1"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="w0", pad_token="w0")


class StepTimes(TrainerCallback):
    """The clock at the end of every TRL step."""

    def __init__(self):
        self.times = []

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter())

    def steps_per_second(self) -> float:
        return float(1 / np.median(np.diff(self.times[2:])))  # steps after two warm-up steps


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
