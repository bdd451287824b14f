"""The FastAPI app: routes, error handlers, middleware, and the scheduler watchdog."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from runtime.auth.api_keys import ApiKeyGate, ApiKeys
from runtime.body_limit import BodyLimit
from runtime.config import ServerArgs
from runtime.errors import error_body
from runtime.server import native_api, openai_api
from runtime.server.errors import ApiError, install_error_handlers
from runtime.server.metrics import Metrics
from runtime.server.middleware import ErrorGuard
from runtime.server.tokenizer_manager import LOADING, TokenizerManager
from runtime.sse import ClientGone

log = logging.getLogger("baton.server")

WATCH_INTERVAL_S = 0.5
PROGRESS_EVERY_S = 10.0
SCHEDULER_EXIT_TIMEOUT_S = 15.0


class ProcessHandle(Protocol):
    @property
    def exitcode(self) -> int | None: ...
    def is_alive(self) -> bool: ...
    def join(self, timeout: float | None = None) -> None: ...
    def terminate(self) -> None: ...


async def _watch(app: FastAPI, proc: ProcessHandle, request_exit: Callable[[], None]) -> None:
    """Log start-up progress; if the scheduler process dies or never gets ready, fail
    in-flight work and shut the server down (exit code 1)."""
    tm: TokenizerManager = app.state.tm
    began = time.monotonic()
    while True:
        await asyncio.sleep(WATCH_INTERVAL_S)
        problem = _watch_step(app, proc, time.monotonic() - began)
        if problem is not None:
            log.error("%s; shutting down", problem)
            app.state.failed = True
            tm.scheduler_died(problem)
            request_exit()
            return


def _watch_step(app: FastAPI, proc: ProcessHandle, waited: float) -> str | None:
    tm: TokenizerManager = app.state.tm
    args: ServerArgs = tm.args
    if not proc.is_alive():
        return f"scheduler process exited with code {proc.exitcode}"
    if not tm.ready.is_set() and tm.unavailable == LOADING:
        if waited > args.startup_timeout_s:
            return f"model not ready after {waited:.0f} s"
        if waited >= app.state.next_note:
            log.info("still loading %s (%.0f s)", args.model, waited)
            app.state.next_note += PROGRESS_EVERY_S
    elif tm.ready.is_set() and not app.state.announced:
        app.state.announced = True
        log.info("ready in %.1f s: serving %r at http://%s:%d (OpenAI API under /v1)",
                 waited, args.model_name, args.host, args.port)
    return None


def create_app(
    args: ServerArgs, tm: TokenizerManager, proc: ProcessHandle, request_exit: Callable[[], None],
    keys: ApiKeys | None = None,
) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tm.bind()
        tm.start()
        watch = asyncio.create_task(_watch(app, proc, request_exit))
        try:
            yield
        finally:
            watch.cancel()
            await _stop_scheduler(tm, proc)

    app = FastAPI(title="baton", version="0.1.0", lifespan=lifespan)
    app.state.tm, app.state.failed, app.state.announced = tm, False, False
    app.state.next_note, app.state.metrics = PROGRESS_EVERY_S, tm.metrics
    install_error_handlers(app)
    app.add_exception_handler(ClientGone, _client_gone)
    app.add_middleware(BodyLimit, max_bytes=args.max_body_bytes)
    app.add_middleware(ApiKeyGate, keys=keys or ApiKeys(), protect_metrics=args.protect_metrics)
    app.add_middleware(ErrorGuard, metrics=tm.metrics)  # added last: the outermost
    app.include_router(openai_api.router)
    app.include_router(native_api.router)
    _add_probes(app, tm)
    return app


async def _client_gone(_: Request, __: Exception) -> Response:
    return JSONResponse(error_body("client closed the connection", "client_error", "client_gone"), 499)


async def _stop_scheduler(tm: TokenizerManager, proc: ProcessHandle) -> None:
    if proc.is_alive():
        tm.shutdown_scheduler()
        deadline = time.monotonic() + SCHEDULER_EXIT_TIMEOUT_S
        while proc.is_alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if proc.is_alive():
            log.warning("scheduler process did not exit; terminating it")
            proc.terminate()
    proc.join(5)
    tm.close()


def _add_probes(app: FastAPI, tm: TokenizerManager) -> None:
    metrics: Metrics = tm.metrics

    @app.get("/health")
    async def health() -> dict[str, str]:
        if app.state.failed:
            raise ApiError(503, tm.unavailable or "failed", "service_unavailable", "unhealthy")
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> dict[str, Any]:
        if not tm.ready.is_set() or tm.unavailable is not None or tm.info is None:
            raise ApiError(503, tm.unavailable or "not ready", "service_unavailable", "not_ready")
        stalled = tm.stalled()
        if stalled is not None:  # the router takes us out until it speaks again
            raise ApiError(503, stalled, "service_unavailable", "stalled")
        figures = {**dataclasses.asdict(tm.stats.figures), "kv_tokens": tm.info.kv_capacity_tokens}
        return {"status": "ready", "revision": tm.args.revision, **tm.edge.ready_fields(tm.info),
                "figures": figures}  # the P:D planner's, through the router (runtime/figures.py)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/server_info")
    async def server_info() -> dict[str, Any]:
        """What this server runs (sglang's names): model, architecture, role, dtype and KV
        cache dtype (the model's, or fp8_e4m3), its KV pool's tokens, the ranks its model is
        split over, its revision (runtime/revision.py), its vocabulary, sampler and KV canary
        (the rollout gate's probes need the token oracle and the canary: runtime/router/probe.py)."""
        info = tm.info
        if info is None:
            raise ApiError(503, "not ready", "service_unavailable", "not_ready")
        return {"model": tm.args.model, "served_model_name": tm.args.model_name,
                "role": tm.args.role, "architecture": info.architecture, "dtype": info.dtype,
                "context_len": info.context_len, "kv_capacity_tokens": info.kv_capacity_tokens,
                "page_size": info.page_size, "max_running_requests": info.max_running_requests,
                "prefix_cache": info.prefix_cache, "kv_transfer": info.kv_transfer,
                "instance_id": info.instance_id, "tp": tm.args.engine.tp,
                "revision": tm.args.revision,
                "kv_cache_dtype": info.kv_cache_dtype or info.dtype,
                "max_total_tokens": info.kv_capacity_tokens, "vocab_size": info.vocab_size,
                "sampler_backend": tm.args.engine.sampler_backend,
                "kv_canary": tm.args.canary.kv_canary,
                "kv_canary_bytes": tm.args.canary.kv_canary_bytes}

    @app.get("/debug/stats", include_in_schema=False)
    async def stats() -> dict[str, Any]:
        return {**dataclasses.asdict(tm.stats), "inflight": len(tm.states)}

