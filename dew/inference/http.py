"""An OpenAI-compatible HTTP front for a NativeRolloutServer (standard library ``http.server``).

It answers what clients of vLLM's OpenAI server send (the official ``openai`` client among
them, tests/test_http.py):

- ``GET /health``: ``{"status": "ok", "version": v}``; ``GET /v1/models``: the one served model;
- ``POST /v1/completions``: token-id prompts (one list of ids, or a list of them) or text
  (with a tokenizer). Sampled ids come back the way vLLM returns them with
  ``return_tokens_as_token_ids``: ``logprobs.tokens`` holds ``"token_id:<id>"`` strings,
  ``logprobs.token_logprobs`` the behaviour log-probabilities (the distribution each id was
  drawn from, as vLLM's ``--logprobs-mode processed_logprobs``), and the extension ``dew``
  field the raw policy log-probabilities and the policy version;
- ``POST /v1/chat/completions``: ``messages`` (and ``tools``) through the tokenizer's chat
  template with the generation header; the reply is the decoded assistant text. With
  ``return_token_ids`` (vLLM's field, which rllm-model-gateway adds to every call) the reply
  carries ``prompt_token_ids`` and each choice's sampled ``token_ids`` (EOS included), streamed
  one id per chunk.

Per request: ``temperature``, ``top_p``, ``top_k`` (-1 or 0: none), ``min_p``, ``seed``,
``max_tokens``, ``stop`` (strings: the text is cut before the first one and the choice ends
with "stop"), ``n`` (n draws of the prompt, choice i seeded ``seed + i``), ``logprobs`` (a
number of alternatives per token for completions; ``logprobs: true`` and ``top_logprobs``
for chat; the alternatives are the request's own processed distribution, rescored on the
served weights once the draw ends) and ``stream: true`` (server-sent events in OpenAI's
chunk format, then ``data: [DONE]``). A request's sampling controls go into the compiled
step with its slot (``Server.submit``), so requests with different settings share a batch.
A ``model`` other than the served name gets a 404, as vLLM answers.

Not like vLLM: streamed chunks are sent when the draw ends, not as each token is drawn;
``n`` draws prefill the prompt once per draw (packed into one prefill call), not once; a
``stop`` string ends the text but not the decoding, which runs to EOS or the budget.

Bad requests (empty prompts, ids outside the vocabulary, budgets beyond the cache, controls
out of range) get a 400 that names the problem and never reach a slot.

Who gets in: the front binds to 127.0.0.1 unless told otherwise. ``api_keys`` guards it as
vLLM's ``--api-key`` does (``vllm/entrypoints/serve/middleware/authenticate.py`` in 0.32):
a request whose path starts with ``/v1`` must carry ``Authorization: Bearer <key>`` for one
of the keys (compared as SHA-256 digests in constant time) or gets 401 ``{"error":
"Unauthorized"}``; ``/health`` stays open. A front on any other address than loopback
without a key is refused when it is built, unless ``unauthenticated=True`` says so on
purpose: anyone who reaches the port could draw from the model.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import os
import time
import uuid
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler

import jax
import jax.numpy as jnp
import numpy as np

from dew.inference.background import BackgroundServer
from dew.inference.rollout_server import Draw, NativeRolloutServer
from dew.inference.wire import loopback
from dew.sampling import Sampling, filtered_logits

MAX_N = 64  # draws one request may ask for
MAX_ALTERNATIVES = 20  # vLLM's default cap on logprobs / top_logprobs
MAX_BODY_BYTES = 16 << 20  # a request body past this gets 413 before it is read
BODY_SECONDS = 60.0  # a client that sends less than its Content-Length is dropped after this long


class RequestError(ValueError):
    """A request the front refuses; ``status`` is the HTTP status (400 unless a subclass says)."""

    status, kind = 400, "BadRequestError"


class BodyTooLarge(RequestError):
    status, kind = 413, "PayloadTooLargeError"


class BodyTimeout(RequestError):
    status, kind = 408, "RequestTimeoutError"


@dataclasses.dataclass(frozen=True)
class _Ask:
    """What one request asks for besides its prompt."""

    sampling: Sampling
    budget: int
    seed: int
    n: int
    stop: tuple[str, ...]
    alternatives: int | None  # logprobs / top_logprobs; None: no log-probabilities at all
    stream: bool
    ids_as_tokens: bool


class OpenAIFront(BackgroundServer):
    """Serves a NativeRolloutServer over HTTP on a background thread; ``url`` is its base address."""

    def __init__(self, rollout: NativeRolloutServer, tokenizer=None, host: str = "127.0.0.1", port: int = 0,
                 model_name: str = "dew", timeout: float = 600.0, api_keys: Sequence[str] = (),
                 unauthenticated: bool = False):
        keys = check_exposure(host, api_keys, unauthenticated)
        self._keys = [hashlib.sha256(key.encode()).digest() for key in keys]
        self.rollout, self.tokenizer, self.model_name, self.timeout = rollout, tokenizer, model_name, timeout
        model = rollout.server.model
        self._logits = jax.jit(lambda variables, ids: model.apply(variables, ids)[0].astype(jnp.float32))
        front = self

        class Handler(BaseHTTPRequestHandler):
            timeout = BODY_SECONDS  # the socket's: a client that stops sending mid-body does not hold a thread

            def do_GET(self):  # noqa: N802 (http.server's naming)
                front._dispatch(self, "GET")

            def do_POST(self):  # noqa: N802
                front._dispatch(self, "POST")

            def log_message(self, *args):  # requests are not logged to stderr
                pass

        super().__init__(Handler, host, port, name="dew-openai-front")

    # ----- routing -------------------------------------------------------------------------

    def _dispatch(self, handler: BaseHTTPRequestHandler, method: str) -> None:
        routes = {
            ("GET", "/health"): lambda body: {"status": "ok", "version": self.rollout.version},
            ("GET", "/v1/models"): lambda body: {
                "object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "dew"}]},
            ("POST", "/v1/completions"): self.completions,
            ("POST", "/v1/chat/completions"): self.chat_completions,
        }
        path = handler.path.split("?")[0]
        if self._keys and path.startswith("/v1") and not self._authorized(handler.headers.get("Authorization")):
            write_json(handler, 401, {"error": "Unauthorized"})
            return
        route = routes.get((method, path))
        try:
            if route is None:
                raise LookupError(f"no route {method} {handler.path}")
            body = {}
            if method == "POST":
                data = _body(handler)
                try:
                    body = json.loads(data or b"{}")
                except (ValueError, RecursionError) as error:  # not JSON, not UTF-8, or nested past Python's stack
                    raise RequestError(f"the body is not JSON ({error})") from None
                if not isinstance(body, dict):
                    raise RequestError("the body must be a JSON object")
            status, reply = 200, route(body)
        except LookupError as error:
            status, reply = 404, _error(str(error), "NotFoundError")
        except RequestError as error:
            status, reply = error.status, _error(str(error), error.kind)
        except (ValueError, TypeError) as error:
            status, reply = 400, _error(str(error), "BadRequestError")
        except Exception as error:  # the engine failed: the client learns why, the server keeps going
            status, reply = 500, _error(f"{type(error).__name__}: {error}", "InternalServerError")
        if isinstance(reply, list):  # a stream: its chunks, every draw already done
            handler.send_response(200)
            handler.send_header("Content-Type", "text/event-stream")
            handler.send_header("Cache-Control", "no-cache")
            handler.end_headers()
            for chunk in reply:
                handler.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            handler.wfile.write(b"data: [DONE]\n\n")
            handler.wfile.flush()
            return
        write_json(handler, status, reply)

    def _authorized(self, header: str | None) -> bool:
        scheme, _, key = (header or "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        digest = hashlib.sha256(key.encode()).digest()
        return any([hmac.compare_digest(digest, known) for known in self._keys])  # every key compared, always

    # ----- what a request asks for -----------------------------------------------------------

    def _ask(self, body: dict, chat: bool) -> _Ask:
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise LookupError(f"The model `{model}` does not exist. Valid aliases: {self.model_name}.")
        served = self.rollout.server.sampling
        changes = {name: body[name] for name in ("temperature", "top_p", "min_p") if body.get(name) is not None}
        if body.get("top_k") is not None:
            changes["top_k"] = None if body["top_k"] in (-1, 0) else body["top_k"]
        if changes.get("top_p") == 1:
            changes["top_p"] = None
        if changes.get("min_p") == 0:
            changes["min_p"] = None
        try:
            sampling = dataclasses.replace(served, **changes)
        except (ValueError, TypeError) as error:
            raise RequestError(str(error)) from None
        budget = body.get("max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens", 16)
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise RequestError(f"max_tokens must be a positive integer, got {budget!r}")
        n = body.get("n", 1)
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
            raise RequestError(f"n must be an integer from 1 to {MAX_N}, got {n!r}")
        seed = body.get("seed")
        if seed is None:
            seed = int.from_bytes(os.urandom(4), "little")  # unseeded, as vLLM samples an unseeded request
        elif isinstance(seed, bool) or not isinstance(seed, int):
            raise RequestError(f"seed must be an integer, got {seed!r}")
        stop = body.get("stop") or ()
        stop = (stop,) if isinstance(stop, str) else tuple(stop)
        if not all(isinstance(s, str) and s for s in stop):
            raise RequestError("stop must be a string or a list of non-empty strings")
        if stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer to read the text; this server has none")
        alternatives = (body.get("top_logprobs") or 0) if chat and body.get("logprobs") else body.get("logprobs")
        if chat and not body.get("logprobs"):
            alternatives = None
        if alternatives is not None and (isinstance(alternatives, bool) or not isinstance(alternatives, int)
                                         or not 0 <= alternatives <= MAX_ALTERNATIVES):
            raise RequestError(f"logprobs must be an integer from 0 to {MAX_ALTERNATIVES}, got {alternatives!r}")
        return _Ask(sampling, budget, seed, n, stop, alternatives, bool(body.get("stream")),
                    bool(body.get("return_tokens_as_token_ids")) or self.tokenizer is None)

    def _drawn(self, prompts: list[list[int]], ask: _Ask) -> list[tuple[list[int], Draw]]:
        """Every draw of every prompt (prompt-major, then n), each with its own seed."""
        futures = [(prompt, self.rollout.submit(prompt, ask.budget, seed=ask.seed + i, sampling=ask.sampling))
                   for prompt in prompts for i in range(ask.n)]
        return [(prompt, future.result(timeout=self.timeout)) for prompt, future in futures]

    # ----- endpoints -----------------------------------------------------------------------

    def completions(self, body: dict):
        ask = self._ask(body, chat=False)
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            prompts = [self._encode(prompt)]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
            prompts = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
            prompts = prompt
        else:
            raise RequestError("prompt must be a string, a list of token ids or a list of such lists")
        drawn = self._drawn(prompts, ask)
        identity = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": self.model_name}
        choices = [self._completion_choice(index, prompt, draw, ask) for index, (prompt, draw) in enumerate(drawn)]
        if ask.stream:
            return [{**identity, "object": "text_completion", "choices": [chunk]} for choice in choices
                    for chunk in _completion_chunks(choice, self._deltas(choice["dew"]["token_ids"], choice["text"]))]
        tokens = sum(len(c["dew"]["token_ids"]) for c in choices)
        prompt_tokens = sum(map(len, prompts))
        return {**identity, "object": "text_completion", "choices": choices,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": tokens,
                          "total_tokens": prompt_tokens + tokens}}

    def chat_completions(self, body: dict):
        ask = self._ask(body, chat=True)
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise RequestError("chat completions need a tokenizer with a chat template; this server has none")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise RequestError("messages must be a non-empty list of objects with a 'role'")
        text = self.tokenizer.apply_chat_template(messages, tools=body.get("tools"), tokenize=False,
                                                  add_generation_prompt=True)
        ids = self._encode(text)
        drawn = self._drawn([ids], ask)
        eos = self.rollout.server.sampling.eos_ids
        identity = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": self.model_name}
        choices = []
        for index, (_, draw) in enumerate(drawn):
            content, reason = _cut(self._decode([i for i in draw.ids if i not in eos]), ask.stop, _reason(draw))
            choice = {"index": index, "message": {"role": "assistant", "content": content}, "finish_reason": reason,
                      "dew": {"token_ids": draw.ids, "logprobs": draw.behavior_log_probs,
                              "raw_logprobs": draw.old_log_probs, "version": draw.version}}
            if ask.alternatives is not None:
                tops = self._alternatives(ids, draw, ask)
                choice["logprobs"] = {"content": [
                    {**_token(self._name(t, ask)), "logprob": p,
                     "top_logprobs": [{**_token(name), "logprob": value} for name, value in top.items()]}
                    for t, p, top in zip(draw.ids, draw.behavior_log_probs, tops)]}
            choices.append(choice)
        token_ids = bool(body.get("return_token_ids"))
        if ask.stream and token_ids:
            chunks = [{**identity, "object": "chat.completion.chunk", "choices": [chunk]} for choice in choices
                      for chunk in _chat_token_chunks(choice, self._deltas(choice["dew"]["token_ids"],
                                                                           choice["message"]["content"]))]
            chunks[0]["prompt_token_ids"] = ids
            return chunks
        if ask.stream:
            return [{**identity, "object": "chat.completion.chunk", "choices": [chunk]} for choice in choices
                    for chunk in _chat_chunks(choice, self._deltas([i for i in choice["dew"]["token_ids"] if i not in eos],
                                                                   choice["message"]["content"]))]
        completion = sum(len(c["dew"]["token_ids"]) for c in choices)
        if token_ids:  # vLLM's return_token_ids: the exact prompt and sampled ids, what a recording gateway stores
            for choice in choices:
                choice["token_ids"] = choice["dew"]["token_ids"]
        return {**identity, "object": "chat.completion", "choices": choices,
                **({"prompt_token_ids": ids} if token_ids else {}),
                "usage": {"prompt_tokens": len(ids), "completion_tokens": completion,
                          "total_tokens": len(ids) + completion}}

    def _completion_choice(self, index: int, prompt: list[int], draw: Draw, ask: _Ask) -> dict:
        text, reason = _cut(self._decode(draw.ids), ask.stop, _reason(draw))
        choice = {"index": index, "text": text, "finish_reason": reason, "logprobs": None}
        if ask.alternatives is not None:
            choice["logprobs"] = {
                "tokens": [self._name(i, ask) for i in draw.ids], "token_logprobs": draw.behavior_log_probs,
                "top_logprobs": self._alternatives(prompt, draw, ask) if ask.alternatives else None,
                "text_offset": [],
            }
        choice["dew"] = {"token_ids": draw.ids, "raw_logprobs": draw.old_log_probs, "version": draw.version}
        return choice

    def _alternatives(self, prompt: list[int], draw: Draw, ask: _Ask) -> list[dict[str, float]]:
        """Per drawn token, the ``ask.alternatives`` most likely ids of the request's own distribution there."""
        if not draw.ids or not ask.alternatives:
            return [{} for _ in draw.ids]
        sequence = jnp.asarray([list(prompt) + draw.ids], jnp.int32)
        logits = self._logits(self.rollout.server.variables, sequence)[len(prompt) - 1: len(prompt) - 1 + len(draw.ids)]
        processed = logits if ask.sampling.greedy else filtered_logits(logits, ask.sampling)[0]
        values = np.asarray(jax.nn.log_softmax(processed, axis=-1))
        out = []
        for row in values:
            best = np.argsort(-row)[: ask.alternatives]
            out.append({self._name(int(i), ask): float(row[i]) for i in best if np.isfinite(row[i])})
        return out

    def _deltas(self, ids: list[int], text: str) -> list[str]:
        """The text each id adds (decoding the ids so far each time, so multi-id characters come out whole),
        up to ``text``, the choice's text after any stop string."""
        deltas, before = [], ""
        for end in range(1, len(ids) + 1):
            now = self._decode(ids[:end])[: len(text)]
            deltas.append(now[len(before):])
            before = now
        return deltas or [text]

    def _name(self, token: int, ask: _Ask) -> str:
        return f"token_id:{token}" if ask.ids_as_tokens else self._decode([token], skip_special_tokens=False)

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise RequestError("text prompts need a tokenizer; this server has none, so send token ids")
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; special tokens (EOS, chat markers) are left out of a completion's text, as vLLM's
        ``skip_special_tokens`` default leaves them, and kept in a log-probability's token name."""
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def check_exposure(host: str, api_keys: Sequence[str] | str, unauthenticated: bool) -> list[str]:
    """The API keys as a list; raises ValueError for a key that is not a non-empty string, and for a ``host``
    beyond loopback without a key unless ``unauthenticated``."""
    keys = [api_keys] if isinstance(api_keys, str) else list(api_keys)
    if any(not isinstance(key, str) or not key for key in keys):
        raise ValueError("API keys must be non-empty strings")
    if not keys and not unauthenticated and not loopback(host):
        raise ValueError(f"the OpenAI front would listen on {host!r}, beyond loopback, without an API key: give one "
                         "(dew-ray serve --api-key, OpenAIFront api_keys), or --unauthenticated "
                         "(unauthenticated=True) if everyone who reaches that address may use the model")
    return keys


def _body(handler: BaseHTTPRequestHandler) -> bytes:
    """The request's body, all ``Content-Length`` bytes of it, or a RequestError saying why not."""
    text = handler.headers.get("Content-Length") or "0"
    if not text.isdigit():
        raise RequestError(f"Content-Length must be a non-negative integer, got {text!r}")
    length = int(text)
    if length > MAX_BODY_BYTES:
        handler.close_connection = True  # the unread body must not be taken for the next request
        raise BodyTooLarge(f"the body is {length} bytes; this server takes at most {MAX_BODY_BYTES}")
    try:
        data = handler.rfile.read(length)
    except TimeoutError:
        handler.close_connection = True
        raise BodyTimeout(f"the body did not arrive within {BODY_SECONDS:g} s") from None
    if len(data) < length:
        raise RequestError(f"the body ended after {len(data)} of its {length} bytes (Content-Length)")
    return data


def write_json(handler: BaseHTTPRequestHandler, status: int, reply) -> None:
    """Answer one request with ``reply`` as JSON."""
    data = json.dumps(reply).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


def _cut(text: str, stop: tuple[str, ...], reason: str) -> tuple[str, str]:
    """The text before the first stop string, and "stop" when one was found."""
    hits = [text.find(s) for s in stop if s in text]
    return (text[: min(hits)], "stop") if hits else (text, reason)


def _completion_chunks(choice: dict, deltas: list[str]) -> list[dict]:
    """One streamed chunk per token of a finished completion choice, the last with its finish reason."""
    logprobs = choice["logprobs"]
    chunks = []
    for position, text in enumerate(deltas):
        part = None
        if logprobs:
            part = {key: (logprobs[key][position: position + 1] if logprobs[key] is not None else None)
                    for key in ("tokens", "token_logprobs", "top_logprobs")}
            part["text_offset"] = []
        chunks.append({"index": choice["index"], "text": text, "logprobs": part, "finish_reason": None})
    chunks[-1]["finish_reason"] = choice["finish_reason"]
    return chunks


def _chat_chunks(choice: dict, deltas: list[str]) -> list[dict]:
    chunks = [{"index": choice["index"], "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]
    chunks += [{"index": choice["index"], "delta": {"content": part}, "finish_reason": None} for part in deltas if part]
    chunks.append({"index": choice["index"], "delta": {}, "finish_reason": choice["finish_reason"]})
    return chunks


def _chat_token_chunks(choice: dict, deltas: list[str]) -> list[dict]:
    """One chunk per sampled id (vLLM's streamed ``return_token_ids``), each with its id and log-probability."""
    content = (choice.get("logprobs") or {}).get("content")
    chunks = [{"index": choice["index"], "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]
    for position, (token, part) in enumerate(zip(choice["dew"]["token_ids"], deltas)):
        chunk = {"index": choice["index"], "delta": {"content": part}, "finish_reason": None, "token_ids": [token]}
        if content:
            chunk["logprobs"] = {"content": content[position: position + 1]}
        chunks.append(chunk)
    chunks[-1]["finish_reason"] = choice["finish_reason"]
    return chunks


def _token(name: str) -> dict:
    return {"token": name, "bytes": list(name.encode())}


def _reason(draw) -> str:
    return {"stop": "stop", "length": "length"}.get(draw.finish_reason, "abort")


def _error(message: str, kind: str) -> dict:
    return {"error": {"message": message, "type": kind, "code": {"NotFoundError": 404, "BadRequestError": 400}.get(
        kind, 500)}}
