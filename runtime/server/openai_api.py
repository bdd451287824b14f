"""OpenAI-compatible endpoints: /v1/models, /v1/completions, /v1/chat/completions.

`n` choices and list prompts become distinct scheduler requests (choice index = prompt * n + j;
with a `seed`, choice j samples with seed + j). Streams end in `data: [DONE]`; with
`stream_options.include_usage` a last chunk carries `usage` and no choices. A stream a draining
decode hands over ends with a chunk of no choices that carries `handover` (runtime/handover.py).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from runtime.handover import Bootstrap
from runtime.messages import GenerateRequest
from runtime.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from runtime.sampling_params import SamplingParams
from runtime.server import openai_format as fmt
from runtime.server import sse
from runtime.server.errors import ApiError
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
from runtime.server.resume import check_one_choice, resumed
from runtime.server.tokenizer_manager import TokenizerManager

router = APIRouter(route_class=JsonRoute)


def _tm(request: Request) -> TokenizerManager:
    return request.app.state.tm  # type: ignore[no-any-return]


def check_model(tm: TokenizerManager, name: str) -> None:
    if not tm.args.names_model(name):
        raise ApiError(404, f"model {name!r} does not exist; this server serves "
                       f"{tm.args.model_name!r}", code="model_not_found", param="model")


def _requests(
    tm: TokenizerManager, body: SamplingFields, prompts: list[list[int]],
    boots: list[Bootstrap | None],
    max_new: int | None, top_logprobs: int | None, fields: tuple[str, str],
) -> list[GenerateRequest]:
    """One scheduler request per choice (`boots` has one each); `fields` name the max-tokens
    field the client used and its prompt (for a context overflow's 400)."""
    base = body.rid or uuid.uuid4().hex
    check_one_choice(body.resume, len(prompts) * body.n)
    reqs = []
    for p, ids in enumerate(prompts):
        budget = tm.budget(len(ids), max_new, body.DEFAULT_MAX_TOKENS, *fields)
        for j in range(body.n):
            params = body.sampling_params(budget, seed_offset=j)
            SamplingParams.from_dict(params)  # fail fast, naming the field
            i = p * body.n + j
            reqs.append(resumed(GenerateRequest(
                rid=f"{base}-{i}", input_ids=ids, sampling_params=params,
                stream=body.stream, return_logprob=top_logprobs is not None,
                top_logprobs_num=top_logprobs or 0, bootstrap=boots[i],
                allow_kv_move=body.allow_kv_move and body.stream and len(prompts) * body.n == 1,
                cache_salt=body.cache_salt,
            ), body.resume))
    return reqs


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    tm = _tm(request)
    card = {"id": tm.args.model_name, "object": "model", "created": 0, "owned_by": "baton",
            "root": tm.args.model, "max_model_len": tm.info.context_len if tm.info else None}
    return {"object": "list", "data": [card]}


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    tm = _tm(request)
    body.check()
    check_model(tm, body.model)
    boots = tm.edge.bootstraps(body, len(body.prompts()) * body.n, tm.info)
    prompts = [tm.encode(p) if isinstance(p, str) else list(p) for p in body.prompts()]
    reqs = _requests(tm, body, prompts, boots, body.max_tokens, body.logprobs,
                     ("max_tokens", "prompt"))
    prompt_tokens = sum(len(p) for p in prompts)
    group = reqs[0].rid.rsplit("-", 1)[0]
    gens, firsts = await sse.until_disconnect(
        request, start(tm, reqs, tm.args.request_timeout_s, group, body.resume))
    rid = f"cmpl-{group}"
    if body.stream:
        events = _completion_events(tm, body, gens, firsts, rid, prompt_tokens)
        return sse.sse_response(events)
    deltas = await sse.until_disconnect(request, finish(gens, firsts))
    choices = [fmt.completion_choice(tm.tokenizer, d) for d in deltas]
    out = fmt.envelope("text_completion", rid, body.model, choices)
    out["usage"] = fmt.usage(prompt_tokens, deltas, body.n)
    return JSONResponse(out)


async def _completion_events(
    tm: TokenizerManager, body: CompletionRequest, gens: list[Generation], firsts: list[Delta],
    rid: str, prompt_tokens: int,
) -> AsyncIterator[str]:
    offsets = [0] * len(gens)
    last: dict[int, Delta] = {}
    try:
        async for d in interleave(gens, firsts):
            last[d.index] = d
            if d.text or d.output_ids or d.finish_reason:
                choice = fmt.completion_choice(tm.tokenizer, d, offsets[d.index])
                offsets[d.index] += len(d.text)
                _token_ids(body, choice, d)
                yield sse.event(fmt.envelope("text_completion", rid, body.model, [choice]))
    except HandedOver as e:
        yield sse.event(_handover_chunk("text_completion", rid, body, e))
    except Exception as e:  # mid-stream: the status line is gone, report in-band
        yield sse.event(stream_error(e))
    for event in _stream_tail("text_completion", rid, body, prompt_tokens, last):
        yield event


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    tm = _tm(request)
    body.check()
    check_model(tm, body.model)
    boots = tm.edge.bootstraps(body, body.n, tm.info)
    ids = tm.encode_chat([m.flat() for m in body.messages])
    top = (body.top_logprobs or 0) if body.logprobs else None
    asked = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    reqs = _requests(tm, body, [ids], boots, body.max_new_tokens, top, (asked, "messages"))
    group = reqs[0].rid.rsplit("-", 1)[0]
    gens, firsts = await sse.until_disconnect(
        request, start(tm, reqs, tm.args.request_timeout_s, group, body.resume))
    rid = f"chatcmpl-{group}"
    if body.stream:
        return sse.sse_response(_chat_events(tm, body, gens, firsts, rid, len(ids)))
    deltas = await sse.until_disconnect(request, finish(gens, firsts))
    choices = [fmt.chat_choice(tm.tokenizer, d) for d in deltas]
    out = fmt.envelope("chat.completion", rid, body.model, choices)
    out["usage"] = fmt.usage(len(ids), deltas, body.n)
    return JSONResponse(out)


async def _chat_events(
    tm: TokenizerManager, body: ChatCompletionRequest, gens: list[Generation],
    firsts: list[Delta], rid: str, prompt_tokens: int,
) -> AsyncIterator[str]:
    last: dict[int, Delta] = {}
    try:
        async for d in interleave(gens, firsts):
            first = d.index not in last
            last[d.index] = d
            if first or d.text or d.output_ids or d.finish_reason:
                choice = fmt.chat_chunk_choice(tm.tokenizer, d, first)
                _token_ids(body, choice, d)
                yield sse.event(fmt.envelope("chat.completion.chunk", rid, body.model, [choice]))
    except HandedOver as e:
        yield sse.event(_handover_chunk("chat.completion.chunk", rid, body, e))
    except Exception as e:
        yield sse.event(stream_error(e))
    for event in _stream_tail("chat.completion.chunk", rid, body, prompt_tokens, last):
        yield event


def _token_ids(body: SamplingFields, choice: dict[str, Any], d: Delta) -> None:
    """A router following the stream's tokens (to resume it elsewhere) asked for them."""
    if body.return_token_ids:
        choice["token_ids"] = list(d.output_ids)


def _handover_chunk(kind: str, rid: str, body: SamplingFields, e: HandedOver) -> dict[str, Any]:
    """The chunk that says a draining decode handed the stream over (runtime/handover.py): no
    choices (as the usage chunk), and `handover`."""
    chunk = fmt.envelope(kind, rid, body.model, [])
    chunk["handover"] = e.handover.to_wire()
    return chunk


def _stream_tail(
    kind: str, rid: str, body: CompletionRequest | ChatCompletionRequest, prompt_tokens: int,
    last: dict[int, Delta],
) -> list[str]:
    """The optional usage chunk (stream_options.include_usage), then `data: [DONE]`."""
    events = []
    if body.include_usage:
        chunk = fmt.envelope(kind, rid, body.model, [])
        chunk["usage"] = fmt.usage(prompt_tokens, list(last.values()), body.n)
        events.append(sse.event(chunk))
    return [*events, sse.DONE]
