"""API errors: every failure is JSON {"error": {"message", "type", "code", "param"}}.

Bad input is a 4xx that names the problem; the server keeps serving.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from runtime.errors import HttpError
from runtime.server.pd_edge import KVTransferFailed
from runtime.server.tokenizer_manager import SchedulerUnavailable
from runtime.validation import InvalidRequest, describe_errors


class ApiError(HttpError):
    """A worker's error answer (bad input, not ready, a failed transfer)."""


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), err.status)


def install_error_handlers(app: FastAPI) -> None:
    """Exceptions -> JSON errors. Counting them, and a 500 for anything unhandled, is the
    ErrorGuard middleware's job (runtime/server/middleware.py)."""

    async def on_api_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ApiError)
        return error_response(exc)

    async def on_validation(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return on_invalid_request(describe_errors(exc.errors()))

    async def on_invalid(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, InvalidRequest)
        return on_invalid_request(exc)

    async def on_transfer_failed(_: Request, exc: Exception) -> JSONResponse:
        return error_response(ApiError(502, str(exc), "kv_transfer_error", "kv_transfer_failed"))

    async def on_unavailable(_: Request, exc: Exception) -> JSONResponse:
        return error_response(ApiError(503, str(exc), "service_unavailable", "unavailable"))

    async def on_http(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return error_response(ApiError(exc.status_code, str(exc.detail), code=code))

    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(InvalidRequest, on_invalid)
    app.add_exception_handler(KVTransferFailed, on_transfer_failed)
    app.add_exception_handler(SchedulerUnavailable, on_unavailable)
    app.add_exception_handler(HTTPException, on_http)


def on_invalid_request(exc: InvalidRequest) -> JSONResponse:
    return error_response(ApiError(exc.status, str(exc), code=exc.code, param=exc.field))
