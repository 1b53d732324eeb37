"""Peer for bench/chat_loader.py: TRL's SFT tokenization of a JSONL of conversations (run in .venv-ref).

Tokenizes every row as TRL's SFTTrainer does for conversational data with
assistant_only_loss=True (trl.data_utils._tokenize with return_assistant_tokens_mask),
single process, and prints {"conversations_per_second": ..., "trl": version} as JSON.
"""

import json
import sys
import time
from pathlib import Path

import trl
from trl.data_utils import _tokenize

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from qwen3_vocab import qwen3_tokenizer  # noqa: E402


def main(path: str) -> None:
    tokenizer = qwen3_tokenizer()
    rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
    start = time.perf_counter()
    for row in rows:
        out = _tokenize(tokenizer, row["messages"], tools=row.get("tools"), return_assistant_tokens_mask=True)
        assert 1 in out["assistant_masks"]
    rate = len(rows) / (time.perf_counter() - start)
    print(json.dumps({"conversations_per_second": rate, "trl": trl.__version__}))


if __name__ == "__main__":
    main(sys.argv[1])
