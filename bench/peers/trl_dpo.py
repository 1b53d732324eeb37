"""Peer for bench/dpo_step.py: TRL's DPOTrainer on the same model shape and pairs (run in .venv-ref).

The bench's 12.6M-parameter Qwen3-shaped decoder (bench/sft_step.py gives its shape), randomly initialised, with a
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
import sys
import tempfile

import numpy as np
import trl
from datasets import Dataset
from qwen3_bench import TRL_MODES, VOCAB, StepTimes, bench_model, peak_rss_gib, word_tokenizer
from trl import DPOConfig, DPOTrainer

PAIRS, PROMPT, ANSWER = 8, 31, 32


def main(steps: int, mode: str) -> None:
    model, tokenizer = bench_model(128), word_tokenizer()
    rng = np.random.default_rng(0)
    words = lambda ids: " ".join(f"w{i}" for i in ids)  # noqa: E731
    rows = [{"prompt": words(rng.integers(2, VOCAB, PROMPT)), "chosen": " " + words(rng.integers(2, VOCAB, ANSWER)),
             "rejected": " " + words(rng.integers(2, VOCAB, ANSWER))} for _ in range(PAIRS)]
    timer = StepTimes()
    with tempfile.TemporaryDirectory() as out:
        args = DPOConfig(output_dir=out, per_device_train_batch_size=PAIRS, max_steps=steps, learning_rate=1e-4,
                         beta=0.1, logging_steps=steps, report_to="none", use_cpu=True, save_strategy="no",
                         dataloader_num_workers=0, max_length=None, disable_tqdm=True, **TRL_MODES[mode])
        trainer = DPOTrainer(model=model, ref_model=copy.deepcopy(model).eval(), args=args, train_dataset=Dataset.from_list(rows * steps),
                             processing_class=tokenizer, callbacks=[timer])
        trainer.train()
    print(json.dumps({"steps_per_second": timer.steps_per_second(), "peak_rss_gib": peak_rss_gib(), "trl": trl.__version__,
                      "mode": mode, "bf16": args.bf16, "gradient_checkpointing": args.gradient_checkpointing}))


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
