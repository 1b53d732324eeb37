"""The path-restricted reverse proxy sandboxes reach the recording gateway through.

rllm-model-gateway has no authentication, and the port that proxies model calls also
serves every session's traces, session deletes and the admin routes (workers, the weight
version stamp). A sandbox runs the policy's own commands, so a policy that reaches that
port could read its group members' transcripts, reset the stamp the staleness bound
reads, or register a worker that returns fabricated ids and likelihoods.
``SessionProxy(gateway_url)`` forwards exactly one kind of request, ``POST
/sessions/<session>/v1/chat/completions`` where ``<session>`` is a plain token (letters,
digits, ``_``, ``-``), with a JSON body of at most ``max_body_bytes`` declared by
``Content-Length``, and answers everything else itself without opening a connection
to the gateway:

- another method: 405; another path (admin, traces, ``/v1/models``, a query string, ``..``,
  percent-encoding, doubled slashes, a session that is not a plain token): 403;
- no ``Content-Length`` (chunked uploads included): 411; a larger body: 413; a body that is
  not a JSON object: 400.

Only ``Content-Type`` and ``Accept`` are forwarded. The gateway's answer comes back as it
arrives (status, content type, body), so streamed chat completions stream through.
Give Harbor's allowlist this proxy's host (``allowed_hosts`` or ``--allow-agent-host``):
the allowlist filters hosts, not paths, so the proxy is what keeps the rest out of reach.
Standard library only; it binds to ``host`` (loopback unless told) and runs on a thread.
"""

from __future__ import annotations

import http.client
import json
import re
import urllib.parse
from http.server import BaseHTTPRequestHandler

from dew.inference.background import BackgroundServer

ALLOWED = re.compile(r"/sessions/[A-Za-z0-9_-]{1,128}/v1/chat/completions")
FORWARDED_HEADERS = ("Content-Type", "Accept")


class SessionProxy(BackgroundServer):
    """Forwards only sessions' chat completions to ``gateway_url`` (see the module docstring)."""

    def __init__(self, gateway_url: str, host: str = "127.0.0.1", port: int = 0, *,
                 max_body_bytes: int = 8 * 2**20, timeout: float = 600.0):
        target = urllib.parse.urlsplit(gateway_url)
        if target.scheme != "http" or not target.hostname or target.path not in ("", "/"):
            raise ValueError(f"gateway_url must be the gateway's http://host:port root, got {gateway_url!r}")
        self.gateway = (target.hostname, target.port or 80)
        self.max_body_bytes, self.timeout = max_body_bytes, timeout
        self.forwarded = 0  # requests that reached the gateway
        self.refused = 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's naming)
                proxy._post(self)

            def _refuse_method(self):
                proxy._refuse(self, 405, f"only POST /sessions/<session>/v1/chat/completions passes; not {self.command}")

            do_GET = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _refuse_method  # noqa: N815

            def log_message(self, *args):
                pass

        super().__init__(Handler, host, port, name="session-proxy")

    def _refuse(self, handler, status: int, message: str) -> None:
        self.refused += 1
        body = json.dumps({"error": {"message": message, "code": status}}).encode()
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        handler.send_header("Connection", "close")
        handler.end_headers()
        if handler.command != "HEAD":
            handler.wfile.write(body)
        handler.close_connection = True

    def _post(self, handler) -> None:
        # The request line's own target: http.server rewrites a leading "//" in handler.path, and nothing here
        # decodes, so no encoded or doubled-slash trick survives to the gateway.
        words = handler.requestline.split()
        target = words[1] if len(words) == 3 else ""
        if not ALLOWED.fullmatch(target):
            return self._refuse(handler, 403, f"{target[:200]!r} is not /sessions/<session>/v1/chat/completions")
        if "chunked" in (handler.headers.get("Transfer-Encoding") or "").lower():
            return self._refuse(handler, 411, "a chunked body is refused; send Content-Length")
        length = handler.headers.get("Content-Length")
        if length is None or not length.isdigit():
            return self._refuse(handler, 411, "Content-Length is required")
        if int(length) > self.max_body_bytes:
            return self._refuse(handler, 413, f"the body is {length} bytes; at most {self.max_body_bytes} pass")
        body = handler.rfile.read(int(length))
        try:
            if not isinstance(json.loads(body), dict):
                raise ValueError("not an object")
        except (ValueError, UnicodeDecodeError):
            return self._refuse(handler, 400, "the body must be a JSON object")
        headers = {name: handler.headers[name] for name in FORWARDED_HEADERS if handler.headers.get(name)}
        headers["Content-Length"] = str(len(body))
        connection = http.client.HTTPConnection(*self.gateway, timeout=self.timeout)
        try:
            connection.request("POST", target, body=body, headers=headers)
            self.forwarded += 1
            answer = connection.getresponse()
            handler.send_response(answer.status)
            handler.send_header("Content-Type", answer.getheader("Content-Type") or "application/json")
            handler.send_header("Connection", "close")
            handler.end_headers()
            while chunk := answer.read1(65536):
                handler.wfile.write(chunk)
                handler.wfile.flush()
        except OSError as error:
            self._refuse(handler, 502, f"the gateway could not be reached ({error})")
        finally:
            connection.close()
            handler.close_connection = True
