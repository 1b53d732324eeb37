"""An ASGI middleware, loaded by a vLLM server dew launches (``--middleware dew_vllm_guard.EveryRoute``), that asks for
the API key on every route but ``/health``.

vLLM's own ``--api-key`` (``VLLM_API_KEY``) guards only the paths under ``/v1``, ``/v2``,
``/inference`` and ``/cohere`` (vllm 0.32, ``vllm/entrypoints/serve/middleware/authenticate.py``):
the development routes a reload or an NCCL push uses (``/pause``, ``/collective_rpc``,
``/update_weights``, ...; ``VLLM_SERVER_DEV_MODE=1``) answer anyone. An engine on a node's
address is reached from the whole network, so this middleware refuses, with vLLM's own 401
``{"error": "Unauthorized"}``, any request on any path without ``Authorization: Bearer
<VLLM_API_KEY>``; ``/health`` stays open (it tells only that the server is up). The key is
read from the environment, as vLLM reads it, so it never appears on a command line.

It runs in vLLM's Python environment, beside vLLM's middlewares: it imports only the
standard library and nothing of dew (its folder is put on the engine's ``PYTHONPATH`` alone).
"""

import hashlib
import json
import os
import secrets

OPEN = ("/health",)


class EveryRoute:
    """Pure ASGI: a request on any path but ``/health`` needs ``Authorization: Bearer $VLLM_API_KEY``."""

    def __init__(self, app):
        self.app = app
        key = os.environ.get("VLLM_API_KEY", "")
        if not key:
            raise RuntimeError("dew_vllm_guard.EveryRoute needs VLLM_API_KEY: without it every route would be open")
        self.key = hashlib.sha256(key.encode()).digest()

    def _allowed(self, headers) -> bool:
        for name, value in headers:
            if name.lower() == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and secrets.compare_digest(
                    hashlib.sha256(token.encode()).digest(), self.key)
        return False

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or scope["path"] in OPEN or self._allowed(scope["headers"]):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps({"error": "Unauthorized"}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
