"""Peer for bench/sft_step.py: TRL's SFTTrainer on the same model and batch (run in .venv-ref).

The 12.6M-parameter Qwen3-shaped decoder of shared/PERF.md, randomly initialised; 8 rows
of 128 token ids, given already tokenized (an ``input_ids`` column, so TRL runs no
tokenizer), AdamW, 2 threads. ``mode`` picks TRL's configuration:

- ``float32``: ``bf16=False, gradient_checkpointing=False``, the like-for-like peer;
- ``defaults``: SFTConfig as TRL 1.16 ships it (``bf16=True``, CPU autocast, and gradient
  checkpointing), what a user gets without tuning.

Prints {"steps_per_second", "peak_rss_gib", "trl", "mode"} as JSON.
"""

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
from trl import SFTConfig, SFTTrainer

VOCAB = 8192


class StepTimes(TrainerCallback):
    def __init__(self):
        self.times = []

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter())


def main(steps: int, rows: int, width: int, mode: str) -> None:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    backend = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w1"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="w0", pad_token="w0")
    ids = np.random.default_rng(0).integers(2, VOCAB, (rows, width)).tolist()
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=384, num_hidden_layers=6, num_attention_heads=6,
                         num_key_value_heads=2, head_dim=64, intermediate_size=1024, tie_word_embeddings=True,
                         max_position_embeddings=width)
    model = Qwen3ForCausalLM(config)
    precision = {"bf16": False, "gradient_checkpointing": False} if mode == "float32" else {}
    timer = StepTimes()
    with tempfile.TemporaryDirectory() as out:
        args = SFTConfig(output_dir=out, per_device_train_batch_size=rows, max_steps=steps, learning_rate=1e-4,
                         max_length=width, logging_steps=steps, report_to="none", use_cpu=True, save_strategy="no",
                         dataloader_num_workers=0, disable_tqdm=True, **precision)
        trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list([{"input_ids": r} for r in ids] * steps),
                             processing_class=tokenizer, callbacks=[timer])
        trainer.train()
    gaps = np.diff(timer.times[2:])  # steps after two warm-up steps
    print(json.dumps({"steps_per_second": float(1 / np.median(gaps)), "mode": mode, "trl": trl.__version__,
                      "bf16": args.bf16, "gradient_checkpointing": args.gradient_checkpointing,
                      "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
