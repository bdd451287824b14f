"""The one JSON error shape every baton server answers with (workers, bootstrap, router):
{"error": {"message", "type", "code", "param"}}; and reading it back from an answer."""

from __future__ import annotations

from typing import Any, Protocol

from runtime.validation import safe_text


class _Answer(Protocol):
    status_code: int

    def json(self) -> Any: ...


def error_body(message: str, type_: str, code: str, param: str | None = None) -> dict[str, Any]:
    # a message may quote the client's text: never let a lone surrogate break the response
    return {"error": {"message": safe_text(message), "type": type_, "code": code, "param": param}}


def error_message(answer: _Answer) -> str:
    """The message of an error answer (its status when the body is not our error shape)."""
    try:
        return str(answer.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return f"HTTP {answer.status_code}"
