"""Load test: ``dew-ray serve``'s OpenAI front and the pipeline's rollout path at several times their concurrency.

Front: a ``dew-ray serve`` process (the built-in story decoder, ``--slots`` slots, loopback
only) gets ``requests`` chat completions from ``concurrency`` client threads at once
(``concurrency`` / slots times what its slots hold), in waves. Every request asks for
``return_token_ids`` and has its own conversation (two vocabulary words unique to it), so
its reply's ``prompt_token_ids`` say whose answer it is; every ``bad_every``-th request
asks for more tokens than the cache holds and must get a 400 naming that. Checked: no
request lost (a reply for each, within the time bound), none answered with another's
prompt, no reply id seen twice, every error an HTTP error whose JSON has a message; the
server's resident memory after each wave and its peak (VmHWM) are reported, with p50 and
p99 latency of the good requests.

Rollout path: the RLVR pipeline's draws go from the scheduler through a ServerPool to
RolloutServerActors (``dew_ray.actors``). ``draws`` draws are submitted at once to a pool
of ``servers`` actors of ``slots`` slots each, and each must resolve once to the Draw an
unloaded in-process server gives for the same prompt and seed (the decoder is sharp, so
batching's rounding does not move a sample). Reported: lost, wrong, p50/p99 latency from
submission, and the actors' peak resident memory.

    uv run python bench/load.py [--requests 2000] [--concurrency 64] [--draws 2000]

Prints a table and writes bench/results/load.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import ray

from dew import models
from dew.data.stories import story_tokenizer
from dew.inference import NativeRolloutServer, Server, ServingTask
from dew.inference.engines import free_port
from dew.sampling import Sampling
from dew_ray.actors import start_rollout_servers

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


# ----- memory of a process ------------------------------------------------------------------------------------


def memory_mib(pid: int) -> dict[str, float]:
    """Resident (VmRSS) and peak resident (VmHWM) memory of process ``pid``, MiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0]) / 1024
    return {"rss": fields["VmRSS"], "peak": fields["VmHWM"]}


def percentiles(latencies: list[float]) -> dict[str, float | None]:
    if not latencies:
        return {"p50": None, "p99": None}
    return {"p50": float(np.percentile(latencies, 50)), "p99": float(np.percentile(latencies, 99))}


# ----- the front ------------------------------------------------------------------------------------------------


class ServeProcess:
    """``dew-ray serve`` in a child process on a free loopback port; a context manager."""

    def __init__(self, slots: int, capacity: int):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "dew_ray.cli", "serve", "--port", str(self.port), "--slots", str(slots),
                   "--capacity", str(capacity)]
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
        self.process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"dew-ray serve exited with {self.process.returncode}: {self.process.stdout.read()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.3)
        self.close()
        raise RuntimeError("dew-ray serve did not answer /health within 120 s")

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def conversations(tokenizer, count: int) -> list[list[dict]]:
    """``count`` one-message conversations, each with its own pair of vocabulary words."""
    words = sorted(word for word in tokenizer.get_vocab() if word.isalpha() and word.islower())
    if len(words) ** 2 < count:
        raise ValueError(f"{count} requests need more than {len(words)}^2 distinct word pairs")
    return [[{"role": "user", "content": f"{words[i % len(words)]} {words[i // len(words)]}"}] for i in range(count)]


def front_wave(url: str, tokenizer, first: int, requests: int, concurrency: int, capacity: int, max_tokens: int,
               bad_every: int, timeout: float) -> dict:
    """One wave of ``requests`` chat completions (numbered from ``first``) from ``concurrency`` threads."""
    chats = conversations(tokenizer, first + requests)[first:]
    expected = [list(tokenizer.encode(tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True),
                                      add_special_tokens=False)) for chat in chats]

    def one(index: int) -> dict:
        bad = bad_every > 0 and (first + index) % bad_every == 0
        body = {"messages": chats[index], "max_tokens": capacity * 2 if bad else max_tokens,
                "seed": first + index, "return_token_ids": True}
        request = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        began = time.perf_counter()
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                status, reply = response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            status, reply = error.code, json.loads(error.read() or b"null")
        except OSError as error:  # connection refused or reset, timed out: the request is lost
            return {"index": index, "bad": bad, "lost": f"{type(error).__name__}: {error}"}
        return {"index": index, "bad": bad, "status": status, "reply": reply, "seconds": time.perf_counter() - began}

    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, range(requests)))
    lost = [r for r in results if "lost" in r]
    answered = [r for r in results if "lost" not in r]
    good = [r for r in answered if not r["bad"]]
    wrong = [r for r in good if r["status"] != 200 or r["reply"].get("prompt_token_ids") != expected[r["index"]]]
    ids = [r["reply"]["id"] for r in good if r["status"] == 200]
    refused = [r for r in answered if r["bad"]]
    unnamed = [r for r in answered if r["status"] != 200 and not (
        isinstance(r["reply"], dict) and r["reply"].get("error", {}).get("message"))]
    misrefused = [r for r in refused if r["status"] != 400 or "exceeds the cache capacity" not in
                  r["reply"].get("error", {}).get("message", "")]
    return {"requests": requests, "good": len(good), "bad": len(refused), "lost": len(lost), "wrong": len(wrong),
            "duplicate_ids": len(ids) - len(set(ids)), "unnamed_errors": len(unnamed),
            "misrefused": len(misrefused), "statuses": sorted({r["status"] for r in answered}),
            "latencies": [r["seconds"] for r in good if r["status"] == 200],
            "lost_examples": [r["lost"] for r in lost[:3]]}


def front_load(requests: int, concurrency: int, waves: int = 2, slots: int = 8, capacity: int = 128,
               max_tokens: int = 16, bad_every: int = 10, timeout: float = 300.0) -> dict:
    """Waves of requests against a fresh ``dew-ray serve``; totals, latency and the server's memory per wave."""
    tokenizer = story_tokenizer()
    with ServeProcess(slots, capacity) as serve:
        front_wave(serve.url, tokenizer, 0, slots, slots, capacity, max_tokens, 0, timeout)  # compile, warm up
        memory = [memory_mib(serve.process.pid)]
        totals: dict = {}
        latencies: list[float] = []
        began = time.perf_counter()
        for wave in range(waves):
            result = front_wave(serve.url, tokenizer, slots + wave * requests, requests, concurrency, capacity,
                                max_tokens, bad_every, timeout)
            latencies += result.pop("latencies")
            for name, value in result.items():
                totals[name] = sorted(set(totals.get(name, [])) | set(value)) if isinstance(value, list) else \
                    totals.get(name, 0) + value
            memory.append(memory_mib(serve.process.pid))
        seconds = time.perf_counter() - began
    return {**totals, "slots": slots, "concurrency": concurrency, "waves": waves, "seconds": seconds,
            "requests_per_second": totals["requests"] / seconds, **percentiles(latencies),
            "rss_mib": [round(m["rss"], 1) for m in memory], "peak_rss_mib": round(memory[-1]["peak"], 1)}


# ----- the rollout path -----------------------------------------------------------------------------------------


def sharp_decoder(width: int = 64):
    """(model, variables): a small decoder whose weights are scaled up, so a sample does not depend on batching's
    rounding (greedy choices far from ties); the same weights every call. The tests' ``sharp_decoder`` too."""
    model = models.build("causal_transformer", vocab_size=32, emb_features=32, num_layers=2, num_heads=4,
                         num_kv_heads=2, mlp_features=64, max_seq_len=width)
    variables = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    return model, jax.tree.map(lambda x: x * 3, variables)


def sharp_task(width: int = 64) -> ServingTask:
    """The sharp decoder, sampled at temperature 1 from the 8 likeliest ids, without an EOS."""
    return ServingTask(*sharp_decoder(width), Sampling(temperature=1.0, top_k=8))


def rollout_load(task, draws: int, servers: int, slots: int, capacity: int = 64, budget: int = 8,
                 timeout: float = 600.0) -> dict:
    """``draws`` draws submitted at once to a pool of ``servers`` RolloutServerActors (on the running Ray cluster),
    each checked against an unloaded in-process server's draw of the same prompt and seed."""
    prompts = [[1 + (i * 7 + j) % 30 for j in range(2 + i % 5)] for i in range(draws)]
    with NativeRolloutServer(Server.from_task(task, slots=slots, capacity=capacity)) as local:
        reference = [local.submit(p, budget, seed=i) for i, p in enumerate(prompts)]
        reference = [future.result(timeout) for future in reference]
    pool = start_rollout_servers(task, servers, slots=slots, capacity=capacity, num_cpus=0.5)
    try:
        pool.submit(prompts[0], budget, seed=0).result(timeout)  # compiled on one server; the others compile in load
        settled = [0] * draws
        finished = [0.0] * draws
        lock = threading.Lock()

        def settle(index):
            def done(_future):
                with lock:
                    settled[index] += 1
                    finished[index] = time.perf_counter()
            return done

        began = time.perf_counter()
        futures = []
        for i, p in enumerate(prompts):
            future = pool.submit(p, budget, seed=i)
            future.add_done_callback(settle(i))
            futures.append(future)
        outcomes = []
        for future in futures:
            try:
                outcomes.append(future.result(timeout))
            except Exception as error:  # noqa: BLE001 - a failed draw is counted as lost, with its reason
                outcomes.append(error)
        seconds = time.perf_counter() - began
        # every actor runs on this machine (a local cluster), so its process's memory is readable here
        pids = ray.get([server.actor.__ray_call__.remote(lambda host: os.getpid()) for server in pool.servers])
        peaks = [memory_mib(pid)["peak"] for pid in pids]
    finally:
        pool.close()
        for server in pool.servers:
            ray.kill(server.actor)
    lost = [o for o in outcomes if isinstance(o, Exception)]
    wrong = [i for i, o in enumerate(outcomes) if not isinstance(o, Exception) and o.ids != reference[i].ids]
    return {"draws": draws, "servers": servers, "slots": slots, "in_flight_per_slot": draws / (servers * slots),
            "lost": len(lost), "wrong": len(wrong), "settled_twice": sum(1 for s in settled if s > 1),
            "unsettled": sum(1 for s in settled if s == 0), "seconds": seconds, "draws_per_second": draws / seconds,
            **percentiles([finished[i] - began for i in range(draws) if settled[i]]),
            "actor_peak_rss_mib": [round(p, 1) for p in peaks], "lost_examples": [repr(o) for o in lost[:3]]}


# ----- the command ----------------------------------------------------------------------------------------------


def plot(front: dict, rollout: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    left.plot(range(len(front["rss_mib"])), front["rss_mib"], marker="o")
    left.set_xticks(range(len(front["rss_mib"])))
    left.set_ylim(0, max(front["rss_mib"]) * 1.15)  # from zero: a growth that matters is visible, noise is not
    left.set_xlabel("wave (0: after warm-up)")
    left.set_ylabel("dew-ray serve RSS (MiB)")
    left.set_title(f"front: {front['requests']} requests, {front['concurrency']} at once")
    names = ["front p50", "front p99", "rollout p50", "rollout p99"]
    values = [front["p50"], front["p99"], rollout["p50"], rollout["p99"]]
    right.bar(names, [v or 0 for v in values])
    right.set_ylabel("seconds")
    right.set_title("latency")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000, help="front requests per wave")
    parser.add_argument("--waves", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=64, help="client threads (dew-ray serve has 8 slots)")
    parser.add_argument("--draws", type=int, default=2000, help="rollout-path draws submitted at once")
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--slots", type=int, default=8, help="slots per rollout server actor")
    args = parser.parse_args()

    front = front_load(args.requests, args.concurrency, waves=args.waves)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        rollout = rollout_load(sharp_task(), args.draws, args.servers, args.slots)
    finally:
        ray.shutdown()
    print(f"\nfront (dew-ray serve, {front['slots']} slots): {front['requests']} requests in {front['waves']} waves, "
          f"{front['concurrency']} at once ({front['concurrency'] / front['slots']:g}x the slots)")
    rows = [("answered good / bad", f"{front['good']} / {front['bad']}"), ("lost", front["lost"]),
            ("wrong prompt", front["wrong"]), ("duplicate reply ids", front["duplicate_ids"]),
            ("errors without a message", front["unnamed_errors"]), ("bad not refused with 400", front["misrefused"]),
            ("HTTP statuses", front["statuses"]), ("requests/s", f"{front['requests_per_second']:.1f}"),
            ("latency p50 / p99 (s)", f"{front['p50']:.3f} / {front['p99']:.3f}"),
            ("server RSS per wave (MiB)", front["rss_mib"]), ("server peak RSS (MiB)", front["peak_rss_mib"])]
    for name, value in rows:
        print(f"  {name:<28} {value}")
    print(f"\nrollout path ({rollout['servers']} RolloutServerActors x {rollout['slots']} slots): {rollout['draws']} "
          f"draws at once ({rollout['in_flight_per_slot']:g} per slot)")
    rows = [("lost", rollout["lost"]), ("differs from unloaded draw", rollout["wrong"]),
            ("settled twice / never", f"{rollout['settled_twice']} / {rollout['unsettled']}"),
            ("draws/s", f"{rollout['draws_per_second']:.1f}"),
            ("latency p50 / p99 (s)", f"{rollout['p50']:.3f} / {rollout['p99']:.3f}"),
            ("actor peak RSS (MiB)", rollout["actor_peak_rss_mib"])]
    for name, value in rows:
        print(f"  {name:<28} {value}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "load.json").write_text(json.dumps({"front": front, "rollout": rollout}, indent=2))
    plot(front, rollout, RESULTS / "load.png")
    print(f"\nwrote {RESULTS / 'load.json'} and {RESULTS / 'load.png'}")


if __name__ == "__main__":
    main()
