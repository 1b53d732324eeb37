"""Peer for bench/dpo_step.py: TRL's DPOTrainer on the same model shape and pairs (run in .venv-ref).

The 12.6M-parameter Qwen3-shaped decoder of shared/PERF.md, randomly initialised, with a
word-level tokenizer over its 8,192 ids ("w0" ... "w8191"), so the pairs are the same
ids dew trains on: 8 pairs, 31 prompt ids, 32 completion ids and EOS (64 ids a side),
beta 0.1, AdamW, 2 threads. ``mode`` picks TRL's configuration:

- ``float32``: ``bf16=False, gradient_checkpointing=False``, the like-for-like peer;
- ``defaults``: DPOConfig as TRL 1.16 ships it (``bf16=True``, CPU autocast, and gradient
  checkpointing), what a user gets without tuning.

Prints {"steps_per_second", "peak_rss_gib", "trl", "mode"} as JSON.
"""

import copy
import json
import resource
import sys
import tempfile
import time

import numpy as np
import torch
import trl
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM, TrainerCallback
from trl import DPOConfig, DPOTrainer

VOCAB, PAIRS, PROMPT, ANSWER = 8192, 8, 31, 32


class StepTimes(TrainerCallback):
    def __init__(self):
        self.times = []

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter())


def main(steps: int, mode: str) -> None:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    vocab = {f"w{i}": i for i in range(VOCAB)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="w1"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="w0", pad_token="w0")
    rng = np.random.default_rng(0)
    words = lambda ids: " ".join(f"w{i}" for i in ids)  # noqa: E731
    rows = [{"prompt": words(rng.integers(2, VOCAB, PROMPT)), "chosen": " " + words(rng.integers(2, VOCAB, ANSWER)),
             "rejected": " " + words(rng.integers(2, VOCAB, ANSWER))} for _ in range(PAIRS)]
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=384, num_hidden_layers=6, num_attention_heads=6,
                         num_key_value_heads=2, head_dim=64, intermediate_size=1024, tie_word_embeddings=True,
                         max_position_embeddings=128)
    model = Qwen3ForCausalLM(config)
    precision = {"bf16": False, "gradient_checkpointing": False} if mode == "float32" else {}
    timer = StepTimes()
    with tempfile.TemporaryDirectory() as out:
        args = DPOConfig(output_dir=out, per_device_train_batch_size=PAIRS, max_steps=steps, learning_rate=1e-4,
                         beta=0.1, logging_steps=steps, report_to="none", use_cpu=True, save_strategy="no",
                         dataloader_num_workers=0, max_length=None, disable_tqdm=True, **precision)
        trainer = DPOTrainer(model=model, ref_model=copy.deepcopy(model).eval(), args=args, train_dataset=Dataset.from_list(rows * steps),
                             processing_class=tokenizer, callbacks=[timer])
        trainer.train()
    gaps = np.diff(timer.times[2:])  # steps after two warm-up steps
    print(json.dumps({"steps_per_second": float(1 / np.median(gaps)),
                      "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "trl": trl.__version__,
                      "mode": mode, "bf16": args.bf16, "gradient_checkpointing": args.gradient_checkpointing}))


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
