"""Peer for bench/trl_grpo.py: TRL's GRPOTrainer on SmolLM2-135M-Instruct's word problems (run in .venv-ref).

    .venv-ref/bin/python bench/peers/trl_grpo.py DATA OUT --steps N [--bf16] [--eval-every K] [--seconds S]

DATA is the folder bench/trl_grpo.py prepares (``model`` path, ``train.jsonl`` and
``held_out.jsonl`` of chat prompts with their answers, ``settings.json``: prompts per step,
samples, new tokens, temperature, learning rate, warm-up). TRL trains with the same settings as
the dew-ray recipe (``cluster_configs/rlvr-smollm2.toml``): ``num_generations`` samples of each
prompt, ``per_device_train_batch_size`` = prompts x samples completions, one update per
generation batch (``num_iterations=1``), no KL term (``beta=0``), the same temperature,
learning rate, warm-up and cosine decay, the same reward (1 when the completion's last number
is the answer), on the CPU (``use_cpu``), 2 threads. Every ``eval-every`` steps (and before the
first) a callback measures the held-out reward as dew-ray does: 4 draws of each held-out prompt at
the training temperature, the mean reward; the training wall time excludes it. Stops after N
steps or S seconds of training. Writes one JSON line per step (``{"step", "seconds", "train_seconds",
"reward"}``) and per held-out point (``{"held_out": reward, "step", "train_seconds"}``) to OUT.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import torch
import trl
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

LAST_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")  # dew.sandbox.LastNumberReward's rule


def score(text: str, answer: str) -> float:
    found = LAST_NUMBER.findall(text)
    return float(bool(found) and float(found[-1].replace(",", "")) == float(answer))


def reward(completions, answer, **_) -> list[float]:
    return [score(completion[0]["content"], truth) for completion, truth in zip(completions, answer)]


def held_out_reward(model, tokenizer, rows, samples: int, new_tokens: int, temperature: float) -> float:
    """The mean reward of ``samples`` draws of every held-out prompt, in batches of 64 draws."""
    tokenizer.padding_side = "left"
    prompts = [tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
               for row in rows for _ in range(samples)]
    answers = [row["answer"] for row in rows for _ in range(samples)]
    total = 0.0
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for start in range(0, len(prompts), 64):
            batch = tokenizer(prompts[start:start + 64], return_tensors="pt", padding=True, add_special_tokens=False)
            out = model.generate(**batch, max_new_tokens=new_tokens, do_sample=True, temperature=temperature,
                                 top_k=0, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
            texts = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
            total += sum(score(text, answer) for text, answer in zip(texts, answers[start:start + 64]))
    model.train(was_training)
    return total / len(prompts)


class Clock(TrainerCallback):
    """Per-step wall time and the held-out measurements, written to OUT; stops after ``seconds`` of training."""

    def __init__(self, out, held_out, tokenizer, settings, eval_every: int, seconds: float):
        self.out, self.held_out, self.tokenizer, self.settings = out, held_out, tokenizer, settings
        self.eval_every, self.seconds = eval_every, seconds
        self.trained = 0.0
        self.began = None

    def write(self, record):
        with open(self.out, "a") as file:
            file.write(json.dumps(record) + "\n")

    def measure(self, model, step):
        reward = held_out_reward(model, self.tokenizer, self.held_out, 4, self.settings["max_new_tokens"],
                                 self.settings["temperature"])
        self.write({"held_out": reward, "step": step, "train_seconds": self.trained})
        print(f"held-out reward {reward:.3f} at step {step} ({self.trained:.0f} s of training)", flush=True)

    @property
    def measuring(self) -> bool:
        """Held-out points only where asked for (``--eval-every``): a step-time run measures none."""
        return self.eval_every < 10 ** 9

    def on_train_begin(self, args, state, control, model=None, **_):
        if self.measuring:
            self.measure(model, 0)
        self.began = time.perf_counter()

    def on_step_end(self, args, state, control, model=None, **_):
        seconds = time.perf_counter() - self.began
        self.trained += seconds
        rewards = [entry["reward"] for entry in state.log_history if "reward" in entry]
        self.write({"step": state.global_step, "seconds": seconds, "train_seconds": self.trained,
                    "reward": rewards[-1] if rewards else None})
        if self.measuring and (state.global_step % self.eval_every == 0 or self.trained >= self.seconds
                               or state.global_step >= args.max_steps):
            self.measure(model, state.global_step)
        if self.trained >= self.seconds:
            control.should_training_stop = True
        self.began = time.perf_counter()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data")
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--bf16", action="store_true", help="bfloat16 autocast (AMX) instead of float32")
    parser.add_argument("--eval-every", type=int, default=10 ** 9)
    parser.add_argument("--seconds", type=float, default=float("inf"))
    args = parser.parse_args()
    torch.set_num_threads(2)
    data = Path(args.data)
    settings = json.loads((data / "settings.json").read_text())
    rows = lambda name: [json.loads(line) for line in (data / name).read_text().splitlines()]  # noqa: E731
    tokenizer = AutoTokenizer.from_pretrained(settings["model"])
    model = AutoModelForCausalLM.from_pretrained(settings["model"], dtype=torch.float32)
    config = GRPOConfig(
        output_dir=str(Path(args.out).with_suffix(".trainer")), use_cpu=True, bf16=args.bf16, max_steps=args.steps,
        per_device_train_batch_size=settings["tasks_per_step"] * settings["samples"],
        num_generations=settings["samples"], max_completion_length=settings["max_new_tokens"],
        temperature=settings["temperature"], top_k=0, learning_rate=settings["learning_rate"],
        warmup_steps=settings["warmup_steps"], lr_scheduler_type="cosine", beta=0.0, num_iterations=1,
        logging_steps=1, save_strategy="no", report_to=[], seed=settings["seed"], dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(model=model, args=config, reward_funcs=reward, train_dataset=Dataset.from_list(rows("train.jsonl")),
                          processing_class=tokenizer)
    Path(args.out).write_text(json.dumps({"trl": trl.__version__, "torch": torch.__version__,
                                          "bf16": args.bf16}) + "\n")
    trainer.add_callback(Clock(args.out, rows("held_out.jsonl"), tokenizer, settings, args.eval_every, args.seconds))
    trainer.train()


if __name__ == "__main__":
    main()
