"""Generation: one submitted request seen from the HTTP side, as detokenized deltas.

Each `next()` returns everything new since the previous one (coalesced outputs, their text
delta). `finish()` concatenates them: the non-streamed result is by construction the
concatenation of what a stream would have carried. Leaving a Generation unfinished (client gone,
task cancelled) aborts the request in the scheduler.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from runtime.errors import error_body
from runtime.handover import Handover
from runtime.messages import FinishReason, GenerateRequest, ReqOutput
from runtime.protocol import Resume
from runtime.server.detokenizer import IncrementalDetokenizer
from runtime.server.pd_edge import KVTransferFailed
from runtime.server.tokenizer_manager import (
    SHUTTING_DOWN,
    ReqState,
    RequestTimeout,
    SchedulerUnavailable,
    TokenizerManager,
)

ABORT_ACK_TIMEOUT_S = 10.0


class HandedOver(SchedulerUnavailable):
    """A draining decode handed the request over (runtime/handover.py), once its last tokens
    are out: its stream ends with the hand-over event (`handover_event`), which its router
    follows (docs/router.md "Migration"); before any response, a 503."""

    def __init__(self, handover: Handover) -> None:
        super().__init__(f"{SHUTTING_DOWN}: {handover.message}")
        self.handover = handover


def stream_error(e: Exception) -> dict[str, Any]:
    """The in-band error event that ends a stream which failed mid-way."""
    return error_body(str(e), "server_error", "stream_failed")


@dataclass
class Delta:
    index: int  # the choice this belongs to
    text: str
    output_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    finish_reason: FinishReason | None = None
    cached_tokens: int = 0
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    customized_info: dict[str, list[Any]] = field(default_factory=dict)

    def extend(self, other: Delta) -> None:
        self.text += other.text
        self.output_ids += other.output_ids
        self.completion_tokens = other.completion_tokens
        self.cached_tokens = other.cached_tokens
        self.finish_reason = other.finish_reason
        if other.logprobs is not None:
            self.logprobs = (self.logprobs or []) + other.logprobs
        if other.top_logprobs is not None:
            self.top_logprobs = (self.top_logprobs or []) + other.top_logprobs
        for key, values in other.customized_info.items():
            self.customized_info.setdefault(key, []).extend(values)


class Generation:
    def __init__(
        self, tm: TokenizerManager, req: GenerateRequest, index: int, timeout: float,
        group: str | None = None, resume: Resume | None = None,
    ) -> None:
        sp = req.sampling_params
        stop = sp.get("stop") or ()
        self.tm = tm
        self.rid = req.rid
        self.index = index
        self.timeout = timeout
        self.detok = IncrementalDetokenizer(
            tm.tokenizer,
            skip_special_tokens=sp.get("skip_special_tokens", True),
            stop=(stop,) if isinstance(stop, str) else tuple(stop),
        )
        # a resumed stream (runtime/server/resume.py): its prompt ends in the resumed tokens
        self.resumed = 0 if resume is None else len(resume.output_ids)
        if resume is not None:
            self.detok.prime(resume.output_ids, resume.text_chars)
        self.prompt_tokens = len(req.input_ids) - self.resumed
        self.finished = False
        self.handed_over: Handover | None = None  # how it goes on, once its tokens are out
        self.state: ReqState = tm.submit(req, group)

    async def next(self) -> Delta:
        """The next delta; raises InvalidRequest if the scheduler refused the request, and
        HandedOver once a request handed over has delivered its last tokens."""
        if self.handed_over is not None:
            self.finished = True
            raise HandedOver(self.handed_over)
        try:
            out = await self.tm.next_output(self.state, self.timeout)
        except RequestTimeout as e:
            out = await self._abort_and_wait(f"request timed out: {e}")
        except asyncio.CancelledError:
            self.abort("request cancelled")
            raise
        return self._delta(out)

    def _delta(self, out: ReqOutput) -> Delta:
        reason = out.finished_reason
        handover = reason.handover() if reason is not None else None
        if handover is not None:
            self.handed_over, reason = handover, None  # its tokens go out first, if any
            if not out.output_ids:
                self.finished = True
                raise HandedOver(handover)
        if reason is not None:
            self.finished = True
            text = self.detok.finish(out.output_ids, reason)
        else:
            text = self.detok.push(out.output_ids)
        return Delta(
            index=self.index,
            text=text,
            output_ids=list(out.output_ids),
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.resumed + out.completion_tokens,
            finish_reason=reason,
            cached_tokens=min(out.cached_tokens, self.prompt_tokens),
            logprobs=out.output_logprobs,
            top_logprobs=out.output_top_logprobs,
            customized_info=dict(out.customized_info or {}),
        )

    async def _abort_and_wait(self, message: str) -> ReqOutput:
        self.tm.abort(self.rid, message)
        try:
            return await self.tm.next_output(self.state, ABORT_ACK_TIMEOUT_S)
        except RequestTimeout:
            self.tm.forget(self.rid)
            reason = FinishReason("abort", message=message)
            return ReqOutput(self.rid, [], self.prompt_tokens, 0, finished_reason=reason)

    def abort(self, message: str) -> None:
        if not self.finished:
            self.finished = True
            self.tm.abort(self.rid, message)


async def gather_or_cancel(coros: list[Any]) -> list[Any]:
    """Like asyncio.gather, but the first exception cancels the rest."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()


async def start(
    tm: TokenizerManager, reqs: list[GenerateRequest], timeout: float, group: str | None = None,
    resume: Resume | None = None,
) -> tuple[list[Generation], list[Delta]]:
    """Submit every request (the choices of one OpenAI request share its id as `group`) and wait
    for each one's first delta, so that a refusal (an InvalidRequest from the scheduler) still
    becomes a 4xx before any response starts, and a disaggregated request whose KV handoff
    failed becomes a 502 (KVTransferFailed)."""
    gens: list[Generation] = []
    try:
        for i, req in enumerate(reqs):
            gens.append(Generation(tm, req, i, timeout, group, resume))
        firsts = await gather_or_cancel([g.next() for g in gens])
    except BaseException:
        for gen in gens:
            gen.abort("request failed")
        raise
    failure = tm.edge.failed_handoff([(d.finish_reason, d.output_ids) for d in firsts])
    if failure is not None:
        for gen in gens:
            gen.abort("another choice failed")
        raise KVTransferFailed(failure)
    return gens, firsts


async def finish(gens: list[Generation], firsts: list[Delta]) -> list[Delta]:
    """Non-streaming: run every generation to the end; one accumulated Delta each."""

    async def rest(gen: Generation, total: Delta) -> Delta:
        while not gen.finished:
            total.extend(await gen.next())
        return total

    try:
        return await gather_or_cancel([rest(g, d) for g, d in zip(gens, firsts, strict=True)])
    finally:
        for gen in gens:
            gen.abort("client went away")


async def interleave(gens: list[Generation], firsts: list[Delta]) -> AsyncIterator[Delta]:
    """Streaming: the first deltas, then every later one in arrival order; aborts the
    unfinished generations on exit (client gone, task cancelled)."""
    try:
        for delta in firsts:
            yield delta
        pending: dict[asyncio.Future[Delta], Generation] = {
            asyncio.ensure_future(g.next()): g for g in gens if not g.finished
        }
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    gen = pending.pop(task)
                    yield task.result()
                    if not gen.finished:
                        pending[asyncio.ensure_future(gen.next())] = gen
        finally:
            for task in pending:
                task.cancel()
    finally:
        for gen in gens:
            gen.abort("client went away")
