"""Router errors: JSON {"error": {"message", "type", "code", "param"}}, like the workers'."""

from __future__ import annotations

import json
from typing import Any

import httpx
from fastapi.responses import JSONResponse

from runtime.errors import HttpError, error_body


class RouterError(HttpError):
    """An error the router answers itself (bad input, no workers, a worker unreachable)."""

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), self.status)


def unavailable(message: str, code: str = "no_ready_workers") -> RouterError:
    return RouterError(503, message, "service_unavailable", code)


class UpstreamFailure(Exception):
    """A worker call that failed: which side, why (a metric label), and what the client gets."""

    def __init__(self, side: str, reason: str, status: int, body: dict[str, Any]) -> None:
        super().__init__(f"{side} {reason}: {status}")
        self.side, self.reason, self.status, self.body = side, reason, status, body

    @classmethod
    def unreachable(cls, side: str, url: str, exc: Exception) -> UpstreamFailure:
        """No usable answer: 504 for a timeout, 502 for anything else on the wire."""
        if isinstance(exc, httpx.TimeoutException | TimeoutError):
            reason, status, what = "timeout", 504, "did not answer in time"
        else:
            reason = "connect" if isinstance(exc, httpx.ConnectError) else "broken"
            status, what = 502, f"failed ({type(exc).__name__}: {exc})"
        return cls(side, reason, status, error_body(
            f"{side} worker {url} {what}", "upstream_error", f"{side}_{reason}"))

    @classmethod
    def truncated(cls, side: str, url: str) -> UpstreamFailure:
        return cls(side, "truncated", 502, error_body(
            f"{side} worker {url} ended its stream before data: [DONE]", "upstream_error",
            f"{side}_truncated"))

    @classmethod
    def answered(cls, side: str, status: int, content: bytes) -> UpstreamFailure:
        """The worker's own error response, passed on as is when it is a JSON error object."""
        try:
            body = json.loads(content)
        except ValueError:
            body = None
        if not (isinstance(body, dict) and isinstance(body.get("error"), dict)):
            text = content[:200].decode("utf-8", errors="replace")
            body = error_body(f"{side} worker answered {status}: {text}", "upstream_error",
                              f"{side}_error")
        return cls(side, "status", status, body)

    @property
    def code(self) -> str | None:
        """The error's `code` (a worker's own, or the router's `{side}_{reason}`)."""
        error = self.body.get("error")
        code = error.get("code") if isinstance(error, dict) else None
        return code if isinstance(code, str) else None

    def response(self) -> JSONResponse:
        return JSONResponse(self.body, self.status)
