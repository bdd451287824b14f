"""TokenizerManager: the HTTP process's side of the scheduler.

It tokenizes prompts (chat template included), sends GenerateRequest/AbortRequest over ZMQ, and
a reader task files every incoming ReqOutput under its request, recording metrics as tokens
arrive. Consumers take a request's queued outputs coalesced into one (`ReqOutput.concat`), so a
slow reader gets one chunk with everything new rather than a backlog.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from runtime.auth.key import ClusterKey
from runtime.auth.ticket import TicketGate
from runtime.codec import CodecError, decode, encode
from runtime.config import ServerArgs
from runtime.messages import (
    AbortRequest,
    BatchOutput,
    CacheQuery,
    CacheReport,
    FinishReason,
    GenerateRequest,
    KVEvents,
    Message,
    ReqOutput,
    RequestError,
    SchedulerReady,
    SchedulerStats,
    ShutdownRequest,
)
from runtime.server.kv_events import KVEventLog
from runtime.server.metrics import Metrics
from runtime.server.pd_edge import PDEdge
from runtime.tokenizer import chat_prompt_ids
from runtime.validation import InvalidRequest, context_overflow

log = logging.getLogger("baton.server")


LOADING = "the model is still loading"
SHUTTING_DOWN = "the server is shutting down"
CACHE_QUERY_TIMEOUT_S = 10.0  # one scheduler step at most, however long a prefill chunk is


class SchedulerUnavailable(RuntimeError):
    """Not ready yet, shutting down, or the scheduler process died: a 503."""


class RequestTimeout(TimeoutError):
    pass


@dataclass(eq=False)
class ReqState:
    rid: str
    group: str | None = None  # an OpenAI request's id, shared by its choices
    outputs: list[ReqOutput] = field(default_factory=list)
    event: asyncio.Event = field(default_factory=asyncio.Event)
    error: RequestError | None = None
    lost: str | None = None  # the scheduler died owing it more: why (a failure, not a finish)
    drained: bool = False  # ended by a drain that hands it over (`drain_all`): not an abort
    finished: bool = False
    created: float = field(default_factory=time.monotonic)
    last_token_at: float | None = None


class TokenizerManager:
    def __init__(self, args: ServerArgs, tokenizer: Any, ipc_dir: str, metrics: Metrics,
                 tickets: TicketGate | None = None) -> None:
        self.args = args
        # the disaggregation edge: bootstrap rooms and tickets, failed hand-offs, /ready's fields
        self.edge = PDEdge(args, tickets or TicketGate(ClusterKey.none(), args.role))
        self.tokenizer = tokenizer
        self.model_path: str | None = None  # the model's folder, once resolved
        self.metrics = metrics
        self.to_scheduler = f"ipc://{ipc_dir}/to_scheduler"
        self.from_scheduler = f"ipc://{ipc_dir}/from_scheduler"
        self.info: SchedulerReady | None = None
        self.stats = SchedulerStats()
        self.states: dict[str, ReqState] = {}
        self.unavailable: str | None = LOADING
        self.ready = asyncio.Event()
        self.last_heard = time.monotonic()  # the scheduler's last message
        self._ctx = zmq.Context()
        self._actx = zmq.asyncio.Context()
        self._push = self._ctx.socket(zmq.PUSH)
        self._pull = self._actx.socket(zmq.PULL)
        self._reader: asyncio.Task[None] | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # the server's, once started
        self.kv_events: KVEventLog | None = None  # once the scheduler is ready, cache on
        self._queries: dict[int, asyncio.Future[CacheReport]] = {}
        self._query_ids = itertools.count(1)

    # ---- life cycle -------------------------------------------------------------------------
    def bind(self) -> None:
        self._push.setsockopt(zmq.SNDHWM, 0)
        self._push.bind(self.to_scheduler)
        self._pull.bind(self.from_scheduler)

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._reader = self.loop.create_task(self._read_loop())

    def abort_all(self, message: str = SHUTTING_DOWN) -> None:
        for rid in list(self.states):
            self.abort(rid, message)

    def drain_all(self) -> None:
        """A decode's grace period is over: abort every request in flight, and let each one's
        abort finish come back as "drained" (runtime/handover.py), a hand-over its router
        continues elsewhere rather than a failure."""
        for state in list(self.states.values()):
            state.drained = True
            self.abort(state.rid, SHUTTING_DOWN)

    def end_streams(self) -> None:
        """End the long-lived streams (GET /kv_events): the server is going away."""
        if self.kv_events is not None:
            self.kv_events.close()

    def shutdown_scheduler(self) -> None:
        self.end_streams()
        self.unavailable = SHUTTING_DOWN
        with contextlib.suppress(SchedulerUnavailable):
            self.send(ShutdownRequest())

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self._push.close(linger=1000)
        self._pull.close(linger=0)

    def scheduler_died(self, why: str) -> None:
        """Fail every request the scheduler still owed us; serve 503s from now on. A request
        cut short this way is a failure, as if the whole worker had died (its stream ends with
        an error event, which a router follows elsewhere; before any response, a 503), never a
        finish: its tokens so far are delivered first."""
        self.unavailable = why
        self.ready.clear()
        for state in list(self.states.values()):
            state.lost, state.finished = why, True
            state.event.set()
            self._forget(state)
            self.metrics.on_lost()
        self.end_streams()

    def end_all(self, why: str) -> None:
        """End every request in flight here with the abort finish, without the scheduler."""
        reason = FinishReason("abort", message=why)
        for state in list(self.states.values()):
            self._file(ReqOutput(state.rid, [], 0, 0, finished_reason=reason))

    def stalled(self) -> str | None:
        """Why the scheduler seems stuck (silent past --stall-timeout-s), or None."""
        silent = time.monotonic() - self.last_heard
        if self.info is None or silent <= self.args.stall_timeout_s:
            return None
        return f"the scheduler process has been silent for {silent:.0f} s (frozen or stuck)"

    # ---- tokenization -----------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        try:
            return chat_prompt_ids(self.tokenizer, messages)
        except Exception as e:  # a template may reject a conversation shape (jinja raise)
            raise InvalidRequest(f"the chat template rejected the messages: {e}", "messages") from e

    def budget(self, prompt_tokens: int, asked: int | None, default: int, field: str,
               prompt_field: str) -> int:
        """max_new_tokens of a request: what it asked for, if the prompt and that fit the
        context (else a 400 with the numbers, as vLLM answers), or `default` clipped to what
        fits. `field` and `prompt_field` are the client's names for them."""
        if self.info is None:  # not ready: submit() answers 503
            return asked or default
        context = self.info.context_len
        overflow = context_overflow(prompt_tokens, asked or 1, context, field, prompt_field)
        if overflow is not None:
            raise overflow
        capacity = self.info.kv_capacity_tokens
        if asked is not None and prompt_tokens + asked > capacity:
            raise InvalidRequest(
                f"the prompt ({prompt_tokens} tokens) + {field} ({asked}) needs more KV than "
                f"the pool holds ({capacity} tokens); lower {field} or raise --max-total-tokens",
                field)
        if asked is not None:
            return asked
        room = min(context, capacity) - prompt_tokens
        return max(1, min(default, room))

    # ---- requests ---------------------------------------------------------------------------
    def submit(self, req: GenerateRequest, group: str | None = None) -> ReqState:
        if self.unavailable is not None:
            raise SchedulerUnavailable(self.unavailable)
        if req.rid in self.states:
            raise InvalidRequest(f"request id {req.rid!r} is already running", "rid")
        self.send(req)
        state = self.states[req.rid] = ReqState(req.rid, group)
        self.metrics.inflight.set(len(self.states))
        return state

    def abort(self, rid: str, message: str = "aborted by client") -> bool:
        state = self.states.get(rid)
        if state is None or state.finished:
            return False
        try:
            self.send(AbortRequest(rid, message))
        except SchedulerUnavailable:
            return False
        return True

    def abort_matching(self, rid: str, message: str) -> bool:
        """Abort the request `rid`, or every choice of the OpenAI request it names: by the id
        the client was given (`cmpl-X`, `chatcmpl-X`) or the rid the request came with (`X`).
        Nothing else: a rid "job" is not the request "job-2". True if anything was aborted."""
        base = rid.removeprefix("chatcmpl-").removeprefix("cmpl-")
        targets = [s.rid for s in self.states.values() if s.rid == rid or s.group in (rid, base)]
        return any([self.abort(r, message) for r in targets])

    async def query_cache(self, *, flush: bool = False, hashes: bool = False,
                          timeout: float = CACHE_QUERY_TIMEOUT_S) -> CacheReport:
        """Ask the scheduler about its prefix cache (and flush it first, with `flush`)."""
        if self.unavailable is not None:
            raise SchedulerUnavailable(self.unavailable)
        query = CacheQuery(next(self._query_ids), flush=flush, hashes=hashes)
        answer: asyncio.Future[CacheReport] = asyncio.get_running_loop().create_future()
        self._queries[query.id] = answer
        try:
            self.send(query)
            return await asyncio.wait_for(answer, timeout)
        except TimeoutError:
            raise SchedulerUnavailable(f"the scheduler did not answer within {timeout:g}s") from None
        finally:
            self._queries.pop(query.id, None)

    async def next_output(self, state: ReqState, timeout: float) -> ReqOutput:
        """Everything queued for the request since the last call, coalesced into one output."""
        if not state.outputs and state.error is None and state.lost is None:
            try:
                await asyncio.wait_for(state.event.wait(), timeout)
            except TimeoutError:
                raise RequestTimeout(f"no output for {timeout:.0f} s") from None
        state.event.clear()
        if state.error is not None:
            raise InvalidRequest(state.error.message, state.error.field, state.error.status)
        if state.lost is not None and not state.outputs:
            raise SchedulerUnavailable(state.lost)
        outputs, state.outputs = state.outputs, []
        return ReqOutput.concat(outputs)

    def send(self, msg: Message) -> None:
        try:
            self._push.send(encode(msg), zmq.NOBLOCK)
        except zmq.Again:  # no scheduler connected
            raise SchedulerUnavailable("the scheduler process is not reachable") from None

    # ---- the reader -------------------------------------------------------------------------
    async def _read_loop(self) -> None:
        while True:
            raw = await self._pull.recv()
            self.last_heard = time.monotonic()
            try:
                self._dispatch(decode(raw))
            except CodecError:
                log.exception("dropping an undecodable message from the scheduler")

    def _dispatch(self, msg: Message) -> None:
        if isinstance(msg, BatchOutput):
            for out in msg.outputs:
                self._file(out)
            if msg.stats is not None:
                self.stats = msg.stats
                self.metrics.set_stats(msg.stats)
        elif isinstance(msg, RequestError):
            self._refused(msg)
        elif isinstance(msg, KVEvents):
            if self.kv_events is not None:
                self.kv_events.apply(msg.events)
        elif isinstance(msg, CacheReport):
            answer = self._queries.get(msg.id)
            if answer is not None and not answer.done():
                answer.set_result(msg)
        elif isinstance(msg, SchedulerReady):
            self.info = msg
            if msg.prefix_cache:
                self.kv_events = KVEventLog(msg.page_size, msg.instance_id or uuid.uuid4().hex)
            if self.unavailable == LOADING:
                self.unavailable = None
            self.ready.set()
        else:
            log.error("unexpected message %s", type(msg).__name__)

    def _file(self, out: ReqOutput) -> None:
        state = self.states.get(out.rid)
        if state is None:
            return  # a request we stopped waiting for (or the warm-up)
        now = time.monotonic()
        first = state.last_token_at is None
        since = now - (state.last_token_at or state.created)
        if out.output_ids:
            self.metrics.on_tokens(len(out.output_ids), since, first, now - state.created)
            state.last_token_at = now
        reason = out.finished_reason
        if state.drained and reason is not None and reason.kind == "abort":
            out.finished_reason = FinishReason("drained", message=reason.message)
        state.outputs.append(out)
        state.event.set()
        if out.finished:
            state.finished = True
            self._forget(state)
            status = out.finished_reason.kind if out.finished_reason is not None else "abort"
            self.metrics.on_finish(status, out.prompt_tokens, out.completion_tokens, now - state.created)

    def _refused(self, err: RequestError) -> None:
        state = self.states.get(err.rid)
        if state is None:
            return
        state.error = err
        state.finished = True
        state.event.set()
        self._forget(state)
        self.metrics.on_rejected()

    def _forget(self, state: ReqState) -> None:
        self.forget(state.rid)

    def forget(self, rid: str) -> None:
        """Stop tracking a request (its outputs, if any still come, are dropped)."""
        self.states.pop(rid, None)
        self.metrics.inflight.set(len(self.states))

