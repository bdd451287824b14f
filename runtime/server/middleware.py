"""ASGI middleware of the server: the error guard (the body limit is runtime/body_limit.py)."""

from __future__ import annotations

import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from runtime.server.errors import ApiError, error_response
from runtime.server.metrics import Metrics

log = logging.getLogger("baton.server")

PROBES = ("/health", "/ready")  # their 503s are answers, not errors


class ErrorGuard:
    """The outermost middleware: counts every error response by status (not the probes'), and
    answers an exception nothing handled with a JSON 500 itself.

    NOTE: Starlette's last-resort handler re-raises after its 500, and uvicorn then drops the
    keep-alive connection without `Connection: close`; answering here keeps it usable."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watched(msg: Message) -> None:
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
                if msg["status"] >= 400 and scope.get("path") not in PROBES:
                    self.metrics.on_http_error(msg["status"])
            await send(msg)

        try:
            await self.app(scope, receive, watched)
        except Exception as exc:
            if started:  # mid-response: nothing valid can follow; let the server close it
                raise
            log.exception("unhandled error", exc_info=exc)
            crash = ApiError(500, f"internal error: {exc}", "server_error", "internal")
            await error_response(crash)(scope, receive, watched)
