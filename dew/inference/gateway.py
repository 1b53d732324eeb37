"""The recording gateway (rllm-model-gateway) as dew attaches to it: readiness, version stamps, traces.

``Gateway(url, sandbox_url=...)``: ``url`` is the gateway's root as the trainer reaches it;
``sandbox_url`` is where sandboxes reach it, which must be a path-restricted proxy
(:class:`~dew.inference.session_proxy.SessionProxy`), never the gateway's own port: that
port has no authentication and also serves every session's traces and the admin routes.
A harness's base URL is ``session_url(session)``: ``{sandbox_url}/sessions/{session}/v1``.

- ``ready(ready_timeout)`` waits until ``GET /health/workers`` reports a healthy worker and
  ``GET /v1/models`` answers through the gateway (which proxies it to a worker), and raises
  a GatewayError saying which of the two never held. rllm-model-gateway marks a worker dead
  after 3 failed health probes and then answers every call with a plain-text 500 and
  records nothing, so a run checks before its first submission.
- ``stamp(version)`` posts ``/admin/weight_version {"weight_version": v}``, the route later
  rllm commits add (the one the spec cites), after which the gateway stamps each call it
  records with ``v`` when the request arrives. rllm-model-gateway 0.1.0, the PyPI release,
  has no such route: the stamp is refused with a message saying so, and its traces carry no
  version (a source then falls back on the version served at submission).
- ``open(session)``, ``traces(session)`` and ``close_session(session)`` create a session,
  read its recorded calls in order, and delete them.

Followed: rllm-model-gateway 0.1.0's ``server.py`` (routes), ``models.py`` (TraceRecord) and
``data_process.py`` (which response fields a trace keeps), and the rllm repository's later
``server.py`` for ``/admin/weight_version``.
"""

from __future__ import annotations

import re
import time

from dew.inference.wire import EngineError, call, expect
from dew.validation import integer

SESSION = re.compile(r"[A-Za-z0-9_-]{1,128}")


class GatewayError(EngineError):
    """The gateway was unreachable, not ready, or answered something dew cannot use."""


def session_token(session: str) -> str:
    """``session`` if it is a plain token (letters, digits, ``_``, ``-``; at most 128), else ValueError."""
    if not isinstance(session, str) or not SESSION.fullmatch(session):
        raise ValueError(f"a gateway session id must be 1 to 128 letters, digits, '_' or '-', got {session!r}")
    return session


class Gateway:
    """An rllm-model-gateway dew attaches to (see the module docstring)."""

    def __init__(self, url: str, sandbox_url: str | None = None, *, timeout: float = 30.0):
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"url must be the gateway's http(s) root, got {url!r}")
        self.url = url.rstrip("/")
        self.sandbox_url = (sandbox_url or self.url).rstrip("/")
        self.timeout = timeout

    def ready(self, ready_timeout: float = 60.0) -> dict:
        """The gateway's ``/health/workers`` once a worker is healthy and ``/v1/models`` answers through it."""
        deadline = time.monotonic() + ready_timeout
        state = "it never answered"
        while True:
            # no call outlasts the deadline: a worker that never answers holds /v1/models for the call's whole timeout
            wait = min(self.timeout, max(deadline - time.monotonic(), 0.5))
            try:
                status, health = call(f"{self.url}/health/workers", method="GET", timeout=wait)
                if status != 200 or not isinstance(health, dict):
                    state = f"/health/workers answered HTTP {status}: {health!r:.200}"
                elif not health.get("healthy"):
                    state = f"/health/workers reports {health.get('healthy', 0)} of {health.get('total', 0)} workers healthy"
                else:
                    status, models = call(f"{self.url}/v1/models", method="GET", timeout=wait)
                    if status == 200 and isinstance(models, dict) and models.get("data"):
                        return health
                    state = f"GET /v1/models through the gateway answered HTTP {status}: {models!r:.200}"
            except EngineError as error:
                state = str(error)
            if time.monotonic() >= deadline:
                raise GatewayError(f"{self.url}: the gateway was not ready within {ready_timeout:g} s ({state}); "
                                   "warm each engine before the gateway takes traffic, and make 3 x "
                                   "health_check_interval longer than the longest stall")
            time.sleep(min(0.5, max(deadline - time.monotonic(), 0.0)))

    def stamp(self, version: int) -> None:
        """Make the gateway stamp ``version`` on the calls it records from now on."""
        integer("version", version)
        status, answer = call(f"{self.url}/admin/weight_version", {"weight_version": version}, timeout=self.timeout)
        if status == 404:
            raise GatewayError(f"{self.url}: the gateway has no /admin/weight_version route (rllm-model-gateway 0.1.0 "
                               "on PyPI lacks it; later rllm commits add it), so it cannot stamp calls with the "
                               "policy version; run a gateway that has the route, or publish without stamp=")
        if status != 200 or not isinstance(answer, dict) or answer.get("weight_version") != version:
            raise GatewayError(f"{self.url}: /admin/weight_version answered HTTP {status} ({answer!r:.200}), not "
                               f"{{'weight_version': {version}}}")

    def session_url(self, session: str) -> str:
        """The OpenAI base URL a harness in a sandbox uses for ``session``."""
        return f"{self.sandbox_url}/sessions/{session_token(session)}/v1"

    def open(self, session: str) -> str:
        """Create ``session`` on the gateway; its sandbox-side base URL."""
        answer = expect(f"{self.url}/sessions", {"session_id": session_token(session)}, timeout=self.timeout,
                        rule="creating a gateway session")
        if not isinstance(answer, dict) or answer.get("session_id") != session:
            raise GatewayError(f"{self.url}: POST /sessions answered {answer!r:.200}, not session {session!r}")
        return self.session_url(session)

    def traces(self, session: str) -> list[dict]:
        """Every call the gateway recorded for ``session``, in the order it stored them."""
        answer = expect(f"{self.url}/sessions/{session_token(session)}/traces", method="GET", timeout=self.timeout,
                        rule="reading a session's traces")
        if not isinstance(answer, list) or not all(isinstance(trace, dict) for trace in answer):
            raise GatewayError(f"{self.url}: the traces of session {session!r} are not a list of records: "
                               f"{answer!r:.200}")
        return sorted(answer, key=lambda trace: trace.get("timestamp") or 0.0)

    def close_session(self, session: str) -> None:
        expect(f"{self.url}/sessions/{session_token(session)}", method="DELETE", timeout=self.timeout,
               rule="deleting a gateway session")
