"""Native endpoints: POST /generate (sglang-shaped) and POST /abort.

/generate returns {"text", "output_ids", "meta_info"} like Engine.generate. Streaming sends the
same shape per chunk, incrementally: each event carries only the new text, output_ids,
logprobs and customized_info values (coalesced when several scheduler outputs queued up). A
stream a draining decode hands over ends with an event of no tokens whose finish reason's type is
the hand-over's kind ("moved", "drained") and that carries `handover` (runtime/handover.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from runtime.errors import error_body
from runtime.messages import FinishReason, GenerateRequest
from runtime.protocol import AbortBody, GenerateBody
from runtime.result import generate_result
from runtime.sampling_params import SamplingParams
from runtime.server import sse
from runtime.server.generation import (
    Delta,
    Generation,
    HandedOver,
    finish,
    interleave,
    start,
    stream_error,
)
from runtime.server.json_route import JsonRoute
from runtime.server.resume import resumed
from runtime.server.tokenizer_manager import TokenizerManager
from runtime.tokenizer import tokenizer_files

router = APIRouter(route_class=JsonRoute)
KV_EVENTS_KEEPALIVE_S = 15.0


def result(rid: str, d: Delta) -> dict[str, Any]:
    """Engine.generate's result shape (for a stream chunk: only what is new)."""
    return generate_result(rid, d.text, d.output_ids, d.prompt_tokens, d.completion_tokens,
                           d.finish_reason, d.logprobs, d.top_logprobs, d.customized_info,
                           d.cached_tokens)


def _request(tm: TokenizerManager, body: GenerateBody) -> GenerateRequest:
    body.check()  # fail fast, naming the field
    [boot] = tm.edge.bootstraps(body, 1, tm.info)
    ids = tm.encode(body.text) if body.text is not None else list(body.input_ids or [])
    params = dict(body.sampling_params or {})
    params["max_new_tokens"] = tm.budget(
        len(ids), params.get("max_new_tokens"), SamplingParams.max_new_tokens,
        "sampling_params.max_new_tokens", "text" if body.text is not None else "input_ids")
    return resumed(GenerateRequest(
        rid=body.rid or uuid.uuid4().hex,
        input_ids=ids,
        sampling_params=params,
        stream=body.stream,
        return_logprob=body.return_logprob or body.top_logprobs_num > 0,
        top_logprobs_num=body.top_logprobs_num,
        bootstrap=boot,
        allow_kv_move=body.allow_kv_move and body.stream, cache_salt=body.cache_salt,
    ), body.resume)


@router.post("/generate")
async def generate(body: GenerateBody, request: Request) -> Response:
    tm: TokenizerManager = request.app.state.tm
    req = _request(tm, body)
    gens, firsts = await sse.until_disconnect(
        request, start(tm, [req], tm.args.request_timeout_s, resume=body.resume))
    if body.stream:
        return sse.sse_response(_events(gens, firsts, req.rid))
    [total] = await sse.until_disconnect(request, finish(gens, firsts))
    return JSONResponse(result(req.rid, total))


async def _events(gens: list[Generation], firsts: list[Delta], rid: str) -> AsyncIterator[str]:
    last = firsts[-1]
    try:
        async for d in interleave(gens, firsts):
            last = d
            yield sse.event(result(rid, d))
    except HandedOver as e:  # no tokens: its finish reason is the hand-over's kind
        ended = FinishReason(e.handover.kind, message=e.handover.message)
        out = generate_result(rid, "", [], last.prompt_tokens, last.completion_tokens, ended,
                              cached_tokens=last.cached_tokens)
        yield sse.event({**out, "handover": e.handover.to_wire()})
    except Exception as e:
        yield sse.event(stream_error(e))
    yield sse.DONE


@router.get("/tokenizer")
async def tokenizer(request: Request) -> Response:
    """The model's tokenizer files, as text: a router that has not got the model tokenizes
    prompts with them exactly as this worker does (`baton router --tokenizer workers`)."""
    tm: TokenizerManager = request.app.state.tm
    if tm.model_path is None:
        return JSONResponse(error_body("the model is not loaded yet", "service_unavailable",
                                       "not_ready"), 503)
    files = await asyncio.to_thread(tokenizer_files, tm.model_path)
    return JSONResponse({"model": tm.args.model_name, "files": files})


@router.post("/flush_cache")
async def flush_cache(request: Request) -> dict[str, Any]:
    """Free every KV page the prefix cache holds that no running request reads."""
    tm: TokenizerManager = request.app.state.tm
    report = await tm.query_cache(flush=True)
    return {"enabled": report.enabled, "freed_tokens": report.freed_tokens,
            "cached_tokens": report.stats.cached_tokens}


@router.get("/debug/prefix_cache", include_in_schema=False)
async def prefix_cache(request: Request) -> dict[str, Any]:
    """The prefix cache: its counters and the block hash of every cached page."""
    tm: TokenizerManager = request.app.state.tm
    report = await tm.query_cache(hashes=True)
    return {"enabled": report.enabled, "page_size": report.page_size,
            **dataclasses.asdict(report.stats), "block_hashes": sorted(report.hashes or [])}


@router.get("/kv_events")
async def kv_events(request: Request) -> Response:
    """Server-sent events: a snapshot of the block hashes the prefix cache holds, then every
    block stored or removed after it, numbered (runtime/server/kv_events.py)."""
    tm: TokenizerManager = request.app.state.tm
    log = tm.kv_events
    if tm.unavailable is not None or tm.info is None:  # loading, or going away: ask again soon
        why = tm.unavailable or "not ready"
        return JSONResponse(error_body(why, "service_unavailable", "not_ready"), 503)
    if log is None:  # for good: a router asks rarely
        return JSONResponse(error_body("this server keeps no prefix cache",
                                       "service_unavailable", "no_kv_events"), 503)
    snapshot, sub = log.subscribe()

    async def events() -> AsyncIterator[str]:
        try:
            yield sse.event(snapshot)
            while True:
                try:
                    batch = await asyncio.wait_for(sub.queue.get(), KV_EVENTS_KEEPALIVE_S)
                except TimeoutError:
                    yield ": keep-alive\n\n"  # a comment: finds a client that left
                    continue
                if batch is None:
                    return
                yield sse.event(batch)
        finally:
            log.unsubscribe(sub)

    return sse.sse_response(events())


@router.post("/abort")
async def abort(body: AbortBody, request: Request) -> dict[str, Any]:
    """Abort a running request and its KV: by rid, by the id an OpenAI response showed
    (`cmpl-…`, `chatcmpl-…`: every choice of it), or by the rid given to an OpenAI request.
    `aborted` is false when nothing matched."""
    tm: TokenizerManager = request.app.state.tm
    return {"rid": body.rid, "aborted": tm.abort_matching(body.rid, "aborted via /abort")}
