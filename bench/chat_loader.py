"""ChatMessages throughput: conversations per second against TRL's tokenization of the same file.

Writes a JSONL of multi-turn conversations (system prompt, two to four user/assistant
exchanges, some with a tool call and its result), then measures, each in a fresh
process, interleaved round by round:

- dew: ChatMessages reading the file and encoding every conversation (every prefix
  rendered, each checked to start the next render and to end on a token boundary of
  the full render, which is tokenized once) and packing rows, with 1 and 2 threads
  and with ``Loading(workers=2)`` (two spawned processes, their start included);
- TRL 1.16 (bench/peers/trl_chat_tokenize.py in .venv-ref): apply_chat_template with
  return_assistant_tokens_mask per conversation, as its SFTTrainer does.

Both use the real Qwen vocabulary with TRL's qwen3_training.jinja (tools/qwen3_vocab.py)
and load the tokenizer before their clock starts.

    uv run python bench/chat_loader.py [--conversations 400] [--rounds 3]

Prints a table and writes bench/results/chat_loader.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

from interleaved import PEER_PYTHON, RESULTS, ROOT, bar_plot, medians, run_rounds

sys.path.insert(0, str(ROOT / "tools"))
from qwen3_vocab import qwen3_tokenizer  # noqa: E402

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


def dew_worker(path: Path, tokenizer_dir: Path, threads: int, workers: int) -> None:
    import jax  # noqa: F401  a dew run has JAX loaded (load() asks it for the process index); not on the clock

    from dew.data import ChatMessages, Loading
    from dew.data.chat import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    start = time.perf_counter()
    chat = ChatMessages(tokenizer=tokenizer, path=path, seq_len=2047,
                        loading=Loading(threads=threads, workers=workers, read_buffer=4))
    chat.load(batch=1)
    print(json.dumps({"conversations_per_second": len(chat.records) / (time.perf_counter() - start)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", nargs=4, metavar=("PATH", "TOKENIZER", "THREADS", "WORKERS"))
    args = parser.parse_args()
    if args.worker:
        path, tokenizer_dir, threads, workers = args.worker
        dew_worker(Path(path), Path(tokenizer_dir), int(threads), int(workers))
        return
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "conversations.jsonl"
        path.write_text("".join(json.dumps(conversation(rng)) + "\n" for _ in range(args.conversations)))
        tokenizer_dir = Path(scratch) / "tokenizer"
        qwen3_tokenizer().save_pretrained(tokenizer_dir)
        me = [sys.executable, __file__, "--worker", str(path), str(tokenizer_dir)]
        commands = {"dew, 1 thread": me + ["1", "0"], "dew, 2 threads": me + ["2", "0"], "dew, 2 workers": me + ["1", "2"]}
        if PEER_PYTHON.exists():
            commands["TRL"] = [str(PEER_PYTHON), "bench/peers/trl_chat_tokenize.py", str(path)]
        records = run_rounds(commands, args.rounds, show="conversations_per_second")
    trl_version = next((r[0]["trl"] for r in records.values() if "trl" in r[0]), None)
    table = medians(records, ("conversations_per_second",))
    peer = table.get("TRL", {}).get("conversations_per_second")
    print(f"\nChat loading, {args.conversations} conversations (Qwen3 vocabulary and template), 2 CPU cores, "
          f"medians of {args.rounds} rounds")
    print(f"{'implementation':<16} {'conversations/s':>16} {'vs TRL':>8}")
    for name, m in table.items():
        rate = m["conversations_per_second"]
        print(f"{name:<16} {rate:>16.0f} {(f'{rate / peer:.2f}x' if peer else '-'):>8}")
    if peer is None:
        print("(no peer: create .venv-ref as docs/benchmarks.md describes to measure TRL)")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "chat_loader.json").write_text(json.dumps({"records": records, "medians": table, "trl": trl_version},
                                                         indent=2))
    bar_plot(RESULTS / "chat_loader.png", "Chat tokenization with assistant masks",
             [("conversations_per_second", "conversations per second (higher is better)")], records)
    print(f"wrote {RESULTS / 'chat_loader.json'} and {RESULTS / 'chat_loader.png'}")


if __name__ == "__main__":
    main()
