"""JSON over HTTP to an inference engine, with errors that name the engine.

Every remote piece of dew.inference (the vLLM and SGLang rollout servers, the reload
publishers, the landing check) talks to engines through :func:`call`, and every failure
it reports is an :class:`EngineError` whose message starts with the URL it called, so a
log line says which replica of which fleet refused what.

An engine that asks for an API key (a vLLM engine dew launched on a node's address, see
:class:`~dew.inference.VLLMEngine`) is named once per process with :func:`authorize`; from
then on every call to that engine (its scheme, host and port), :func:`call`'s and the
``openai`` client's that :func:`~dew.inference.engine_client` builds, carries
``Authorization: Bearer <key>``, as a ``.netrc`` holds a host's credentials for every tool
that reaches it.
"""

from __future__ import annotations

import ipaddress
import json
import threading
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

_KEYS: dict[str, str] = {}  # "scheme://host:port" -> the engine's API key, for this process
_KEYS_LOCK = threading.Lock()


def _origin(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}".lower()


def authorize(url: str, key: str) -> None:
    """Send ``Authorization: Bearer key`` with every later call from this process to the engine at ``url``
    (its scheme, host and port: ``http://10.0.0.5:8000`` or any URL under it)."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"the API key for {url} must be a non-empty string")
    with _KEYS_LOCK:
        _KEYS[_origin(url)] = key


def api_key(url: str) -> str | None:
    """The key :func:`authorize` gave the engine at ``url``, or None."""
    with _KEYS_LOCK:
        return _KEYS.get(_origin(url))


def loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (or "localhost"), reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name other than localhost: whatever it resolves to, it is not known to be loopback
        return False


class EngineError(RuntimeError):
    """An engine was unreachable, refused a request, or answered something dew cannot use."""


class EngineUnreachable(EngineError):
    """No answer came: ``timed_out`` when the engine did not answer in time (stalled, or slow), otherwise it
    refused the connection or could not be reached at all."""

    def __init__(self, message: str, timed_out: bool):
        super().__init__(message)
        self.timed_out = timed_out


def call(url: str, body: Any = None, *, method: str = "POST", timeout: float = 120.0) -> tuple[int, Any]:
    """``(status, answer)`` of one request; the answer is parsed JSON, or the raw text when it is not JSON.

    A status the engine chose (4xx, 5xx) is returned, not raised: each caller knows
    which ones its rule refuses. An engine that cannot be reached, or does not answer
    within ``timeout`` seconds, raises EngineUnreachable.
    """
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if key := api_key(url):
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, _parse(response.read())
    except urllib.error.HTTPError as error:
        return error.code, _parse(error.read())
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        raise EngineUnreachable(f"{url}: the engine is unreachable ({reason})",
                                timed_out=isinstance(error, TimeoutError) or isinstance(reason, TimeoutError)) from None


def expect(url: str, body: Any = None, *, method: str = "POST", timeout: float = 120.0, rule: str = "") -> Any:
    """The answer of a request that must succeed with a 2xx; anything else raises naming ``rule``."""
    status, answer = call(url, body, method=method, timeout=timeout)
    if not 200 <= status < 300:
        raise EngineError(f"{url}: answered HTTP {status} ({_short(answer)}){'; ' + rule if rule else ''}")
    return answer


def _parse(data: bytes) -> Any:
    try:
        return json.loads(data) if data else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        return data.decode(errors="replace")


def _short(answer: Any, limit: int = 300) -> str:
    text = answer if isinstance(answer, str) else json.dumps(answer)
    return text if len(text) <= limit else text[:limit] + "..."
