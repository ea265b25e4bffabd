"""A guard in front of Ray Serve's HTTP servers for header bytes Serve cannot read.

Serve's proxy (`--ingress proxy`) and a gateway replica's own HTTP server (`--ingress haproxy`)
decode every header name, and the values of the headers they act on (the session id, the request
id, the multiplexed model id, trace context), as UTF-8 before any code of ours runs. A value that
is not UTF-8 (HTTP allows such bytes) raised there and the client got a bare-text 500. This
middleware answers such a request with an OpenAI-style 400 that names the header instead.

Serve applies the middlewares returned by the function named in
`RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH` to both servers; gateway/ingress.py sets it for the
stacks the CLI starts, and infra/cluster*.yaml before `ray start` on every node.
"""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
CALLBACK = "gateway.http_guard.proxy_middlewares"

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


def decoded_headers() -> frozenset[str]:
    """The header names whose values Serve decodes as UTF-8 (the session header's name is
    Serve's setting, read from the environment as Serve reads it)."""
    session = os.environ.get("RAY_SERVE_SESSION_ID_HEADER_KEY", "x-session-id").lower()
    return frozenset({session, "x-request-id", "serve_multiplexed_model_id", "serve-multiplexed-model-id",
                      "traceparent", "tracestate"})


def unreadable_header(headers: Iterable[tuple[bytes, bytes]], decoded: frozenset[str]) -> str | None:
    """The first header Serve would fail to decode (its name, as text), or None."""
    for name, value in headers:
        try:
            text = name.decode()
        except UnicodeDecodeError:
            return name.decode("latin-1")
        if text.lower() in decoded:
            try:
                value.decode()
            except UnicodeDecodeError:
                return text
    return None


def refusal_body(header: str) -> bytes:
    return json.dumps({"error": {
        "message": f"header {header!r} is not valid UTF-8", "type": "invalid_request_error",
        "param": header, "code": None}}).encode()


class HeaderGuard:
    """Pure ASGI middleware: refuses, with a 400, an HTTP request carrying a header Serve
    cannot decode; passes everything else through untouched."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app
        self.decoded = decoded_headers()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            header = unreadable_header(scope.get("headers", ()), self.decoded)
            if header is not None:
                body = refusal_body(header)
                await send({"type": "http.response.start", "status": 400, "headers": [
                    (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def proxy_middlewares() -> list:
    """Serve's HTTP proxy callback (`RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`)."""
    from starlette.middleware import Middleware

    return [Middleware(HeaderGuard)]
