"""Peer for bench/smollm2_stages.py: TRL's DPOTrainer on a Hugging Face model and a JSONL file of pairs (run in .venv-ref).

    python bench/peers/trl_dpo_pairs.py MODEL_DIR PAIRS.jsonl OUT_DIR --steps 40 --learning-rate 5e-6 --beta 0.1

The pairs are in TRL's explicit-prompt conversational layout (``prompt`` chat messages, ``chosen`` and ``rejected``
assistant messages), the file ``dew-ray dpo`` reads. The settings follow ``dew-ray dpo``'s: batches of 8 pairs,
pairs at most ``--max-length`` ids, a constant learning rate, AdamW with weight decay 1e-4 (optax's default) and no
gradient clipping, the reference the starting model; float32 on the CPU, 2 threads. Saves the trained model and its
tokenizer in OUT_DIR and prints {"seconds", "trl", "loss_first", "loss_last"} as JSON.
"""

import argparse
import json
import time

import torch
import trl
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import DPOConfig, DPOTrainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("pairs")
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--learning-rate", type=float, default=5e-6)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(2)
    rows = [json.loads(line) for line in open(args.pairs)]
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    config = DPOConfig(output_dir=args.out, per_device_train_batch_size=args.batch, max_steps=args.steps,
                       learning_rate=args.learning_rate, lr_scheduler_type="constant", warmup_steps=0,
                       weight_decay=1e-4, max_grad_norm=0.0, beta=args.beta, max_length=args.max_length,
                       logging_steps=1, report_to="none", use_cpu=True, save_strategy="no", bf16=False,
                       gradient_checkpointing=False, dataloader_num_workers=0, disable_tqdm=True, seed=args.seed)
    trainer = DPOTrainer(model=model, args=config, train_dataset=Dataset.from_list(rows), processing_class=tokenizer)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    trainer.save_model(args.out)
    tokenizer.save_pretrained(args.out)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    print(json.dumps({"seconds": seconds, "trl": trl.__version__, "loss_first": losses[0], "loss_last": losses[-1]}))


if __name__ == "__main__":
    main()
