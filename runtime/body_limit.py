"""The request-body limit every baton HTTP front answers with (the workers and the router): a
body over `max_bytes` gets 413 before the rest of it is read, whether its size is declared
(Content-Length: refused before one byte of it is read) or it is streamed (chunked: refused as
soon as what arrived passes the limit). A front that reads a whole body first lets one client
hold its memory and event loop (a 54 MB body once stalled a router for a minute)."""

from __future__ import annotations

import json

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from runtime.errors import error_body


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` gets 413 (declared or streamed)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            body = json.dumps(error_body(self.message, "invalid_request_error",
                                         "body_too_large")).encode()
            await send({"type": "http.response.start", "status": 413, "headers": [
                (b"content-type", b"application/json"), (b"connection", b"close"),
                (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            msg = await receive()
            seen += len(msg.get("body", b""))
            if seen > self.max_bytes:
                raise HTTPException(413, self.message)
            return msg

        await self.app(scope, limited, send)

    @property
    def message(self) -> str:
        return f"request body is larger than {self.max_bytes} bytes"
