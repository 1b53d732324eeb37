"""An HTTP server on a daemon thread: the base of dew's small servers (the OpenAI front, the session proxy).

``BackgroundServer(handler, host, port, name)`` serves ``handler`` (a
``BaseHTTPRequestHandler`` subclass) on a ``ThreadingHTTPServer`` started at construction;
``url`` is its root, ``close`` (or leaving a ``with`` block) stops it and waits for its thread.
"""

from __future__ import annotations

import threading
from http.server import ThreadingHTTPServer


class _Server(ThreadingHTTPServer):
    # socketserver's listen backlog is 5: a burst of more connections than that (a rollout batch's clients, say)
    # overflows it and the kernel resets the extra ones before any thread sees them
    request_queue_size = 1024


class BackgroundServer:
    """``handler`` served on ``host:port`` (0: any free port) from a daemon thread named ``name``."""

    def __init__(self, handler, host: str = "127.0.0.1", port: int = 0, name: str = "dew-http"):
        self._http = _Server((host, port), handler)
        self._http.daemon_threads = True
        self._thread = threading.Thread(target=self._http.serve_forever, name=name, daemon=True)
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
