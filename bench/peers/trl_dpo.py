"""Peer for bench/dpo_step.py: TRL's DPOTrainer on the same model shape and pairs (run in .venv-ref).

A Qwen3-shaped decoder of the shape given third (bench/shapes.py; the 12.6M-parameter bench decoder by default),
randomly initialised, with a word-level tokenizer over its ids ("w0", "w1", ...), so the pairs are the same
ids dew trains on: the pairs given fourth (default 8), 31 prompt ids, 32 completion ids and EOS (64 ids a side),
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
from qwen3_bench import TRL_MODES, StepTimes, bench_model, peak_rss_gib, vocab, word_tokenizer
from trl import DPOConfig, DPOTrainer

PROMPT, ANSWER = 31, 32


def main(steps: int, mode: str, shape: str = "bench", pairs: int = 8) -> None:
    model, tokenizer, top = bench_model(128, shape=shape), word_tokenizer(shape), vocab(shape)
    rng = np.random.default_rng(0)
    words = lambda ids: " ".join(f"w{i}" for i in ids)  # noqa: E731
    rows = [{"prompt": words(rng.integers(2, top, PROMPT)), "chosen": " " + words(rng.integers(2, top, ANSWER)),
             "rejected": " " + words(rng.integers(2, top, ANSWER))} for _ in range(pairs)]
    timer = StepTimes()
    with tempfile.TemporaryDirectory() as out:
        args = DPOConfig(output_dir=out, per_device_train_batch_size=pairs, max_steps=steps, learning_rate=1e-4,
                         beta=0.1, logging_steps=steps, report_to="none", use_cpu=True, save_strategy="no",
                         dataloader_num_workers=0, max_length=None, disable_tqdm=True, **TRL_MODES[mode])
        trainer = DPOTrainer(model=model, ref_model=copy.deepcopy(model).eval(), args=args, train_dataset=Dataset.from_list(rows * steps),
                             processing_class=tokenizer, callbacks=[timer])
        trainer.train()
    print(json.dumps({"steps_per_second": timer.steps_per_second(), "peak_rss_gib": peak_rss_gib(), "trl": trl.__version__,
                      "mode": mode, "bf16": args.bf16, "gradient_checkpointing": args.gradient_checkpointing}))


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], *sys.argv[3:4], *(int(a) for a in sys.argv[4:5]))
