"""API errors: every failure is JSON {"error": {"message", "type", "code", "param"}}.

Bad input is a 4xx that names the problem; the server keeps serving.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from runtime.scheduler.sampling_params import InvalidRequest
from runtime.server.generation import KVTransferFailed
from runtime.server.tokenizer_manager import SchedulerUnavailable

log = logging.getLogger("baton.server")


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, type_: str = "invalid_request_error",
        code: str = "invalid_request", param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = (
            status, message, type_, code, param,
        )


def error_body(message: str, type_: str, code: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "code": code, "param": param}}


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(error_body(err.message, err.type, err.code, err.param), err.status)


def _describe_validation(exc: RequestValidationError) -> ApiError:
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        detail = next(e for e in errors if e.get("type") == "json_invalid").get("ctx", {})
        return ApiError(400, f"malformed JSON body: {detail.get('error', 'cannot parse')}",
                        code="json_invalid")
    parts = []
    for e in errors[:5]:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body") or "body"
        parts.append(f"{loc}: {e.get('msg', 'invalid')}")
    first = errors[0].get("loc", ()) if errors else ()
    param = ".".join(str(x) for x in first if x != "body") or None
    return ApiError(400, "; ".join(parts) or "invalid request", param=param)


def _counted(request: Request, err: ApiError) -> JSONResponse:
    metrics = getattr(request.app.state, "metrics", None)
    if metrics is not None:
        metrics.on_http_error(err.status)
    return error_response(err)


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ApiError)
        return _counted(request, exc)

    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return _counted(request, _describe_validation(exc))

    async def on_invalid(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, InvalidRequest)
        return _counted(request, ApiError(exc.status, str(exc), code=exc.code, param=exc.field))

    async def on_transfer_failed(request: Request, exc: Exception) -> JSONResponse:
        return _counted(request, ApiError(502, str(exc), "kv_transfer_error", "kv_transfer_failed"))

    async def on_unavailable(_: Request, exc: Exception) -> JSONResponse:
        return error_response(ApiError(503, str(exc), "service_unavailable", "unavailable"))

    async def on_http(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return error_response(ApiError(exc.status_code, str(exc.detail), code=code))

    async def on_crash(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return error_response(ApiError(500, f"internal error: {exc}", "server_error", "internal"))

    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(InvalidRequest, on_invalid)
    app.add_exception_handler(KVTransferFailed, on_transfer_failed)
    app.add_exception_handler(SchedulerUnavailable, on_unavailable)
    app.add_exception_handler(HTTPException, on_http)
    app.add_exception_handler(Exception, on_crash)
