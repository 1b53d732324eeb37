"""Peer for bench/serve_throughput.py: transformers' generate on the same weights (run in .venv-ref).

Loads the checkpoint dew exported (Pretrained.save), then for each concurrency samples
128 new tokens (top-k 50, no EOS stop) for that many left-padded prompts in one
generate call, after one warm-up call, on 2 threads, in float32 or (4th argument) bfloat16. Prints {"<concurrency>": tokens
per second, ..., "transformers": version} as JSON.
"""

import json
import sys
import time

import torch
import transformers
from transformers import AutoModelForCausalLM


def main(directory: str, prompts_file: str, new_tokens: int, precision: str = "float32") -> None:
    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, precision)).eval()
    prompts = json.loads(open(prompts_file).read())
    results = {"transformers": transformers.__version__}
    for concurrency, rows in prompts.items():
        width = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, row in enumerate(rows):  # left padding, as generate expects for a decoder
            ids[i, width - len(row):] = torch.tensor(row)
            mask[i, width - len(row):] = 1
        kwargs = dict(attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True,
                      top_k=50, pad_token_id=0)
        with torch.no_grad():
            model.generate(ids, **kwargs)
            start = time.perf_counter()
            model.generate(ids, **kwargs)
        results[concurrency] = len(rows) * new_tokens / (time.perf_counter() - start)
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), *sys.argv[4:5])
