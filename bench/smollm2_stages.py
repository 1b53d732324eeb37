"""`dew-ray sft` and `dew-ray dpo` on the real SmolLM2-135M-Instruct: a targeted behaviour before and after, and the
exported directories read back by transformers.

    uv run python bench/smollm2_stages.py [--sft-steps 40] [--dpo-steps 40] [--stages sft dpo sft-dpo]
        [--sft-learning-rate 2e-5] [--dpo-learning-rate 5e-6] [--dpo-dtype bfloat16] [--pairs one-off]
        [--skip-transformers]
    uv run python bench/smollm2_stages.py --stages sft-dpo trl-dpo sft-trl-dpo

The behaviour is how SmolLM2 answers the built-in one-step word problems (:mod:`dew.data.word_problems`): it
often goes on after a right sum and ends on another number. Measured on 64 held-out problems (operand pairs no
training row has), greedily, through dew's native Server: the share answered right (the last number is the
answer, :class:`~dew.sandbox.LastNumberReward`) and the share that ends with "The answer is <number>.", the
reference answers' closing.

- SFT: ``dew-ray sft`` on 256 conversations, each a training problem and its reference answer ("Mia has 12 + 7 =
  19 stickers. The answer is 19.");
- DPO: ``dew-ray dpo`` on 256 pairs, the reference answer chosen over the same answer one higher (TRL's
  explicit-prompt layout: prompt as chat messages, chosen and rejected assistant messages), from the model as
  built;
- DPO against the model's own answers (``--pairs own``): the reference answer chosen over the model as built's
  greedy answer to the same training problem (pairs where the two are equal are left out), the usual way to
  aim DPO at what a policy does;
- SFT then DPO (``sft-dpo``): the same ``dew-ray dpo`` run from the SFT policy, the usual order, where the pairs
  are close to what the policy writes itself.
- The peer (``trl-dpo``, ``sft-trl-dpo``): TRL's DPOTrainer (bench/peers/trl_dpo_pairs.py, the reference
  environment, float32) on the same pairs with the same steps, batch, learning rate, beta and pair width, from the
  model as built and from dew-ray's SFT policy: whether a move of the behaviour comes from DPO on these pairs or
  from dew-ray's DPO.

Each exported ``policy/`` directory is then loaded by transformers (the reference environment, ``.venv-ref``)
and its logits on three prompts compared with dew's own. Writes bench/results/smollm2_stages.json and a bar
plot, smollm2_stages.png (smollm2_stages_dpo.* and so on when ``--stages`` names some).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from interleaved import PEER_PYTHON, RESULTS, ROOT
from transformers import AutoTokenizer

from dew.data.verifiable import HELD_OUT, verifiable_tasks
from dew.inference import Server
from dew.models.pretrained import load_pretrained
from dew.sampling import Sampling
from dew.sandbox import LastNumberReward

sys.path.insert(0, str(ROOT / "tools"))
import smollm2  # noqa: E402 (tools/ is not a package)

CLOSING = "The answer is "
# both DPOs' (dew-ray's and TRL's), so the two train on the same settings; the model's own answers (up to 64 ids)
# make pairs longer than the reference answers
DPO_BETA, DPO_WIDTH = 0.1, {"one-off": 128, "own": 160}
CLOSING_PATTERN = re.compile(r"The answer is -?\d+\.?\s*$")

TRANSFORMERS_SIDE = r"""
import json, sys, numpy as np, torch
from transformers import AutoModelForCausalLM
directory, ids = sys.argv[1], json.loads(sys.argv[2])
model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
with torch.no_grad():
    print(json.dumps([model(torch.tensor([row])).logits[0].tolist() for row in ids]))
"""


def greedy_answers(directory: Path, problems, tokenizer) -> list[str]:
    """The greedy answers of the model in ``directory`` to ``problems`` (chat prompts, at most 64 new ids)."""
    model, variables = load_pretrained(directory)
    server = Server(model, variables, Sampling(temperature=0.0, eos_id=tokenizer.eos_token_id), slots=64,
                    capacity=160, dtype=jnp.bfloat16)
    numbers = {}  # request -> the problem's index (tasks hold dicts: not hashable)
    for index, task in enumerate(problems):
        ids = tokenizer.apply_chat_template(task.row()["prompt"], tokenize=True, add_generation_prompt=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        numbers[server.submit(ids, 64)] = index
    answers = [""] * len(problems)
    while server.busy:
        for done in server.step():
            answers[numbers[done.request]] = tokenizer.decode(done.ids, skip_special_tokens=True)
    return answers


def behaviour(directory: Path, problems, tokenizer) -> dict:
    """Greedy answers of the model in ``directory`` to ``problems``: the share right and the share closing with
    the reference answers' sentence."""
    answers = greedy_answers(directory, problems, tokenizer)
    reward = LastNumberReward()
    right = [reward(task.data_source, answer, task.ground_truth, "") for task, answer in zip(problems, answers)]
    closing = [bool(CLOSING_PATTERN.search(answer)) for answer in answers]
    return {"right": float(np.mean(right)), "closing": float(np.mean(closing)), "example": answers[0],
            "length": float(np.mean([len(tokenizer.encode(answer)) for answer in answers]))}


def write_data(folder: Path, tasks, own: list[str] | None) -> tuple[Path, Path]:
    """The SFT conversations and the DPO pairs of ``tasks``. The rejected answer is the reference one number off,
    or, given ``own`` (the starting model's greedy answers), the model's own answer wherever it differs from the
    reference: pairs against what the policy writes itself."""
    sft, dpo = folder / "sft.jsonl", folder / "dpo.jsonl"
    with open(sft, "w") as file:
        for task in tasks:
            file.write(json.dumps({"messages": [*task.row()["prompt"], {"role": "assistant",
                                                                        "content": task.answer}]}) + "\n")
    rng = random.Random(0)
    with open(dpo, "w") as file:
        for index, task in enumerate(tasks):
            if own is None:
                wrong = str(int(task.ground_truth) + rng.choice((-1, 1)))
                rejected = task.answer.replace(f"= {task.ground_truth} ", f"= {wrong} ").replace(
                    f"{CLOSING}{task.ground_truth}.", f"{CLOSING}{wrong}.")
            elif own[index].strip() == task.answer.strip():
                continue
            else:
                rejected = own[index]
            file.write(json.dumps({"prompt": task.row()["prompt"],
                                   "chosen": [{"role": "assistant", "content": task.answer}],
                                   "rejected": [{"role": "assistant", "content": rejected}]}) + "\n")
    return sft, dpo


def stage(kind: str, model: Path, data: Path, out: Path, steps: int, learning_rate: float, seq_len: int,
          extra=(), dtype: str = "bfloat16") -> Path:
    command = [str(Path(sys.executable).parent / "dew-ray"), kind, "--model", str(model), "--data", str(data),
               "--steps", str(steps), "--set", f"output_dir={out}", "--set", f"learning_rate={learning_rate}",
               "--set", f"seq_len={seq_len}", "--set", "batch=8", "--set", f"dtype={dtype}", *extra]
    ran = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if ran.returncode != 0:
        raise RuntimeError(f"dew-ray {kind} failed:\n{ran.stdout[-2000:]}\n{ran.stderr[-3000:]}")
    return out / "policy"


def trl_stage(model: Path, data: Path, out: Path, steps: int, learning_rate: float, width: int) -> Path:
    command = [str(PEER_PYTHON), str(ROOT / "bench" / "peers" / "trl_dpo_pairs.py"), str(model), str(data), str(out),
               "--steps", str(steps), "--learning-rate", str(learning_rate), "--beta", str(DPO_BETA),
               "--max-length", str(width)]
    ran = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if ran.returncode != 0:
        raise RuntimeError(f"TRL's DPOTrainer failed:\n{ran.stderr[-3000:]}")
    print("TRL DPOTrainer:", ran.stdout.strip().splitlines()[-1], flush=True)
    return out


def transformers_logits_difference(directory: Path, tokenizer, prompts: list[str]) -> float:
    """The largest difference between dew's logits and transformers' on the exported directory (float32)."""
    ids = [tokenizer(text)["input_ids"] for text in prompts]
    model, variables = load_pretrained(directory)
    ours = [np.asarray(model.apply(variables, jnp.asarray([row])))[0] for row in ids]
    ran = subprocess.run([str(PEER_PYTHON), "-c", TRANSFORMERS_SIDE, str(directory), json.dumps(ids)],
                         capture_output=True, text=True, cwd=ROOT)
    if ran.returncode != 0:
        raise RuntimeError(f"transformers could not read {directory}:\n{ran.stderr[-3000:]}")
    theirs = json.loads(ran.stdout.strip().splitlines()[-1])
    return max(float(np.abs(a - np.asarray(b)).max()) for a, b in zip(ours, theirs))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sft-steps", type=int, default=40)
    parser.add_argument("--dpo-steps", type=int, default=40)
    parser.add_argument("--sft-learning-rate", type=float, default=2e-5)
    parser.add_argument("--dpo-learning-rate", type=float, default=5e-6)
    parser.add_argument("--dpo-dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="what dew-ray dpo computes in (TRL's peer runs float32)")
    parser.add_argument("--stages", nargs="+", choices=["sft", "dpo", "sft-dpo", "trl-dpo", "sft-trl-dpo"],
                        default=["sft", "dpo"])
    parser.add_argument("--pairs", choices=["one-off", "own"], default="one-off",
                        help="DPO's rejected answers: the reference one number off, or the model's own greedy "
                             "answers to the training problems")
    parser.add_argument("--skip-transformers", action="store_true", help="no reference environment: skip that check")
    args = parser.parse_args(argv)
    if args.pairs == "own" and {"sft-dpo", "sft-trl-dpo"} & set(args.stages):
        parser.error("--pairs own takes the model as built's answers: run it with --stages dpo trl-dpo")
    model = smollm2.build(quiet=True)
    tokenizer = AutoTokenizer.from_pretrained(model)
    held_out = verifiable_tasks(64, seed=1_000_000, families=["word"], split=HELD_OUT)
    RESULTS.mkdir(parents=True, exist_ok=True)
    results = {}
    with tempfile.TemporaryDirectory(prefix="dew-smollm2-stages-") as scratch:
        scratch = Path(scratch)
        tasks = verifiable_tasks(256, seed=0, families=["word"])
        own = greedy_answers(model, tasks, tokenizer) if args.pairs == "own" else None
        sft_data, dpo_data = write_data(scratch, tasks, own)
        print("DPO pairs:", sum(1 for _ in open(dpo_data)), f"({args.pairs})", flush=True)
        results["model as built"] = behaviour(model, held_out, tokenizer)
        print("model as built:", results["model as built"], flush=True)
        policies = {}
        own_pairs = "" if args.pairs == "one-off" else ", own answers rejected"
        width = DPO_WIDTH[args.pairs]
        precision = ("" if args.dpo_dtype == "bfloat16" else f", {args.dpo_dtype}") + own_pairs
        dpo = lambda start, out: stage("dpo", start, dpo_data, scratch / out, args.dpo_steps,  # noqa: E731
                                       args.dpo_learning_rate, width, ("--set", f"beta={DPO_BETA}"),
                                       args.dpo_dtype)
        if {"sft", "sft-dpo", "sft-trl-dpo"} & set(args.stages):
            sft = stage("sft", model, sft_data, scratch / "sft", args.sft_steps, args.sft_learning_rate, 127)
            policies[f"after dew-ray sft (lr {args.sft_learning_rate:g})"] = sft
        if "dpo" in args.stages:
            policies[f"after dew-ray dpo (lr {args.dpo_learning_rate:g}{precision})"] = dpo(model, "dpo")
        if "sft-dpo" in args.stages:
            name = f"after dew-ray sft, then dew-ray dpo (lr {args.dpo_learning_rate:g}{precision})"
            policies[name] = dpo(sft, "sft-dpo")
        if "trl-dpo" in args.stages:
            policies[f"after TRL DPOTrainer (lr {args.dpo_learning_rate:g}{own_pairs})"] = trl_stage(
                model, dpo_data, scratch / "trl-dpo", args.dpo_steps, args.dpo_learning_rate, width)
        if "sft-trl-dpo" in args.stages:
            policies[f"after dew-ray sft, then TRL DPOTrainer (lr {args.dpo_learning_rate:g})"] = trl_stage(
                sft, dpo_data, scratch / "sft-trl-dpo", args.dpo_steps, args.dpo_learning_rate, width)
        prompts = ["The capital of France is",
                   tokenizer.apply_chat_template(held_out[0].row()["prompt"], tokenize=False, add_generation_prompt=True),
                   held_out[1].answer]
        for name, policy in policies.items():
            results[name] = behaviour(policy, held_out, tokenizer)
            if not args.skip_transformers:
                results[name]["transformers_logit_difference"] = transformers_logits_difference(policy, tokenizer,
                                                                                                prompts)
            print(f"{name}:", results[name], flush=True)
    stem = "smollm2_stages" if args.stages == ["sft", "dpo"] else f"smollm2_stages_{'_'.join(args.stages)}"
    stem += "" if args.dpo_dtype == "bfloat16" else f"_{args.dpo_dtype}"
    stem += "" if args.pairs == "one-off" else "_own"
    (RESULTS / f"{stem}.json").write_text(json.dumps(results, indent=2))
    print("\n| model | right (greedy, 64 held-out) | ends with \"The answer is N.\" | mean answer ids | "
          "transformers logit difference |\n| --- | --- | --- | --- | --- |")
    for name, row in results.items():
        difference = row.get("transformers_logit_difference")
        print(f"| {name} | {row['right']:.3f} | {row['closing']:.3f} | {row['length']:.1f} | "
              f"{'' if difference is None else f'{difference:.1e}'} |")
    plot(results, stem)
    return 0


def plot(results: dict, name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    figure, axis = plt.subplots(figsize=(max(7.0, 1.35 * len(names)), 3.8))
    x = np.arange(len(names))
    axis.bar(x - 0.2, [results[n]["right"] for n in names], 0.4, label="answered right")
    axis.bar(x + 0.2, [results[n]["closing"] for n in names], 0.4, label='ends "The answer is N."')
    axis.set_xticks(x, ["\n".join(textwrap.wrap(n, 16)) for n in names], fontsize=8)
    axis.set_ylim(0, 1)
    axis.set_ylabel("share of 64 held-out problems (greedy)")
    peer = ", TRL's DPOTrainer" if any("TRL" in n for n in names) else ""
    axis.set_title(f"SmolLM2-135M-Instruct: dew-ray sft and dpo{peer}")
    axis.legend(loc="upper left")
    figure.tight_layout()
    figure.savefig(RESULTS / f"{name}.png", dpi=120)


if __name__ == "__main__":
    sys.exit(main())
