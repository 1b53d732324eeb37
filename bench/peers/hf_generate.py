"""Peer for bench/serve_throughput.py: transformers' generate on the same weights (run in .venv-ref).

Loads the checkpoint dew exported (Pretrained.save), then runs each workload of the
workloads file: its requests in batches of ``concurrency``, in order, each batch one
left-padded generate call (top-k 50, no EOS stop) of as many new tokens as the batch's
largest budget, after one untimed warm-up call on the first batch; on 2 threads, in
float32 or (4th argument) bfloat16. A batch runs until its longest request is done, as
generate does when its rows reach EOS at different steps, so only each request's budget
counts as generated. Prints {"<workload>": tokens per second, ..., "transformers":
version} as JSON.
"""

import json
import sys
import time

import torch
import transformers
from transformers import AutoModelForCausalLM


def generate(model, rows: list[list[int]], new_tokens: int) -> None:
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):  # left padding, as generate expects for a decoder
        ids[i, width - len(row):] = torch.tensor(row)
        mask[i, width - len(row):] = 1
    model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True,
                   top_k=50, pad_token_id=0)


def main(directory: str, workloads_file: str, precision: str = "float32") -> None:
    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, precision)).eval()
    workloads = json.loads(open(workloads_file).read())
    results = {"transformers": transformers.__version__}
    with torch.no_grad():
        for name, work in workloads.items():
            size = work["concurrency"]
            batches = [(work["prompts"][start:start + size], max(work["budgets"][start:start + size]))
                       for start in range(0, len(work["prompts"]), size)]
            generate(model, *batches[0])
            start = time.perf_counter()
            for batch in batches:
                generate(model, *batch)
            results[name] = sum(work["budgets"]) / (time.perf_counter() - start)
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *sys.argv[3:4])
