"""An OpenAI-compatible HTTP front for a RolloutServer (standard library ``http.server``).

Routes:

- ``GET /health``: ``{"status": "ok", "version": v}``;
- ``GET /v1/models``: the one served model;
- ``POST /v1/completions``: token-id prompts (one list of ids, or a list of them) or text
  (with a tokenizer), ``max_tokens``, ``seed``, ``logprobs``. Sampled ids come back the
  way vLLM returns them with ``return_tokens_as_token_ids``: ``logprobs.tokens`` holds
  ``"token_id:<id>"`` strings, ``logprobs.token_logprobs`` the behaviour log-probabilities
  (the distribution each id was drawn from), and the extension ``dew`` field the raw
  policy log-probabilities and the policy version;
- ``POST /v1/chat/completions``: ``messages`` (and ``tools``) through the tokenizer's chat
  template with the generation header; the reply is the decoded assistant text.

The served Sampling is fixed when the server is built: a request may repeat its
controls (``temperature``, ``top_k``, ``top_p``, ``min_p``) but not change them, and one
that does gets a 400. Bad requests (empty prompts, ids outside the vocabulary, budgets
beyond the cache) get a 400 that names the problem and never reach a slot. The front
binds to 127.0.0.1 unless told otherwise and has no authentication.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from dew.inference.rollout import NativeRolloutServer

SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p")


class RequestError(ValueError):
    """A request the front refuses with 400."""


class OpenAIFront:
    """Serves a NativeRolloutServer over HTTP on a background thread; ``url`` is its base address."""

    def __init__(self, rollout: NativeRolloutServer, tokenizer=None, host: str = "127.0.0.1", port: int = 0,
                 model_name: str = "dew", timeout: float = 600.0):
        self.rollout, self.tokenizer, self.model_name, self.timeout = rollout, tokenizer, model_name, timeout
        front = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's naming)
                front._dispatch(self, "GET")

            def do_POST(self):  # noqa: N802
                front._dispatch(self, "POST")

            def log_message(self, *args):  # requests are not logged to stderr
                pass

        self._http = ThreadingHTTPServer((host, port), Handler)
        self._http.daemon_threads = True
        self._thread = threading.Thread(target=self._http.serve_forever, name="dew-openai-front", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self._http.server_address[:2]
        return f"http://{host}:{port}"

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()
        self._thread.join(timeout=10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ----- routing -------------------------------------------------------------------------

    def _dispatch(self, handler: BaseHTTPRequestHandler, method: str) -> None:
        routes = {
            ("GET", "/health"): lambda body: {"status": "ok", "version": self.rollout.version},
            ("GET", "/v1/models"): lambda body: {
                "object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "dew"}]},
            ("POST", "/v1/completions"): self.completions,
            ("POST", "/v1/chat/completions"): self.chat_completions,
        }
        route = routes.get((method, handler.path.split("?")[0]))
        try:
            if route is None:
                raise LookupError(f"no route {method} {handler.path}")
            body = {}
            if method == "POST":
                length = int(handler.headers.get("Content-Length") or 0)
                try:
                    body = json.loads(handler.rfile.read(length) or b"{}")
                except json.JSONDecodeError as error:
                    raise RequestError(f"the body is not JSON ({error})") from None
                if not isinstance(body, dict):
                    raise RequestError("the body must be a JSON object")
            status, reply = 200, route(body)
        except LookupError as error:
            status, reply = 404, _error(str(error), "not_found")
        except (RequestError, ValueError, TypeError) as error:
            status, reply = 400, _error(str(error), "invalid_request_error")
        except Exception as error:  # the engine failed: the client learns why, the server keeps going
            status, reply = 500, _error(f"{type(error).__name__}: {error}", "server_error")
        data = json.dumps(reply).encode()
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    # ----- endpoints -----------------------------------------------------------------------

    def _check_sampling(self, body: dict) -> None:
        served = self.rollout.server.sampling
        for field in SAMPLING_FIELDS:
            if body.get(field) is not None and body[field] != getattr(served, field):
                raise RequestError(
                    f"{field}={body[field]!r} differs from the served sampling ({field}={getattr(served, field)!r}); "
                    "this server's sampling is fixed when it starts"
                )
        if body.get("n", 1) != 1:
            raise RequestError("n must be 1: ask again with another seed for more samples")

    def _budget(self, body: dict) -> int:
        budget = body.get("max_tokens", 16)
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise RequestError(f"max_tokens must be a positive integer, got {budget!r}")
        return budget

    def _draw(self, ids: list[int], budget: int, seed: int):
        return self.rollout.submit(ids, budget, seed=seed).result(timeout=self.timeout)

    def completions(self, body: dict) -> dict:
        self._check_sampling(body)
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            prompts = [self._encode(prompt)]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
            prompts = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
            prompts = prompt
        else:
            raise RequestError("prompt must be a string, a list of token ids or a list of such lists")
        budget, seed = self._budget(body), int(body.get("seed") or 0)
        futures = [self.rollout.submit(ids, budget, seed=seed) for ids in prompts]
        choices = []
        for index, future in enumerate(futures):
            draw = future.result(timeout=self.timeout)
            choice = {"index": index, "text": self._decode(draw.ids), "finish_reason": _reason(draw)}
            if body.get("logprobs") is not None:
                choice["logprobs"] = {
                    "tokens": [f"token_id:{i}" for i in draw.ids], "token_logprobs": draw.behavior_log_probs,
                    "top_logprobs": None, "text_offset": [],
                }
            choice["dew"] = {"token_ids": draw.ids, "raw_logprobs": draw.old_log_probs, "version": draw.version}
            choices.append(choice)
        tokens = sum(len(c["dew"]["token_ids"]) for c in choices)
        return {
            "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": self.model_name, "choices": choices,
            "usage": {"prompt_tokens": sum(map(len, prompts)), "completion_tokens": tokens,
                      "total_tokens": sum(map(len, prompts)) + tokens},
        }

    def chat_completions(self, body: dict) -> dict:
        self._check_sampling(body)
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise RequestError("chat completions need a tokenizer with a chat template; this server has none")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise RequestError("messages must be a non-empty list of objects with a 'role'")
        text = self.tokenizer.apply_chat_template(messages, tools=body.get("tools"), tokenize=False,
                                                  add_generation_prompt=True)
        ids = self._encode(text)
        draw = self._draw(ids, self._budget(body), int(body.get("seed") or 0))
        content = self._decode([i for i in draw.ids if i not in self.rollout.server.sampling.eos_ids])
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": self.model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": _reason(draw),
                         "dew": {"token_ids": draw.ids, "logprobs": draw.behavior_log_probs,
                                 "raw_logprobs": draw.old_log_probs, "version": draw.version}}],
            "usage": {"prompt_tokens": len(ids), "completion_tokens": len(draw.ids), "total_tokens": len(ids) + len(draw.ids)},
        }

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise RequestError("text prompts need a tokenizer; this server has none, so send token ids")
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""


def _reason(draw) -> str:
    return {"stop": "stop", "length": "length"}.get(draw.finish_reason, "abort")


def _error(message: str, kind: str) -> dict:
    return {"error": {"message": message, "type": kind}}
