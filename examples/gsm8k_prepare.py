"""Turn a GSM8K file you already have into the verl rows ``dew-ray rlvr`` trains on (nothing is downloaded).

    uv run python examples/gsm8k_prepare.py train.parquet data/gsm8k/train.parquet
    uv run python examples/gsm8k_prepare.py test.jsonl data/gsm8k/test.parquet --split test

The input is GSM8K's own layout (``openai/gsm8k`` on the Hugging Face Hub, ``main``
configuration: a ``question`` and an ``answer`` ending in ``#### <number>``) as Parquet,
JSON lines or a directory ``datasets`` saved with ``save_to_disk``. Each output row is what
verl's ``examples/data_preprocess/gsm8k.py`` (v0.5) writes: ``data_source`` "openai/gsm8k",
``prompt`` one user message (the question and verl's instruction to end with ``####``),
``ability`` "math", ``reward_model`` ``{"style": "rule", "ground_truth": <the number>}`` and
``extra_info`` (split, index, the worked answer, the question). ``reward = "verifiable"``
scores these rows with verl's GSM8K rule (dew.sandbox.GSM8KReward).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from dew.data.loading import read_file

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
DATA_SOURCE = "openai/gsm8k"


def final_answer(solution: str, row: int) -> str:
    """The number after GSM8K's ``####`` (commas dropped), as verl's extract_solution reads it."""
    found = re.search("#### (\\-?[0-9\\.\\,]+)", solution)
    if found is None:
        raise ValueError(f"row {row}: the answer has no '#### <number>' line: {solution[-120:]!r}")
    return found.group(1).replace(",", "")


def verl_rows(records, split: str) -> list[dict]:
    """GSM8K records (``question``, ``answer``) as verl rows (see the module docstring)."""
    rows = []
    for index, record in enumerate(records):
        for column in ("question", "answer"):
            if not isinstance(record.get(column), str):
                raise ValueError(f"row {index}: GSM8K's {column!r} column is missing or not text (it has "
                                 f"{sorted(record)})")
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": f"{record['question']} {INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": final_answer(record["answer"], index)},
            "extra_info": {"split": split, "index": index, "answer": record["answer"],
                           "question": record["question"]},
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="GSM8K as Parquet, JSON lines or a save_to_disk directory")
    parser.add_argument("output", help="the verl-row Parquet file to write")
    parser.add_argument("--split", default="train", help="written into each row's extra_info (default: train)")
    args = parser.parse_args(argv)
    rows = verl_rows([record.fields for record in read_file(Path(args.source), "gsm8k_prepare")], args.split)
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), output)
    print(f"wrote {len(rows)} verl rows to {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
