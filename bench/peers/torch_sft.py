"""Peer for bench/sft_step.py: a plain torch training loop on transformers' Qwen3 (run in .venv-ref).

float32, no gradient checkpointing. Prints one JSON line: {"steps_per_second", "peak_rss_gib", "torch",
"transformers"}.
"""

import json
import resource
import sys
import time

import torch
import transformers
from transformers import Qwen3Config, Qwen3ForCausalLM


def main(steps: int, rows: int, width: int, threads: int) -> None:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=8192, hidden_size=384, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2,
        head_dim=64, intermediate_size=1024, tie_word_embeddings=True, max_position_embeddings=width,
    )
    model = Qwen3ForCausalLM(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.randint(0, 8192, (rows, width + 1))

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
                      "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:5]))
