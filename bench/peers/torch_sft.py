"""Peer for bench/sft_step.py: a plain torch training loop on transformers' Qwen3 (run in .venv-ref).

float32, no gradient checkpointing; arguments: steps, rows, width, threads and the shape (bench/shapes.py).
Prints one JSON line: {"steps_per_second", "peak_rss_gib", "torch",
"transformers"}.
"""

import json
import sys
import time

import torch
import transformers
from qwen3_bench import bench_model, peak_rss_gib, vocab


def main(steps: int, rows: int, width: int, threads: int, shape: str = "bench") -> None:
    model = bench_model(width, threads, shape).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.randint(0, vocab(shape), (rows, width + 1))

    def step():
        out = model(input_ids=batch[:, :-1], labels=batch[:, :-1])
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    rate = steps / (time.perf_counter() - start)
    print(json.dumps({"steps_per_second": rate, "torch": torch.__version__, "transformers": transformers.__version__,
                      "peak_rss_gib": peak_rss_gib()}))


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:5]), *sys.argv[5:6])
