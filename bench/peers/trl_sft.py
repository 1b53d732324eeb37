"""Peer for bench/sft_step.py: TRL's SFTTrainer on the same model and batch (run in .venv-ref).

A Qwen3-shaped decoder of the shape named last (bench/shapes.py; the 12.6M-parameter bench decoder by default),
randomly initialised; the rows of token ids bench/sft_step.py gives, already tokenized (an ``input_ids``
column, so TRL runs no tokenizer), AdamW, 2 threads. ``mode`` picks TRL's configuration:

- ``float32``: ``bf16=False, gradient_checkpointing=False``, the like-for-like peer;
- ``defaults``: SFTConfig as TRL 1.16 ships it (``bf16=True``, CPU autocast, and gradient
  checkpointing), what a user gets without tuning.

Prints {"steps_per_second", "peak_rss_gib", "trl", "mode"} as JSON.
"""

import json
import sys
import tempfile

import numpy as np
import trl
from datasets import Dataset
from qwen3_bench import TRL_MODES, StepTimes, bench_model, peak_rss_gib, vocab, word_tokenizer
from trl import SFTConfig, SFTTrainer


def main(steps: int, rows: int, width: int, mode: str, shape: str = "bench") -> None:
    model, tokenizer = bench_model(width, shape=shape), word_tokenizer(shape)
    ids = np.random.default_rng(0).integers(2, vocab(shape), (rows, width)).tolist()
    timer = StepTimes()
    with tempfile.TemporaryDirectory() as out:
        args = SFTConfig(output_dir=out, per_device_train_batch_size=rows, max_steps=steps, learning_rate=1e-4,
                         max_length=width, logging_steps=steps, report_to="none", use_cpu=True, save_strategy="no",
                         dataloader_num_workers=0, disable_tqdm=True, **TRL_MODES[mode])
        trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list([{"input_ids": r} for r in ids] * steps),
                             processing_class=tokenizer, callbacks=[timer])
        trainer.train()
    print(json.dumps({"steps_per_second": timer.steps_per_second(), "mode": mode, "trl": trl.__version__,
                      "bf16": args.bf16, "gradient_checkpointing": args.gradient_checkpointing,
                      "peak_rss_gib": peak_rss_gib()}))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], *sys.argv[5:6])
