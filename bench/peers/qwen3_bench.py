"""What the torch and TRL peers of the step benchmarks share (run in .venv-ref).

The bench's 12.6M-parameter Qwen3-shaped decoder (bench/sft_step.py gives its shape), randomly initialised, a
word-level tokenizer over its 8,192 ids (``w0`` ... ``w8191``; TRL needs a processing
class, the ids are given already tokenized or as those words), TRL's two configurations
and a callback that times TRL's steps.
"""

import resource
import time

import numpy as np
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM, TrainerCallback

VOCAB = 8192

# float32 without checkpointing is the like-for-like peer; TRL 1.16's defaults are bf16=True
# (CPU autocast) and gradient checkpointing, what a user gets without tuning.
TRL_MODES = {"float32": {"bf16": False, "gradient_checkpointing": False}, "defaults": {}}


def bench_model(width: int, threads: int = 2) -> Qwen3ForCausalLM:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=384, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2,
        head_dim=64, intermediate_size=1024, tie_word_embeddings=True, max_position_embeddings=width,
    )
    return Qwen3ForCausalLM(config)


def word_tokenizer() -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w1"))
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
