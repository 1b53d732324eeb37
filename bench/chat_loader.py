"""ChatMessages throughput: conversations per second against TRL's tokenization of the same file.

Writes a JSONL of multi-turn conversations (system prompt, two to four user/assistant
exchanges, some with a tool call and its result), then measures, interleaved:

- dew: ChatMessages reading the file and encoding every conversation (ids and roles
  by prefix rendering, with the prefix check) and packing rows, with 1 and 2 threads;
- TRL 1.16 (bench/peers/trl_chat_tokenize.py in .venv-ref): apply_chat_template with
  return_assistant_tokens_mask per conversation, as its SFTTrainer does.

Both use the real Qwen vocabulary with TRL's qwen3_training.jinja (tools/qwen3_vocab.py).

    uv run python bench/chat_loader.py [--conversations 400] [--rounds 3]

Prints a table and writes bench/results/chat_loader.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEER_PYTHON = ROOT / ".venv-ref" / "bin" / "python"
sys.path.insert(0, str(ROOT / "tools"))
from qwen3_vocab import qwen3_tokenizer  # noqa: E402

from dew.data import ChatMessages, Loading  # noqa: E402

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Temperature in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CITIES = ("Paris", "Oslo", "Rome", "Lima", "Kyoto", "Cairo")


def conversation(rng: random.Random) -> dict:
    messages = [{"role": "system", "content": "You are a helpful assistant. Answer briefly."}]
    tools = None
    for turn in range(rng.randint(2, 4)):
        city = rng.choice(CITIES)
        messages.append({"role": "user", "content": f"Question {turn}: how is the weather in {city} today, and why?"})
        if rng.random() < 0.3:
            tools = [WEATHER]
            messages.append({"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}]})
            messages.append({"role": "tool", "content": json.dumps({"celsius": rng.randint(-5, 35)})})
        words = " ".join(rng.choice(("sunny", "mild", "windy", "cold", "warm", "clear", "rain")) for _ in range(30))
        messages.append({"role": "assistant", "content": f"In {city} it is {words}."})
    return {"messages": messages, **({"tools": tools} if tools else {})}


def dew_rate(path: Path, tokenizer_dir: Path, threads: int) -> float:
    start = time.perf_counter()
    chat = ChatMessages(tokenizer=str(tokenizer_dir), path=path, seq_len=2047,
                        loading=Loading(threads=threads, read_buffer=4))
    chat.load(batch=1)
    return len(chat.records) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rng = random.Random(0)
    rates: dict[str, list[float]] = {"dew, 1 thread": [], "dew, 2 threads": [], "TRL": []}
    trl_version = None
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "conversations.jsonl"
        path.write_text("".join(json.dumps(conversation(rng)) + "\n" for _ in range(args.conversations)))
        tokenizer_dir = Path(scratch) / "tokenizer"
        qwen3_tokenizer().save_pretrained(tokenizer_dir)
        for index in range(args.rounds):
            rates["dew, 1 thread"].append(dew_rate(path, tokenizer_dir, 1))
            rates["dew, 2 threads"].append(dew_rate(path, tokenizer_dir, 2))
            if PEER_PYTHON.exists():
                out = subprocess.run([str(PEER_PYTHON), str(ROOT / "bench" / "peers" / "trl_chat_tokenize.py"), str(path)],
                                     capture_output=True, text=True, check=True)
                peer = json.loads(out.stdout.strip().splitlines()[-1])
                rates["TRL"].append(peer["conversations_per_second"])
                trl_version = peer["trl"]
            print(f"round {index + 1}/{args.rounds}: " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in rates.items() if v))
    medians = {name: statistics.median(values) for name, values in rates.items() if values}
    peer = medians.get("TRL")
    print(f"\nChat loading, {args.conversations} conversations (Qwen3 vocabulary and template), 2 CPU cores")
    print(f"{'implementation':<16} {'conversations/s':>16} {'vs TRL':>8}")
    for name, rate in medians.items():
        print(f"{name:<16} {rate:>16.0f} {(f'{rate / peer:.2f}x' if peer else '-'):>8}")
    if peer is None:
        print("(no peer: create .venv-ref as the README describes to measure TRL)")
    results = ROOT / "bench" / "results"
    results.mkdir(parents=True, exist_ok=True)
    (results / "chat_loader.json").write_text(json.dumps({"rates": rates, "medians": medians, "trl": trl_version}, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 2.6))
    names = list(medians)
    axis.barh(names, [medians[n] for n in names], color=["#4477aa", "#66ccee", "#bbbbbb"][: len(names)])
    axis.set_xlabel("conversations per second (higher is better)")
    axis.set_title("Chat tokenization with assistant masks")
    figure.tight_layout()
    figure.savefig(results / "chat_loader.png", dpi=120)
    print(f"wrote {results / 'chat_loader.json'} and {results / 'chat_loader.png'}")


if __name__ == "__main__":
    main()
