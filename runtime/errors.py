"""The one JSON error shape every baton server answers with (workers, bootstrap, router):
{"error": {"message", "type", "code", "param"}}; the exception that carries one with its status
(the server's ApiError, the router's RouterError); and reading it back from an answer."""

from __future__ import annotations

from typing import Any, Protocol

from runtime.validation import safe_text


class _Answer(Protocol):
    status_code: int

    def json(self) -> Any: ...


def error_body(message: str, type_: str, code: str, param: str | None = None) -> dict[str, Any]:
    # a message may quote the client's text: never let a lone surrogate break the response
    return {"error": {"message": safe_text(message), "type": type_, "code": code, "param": param}}


class HttpError(Exception):
    """An error answered as `error_body(...)` with HTTP `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        code: str = "invalid_request",
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = (
            status,
            message,
            type_,
            code,
            param,
        )

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.code, self.param)


def error_message(answer: _Answer) -> str:
    """The message of an error answer (its status when the body is not our error shape)."""
    try:
        return str(answer.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return f"HTTP {answer.status_code}"
