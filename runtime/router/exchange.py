"""One client request, from its arrival until the client has D's last byte
(docs/router.md "Failures"; the wire contract: docs/disaggregation.md).

The request is tried on a (prefill, decode) pair (`attempt.py`). Until anything reached the
client, a failure is invisible to it: the attempt is aborted on both sides and the request goes
to another pair with fresh rooms and rid, after a short backoff, at most `--max-retries` times
and while it is younger than `--request-timeout-s` (a worker's 4xx is the client's and is passed
on). The pair that failed is avoided on the retries: the side to blame, or, for a failed KV
handoff, the pair, which the pair table also counts (`pairs.py`). A retry that finds no ready
pair at all (the only prefill died and is starting again, or the other is one the router has not
seen ready yet) waits for one, up to `--retry-wait-s`, polling the workers that are out.

Once D answered, the client gets D's response: JSON as is, SSE relayed event by event as D sends
them, with D's status. A followed stream that D hands over (a draining decode: moved with its
KV, or drained; runtime/handover.py) or that fails goes on on another decode (a migration, by
reason; only a failure also counts in the upstream failures). A stream that breaks off before
`data: [DONE]` and cannot go on ends in-band with `data: {"error": ...}` (or the hand-over
event) and `data: [DONE]`. The request is delivered once the client has the [DONE] event (or
the JSON body): a client that hangs up after that is no 499 and aborts nothing. A client that
leaves earlier aborts both sides.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any, TypeVar

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from runtime.handover import Handover, KVOffer
from runtime.router.attempt import Attempt, blames_link, retryable
from runtime.router.errors import RouterError, UpstreamFailure
from runtime.router.follow import HandedOver, StreamError, follower_for, with_client_rid
from runtime.router.pairs import PairTable
from runtime.router.proxy import Proxy
from runtime.router.request import CHAT, COMPLETIONS, RoutedRequest
from runtime.router.workers import Worker
from runtime.sse import CLIENT_GONE, DONE_BYTES, HEADERS, ClientGone

log = logging.getLogger("baton.router")
Route = Callable[[RoutedRequest, set[Worker], set[tuple[Worker, Worker]]],
                 tuple[RoutedRequest, Worker | None, Worker]]  # no prefill: the fallback
# (request, the draining decode, its offer) -> (request, the decode that takes the KV)
MoveRoute = Callable[[RoutedRequest, Worker, KVOffer], tuple[RoutedRequest, Worker] | None]
Cause = UpstreamFailure | Handover  # why a stream goes on elsewhere: a failure, or a hand-over
DONE_EVENT = DONE_BYTES.strip()
T = TypeVar("T")


class Exchange:
    """One client request and its attempts."""

    def __init__(self, proxy: Proxy, pairs: PairTable, route: Route, req: RoutedRequest,
                 prefill: Worker | None, decode: Worker, move: MoveRoute | None,
                 recheck: Callable[[], Awaitable[None]]):
        self.proxy, self.pairs, self.route, self.move = proxy, pairs, route, move
        self.recheck = recheck  # polls the workers that are out, then pauses a moment
        self.follower = follower_for(req, proxy.config.max_migrations)
        # a followed stream may move, and a draining decode may move it with its KV
        body = dict(req.body)  # (a client's own router-only fields are gone: ROUTER_ONLY)
        if self.follower is not None:
            body["allow_kv_move"] = True
            if req.endpoint in (CHAT, COMPLETIONS):
                body["return_token_ids"] = True
        req = replace(req, body=body)
        self.req = req  # the first try's: its endpoint and the client's rid
        self.base = req  # what the next try is made from (with `resume` after a migration)
        self.started = self.phase_started = time.monotonic()
        self.tries = 0  # tries after the first, of every kind: the rid suffix of the next
        self.migrations = 0
        self.status = CLIENT_GONE  # what the client got, for the metrics
        self.delivered = False  # the client has D's whole response: nothing left to abort
        self.recorded = False
        self.retries = 0  # of the current phase (the first try, or a migration)
        self.cancelled = False  # by `POST /abort`: no more tries
        self.on_close: Callable[[], None] = lambda: None
        self.avoid_workers: set[Worker] = set()
        self.avoid_pairs: set[tuple[Worker, Worker]] = set()
        self.attempt = self._start(req, prefill, decode)

    async def respond(self, request: Request) -> Response:
        disconnect = self.proxy.spawn(_wait_disconnect(request))
        relaying = False
        try:
            upstream, content = await self._answer(disconnect)
            self.status = upstream.status_code
            media_type = upstream.headers.get("content-type", "application/json")
            if content is None:
                relaying = True
                return RelayResponse(self, upstream.status_code, media_type)
            self.delivered = True
            return Response(content, upstream.status_code, media_type=media_type)
        except (UpstreamFailure, RouterError) as f:
            self.status = f.status
            return f.response()
        except ClientGone:
            self.client_left()
            return Response(status_code=CLIENT_GONE)
        except asyncio.CancelledError:  # the server is shutting down: the request is abandoned
            self.attempt.abort()
            raise
        finally:
            disconnect.cancel()
            if not relaying:
                self.close()

    def cancel(self) -> None:
        """`POST /abort` of the client's rid: the current try is aborted on its pair (a stream
        ends as the decode ends it, with finish reason "abort"), and none follows."""
        self.cancelled = True
        self.attempt.cancel()

    async def relay(self) -> AsyncIterator[bytes]:
        """D's stream as it comes, event by event, until [DONE]. When D hands the stream over
        (a draining decode: runtime/handover.py) or fails, a stream the router follows goes on
        on another decode (`_migrate`); else, or when that fails, it ends in-band with the
        hand-over (without its offer) or the error, and [DONE]."""
        while True:
            try:
                async for event in self._events():
                    if event == DONE_EVENT:
                        break
                    yield self._for_client(event) + b"\n\n"
                else:
                    raise self.proxy.count(UpstreamFailure.truncated("decode", self.attempt.d.url))
                self.delivered = True
                yield DONE_BYTES
                return
            except (HandedOver, UpstreamFailure, StreamError) as e:
                cause, end = self._stopped(e)
            if self._may_migrate():
                try:
                    await self._migrate(cause)
                    continue
                except UpstreamFailure as last:
                    end = _data(last.body)
                except RouterError as last:
                    end = _data(last.body())
            if self.follower is None or not self.follower.finished:
                yield end + b"\n\n"
            self.delivered = True  # the end (or a stream that had finished) is the end
            yield DONE_BYTES
            return

    def _stopped(self, e: HandedOver | UpstreamFailure | StreamError) -> tuple[Cause, bytes]:
        """Why D's stream stopped early (a hand-over, or a failure, counted), and the event its
        client gets if it cannot go on; the attempt is dropped."""
        if isinstance(e, HandedOver):
            self.attempt.handed_over()
            return e.handover, e.event
        f = e if isinstance(e, UpstreamFailure) else self.proxy.count(
            UpstreamFailure("decode", "stream_error", 502, e.body))
        self.attempt.abort(f)
        return f, _data(f.body)

    def _may_migrate(self) -> bool:
        """May the stream go on elsewhere? It is followed and unfinished, not cancelled, and
        has migrations left."""
        follower = self.follower
        return (follower is not None and not follower.finished and not self.cancelled
                and self.migrations < self.proxy.config.max_migrations)

    async def _migrate(self, cause: Cause) -> None:
        """Go on with the stream on another decode from the tokens the client has: with its KV
        where a hand-over offers it, else replayed on a pair (raises the last failure of the
        new tries, or, after a hand-over, the RouterError of finding no pair)."""
        follower = self.follower
        assert follower is not None
        self.migrations += 1
        follower.migrated = True
        self.base = replace(self.req, body={**self.req.body, "resume": follower.resume()})
        self.avoid_workers.add(self.attempt.d)
        self.phase_started, self.retries = time.monotonic(), 0
        self.proxy.metrics.on_migration(migration_reason(cause))
        offer = cause.offer if isinstance(cause, Handover) else None
        if not (offer is not None and self._move_try(offer)):
            await self._next_try(cause)
        await self._answer(None)

    def _move_try(self, offer: KVOffer) -> bool:
        """The next attempt takes the KV the draining decode offers, on another decode (False:
        none can; then the tokens are replayed on a pair)."""
        source = self.attempt.d
        self.tries += 1
        target = self.move(self.base.retried(self.tries), source, offer) if self.move else None
        if target is None:
            return False
        req, decode = target
        log.info("%s: moving with its KV from decode %s to decode %s", self.req.rid, source.url,
                 decode.url)
        self.attempt = self._start(req, None, decode)
        return True

    def client_left(self) -> None:
        self.status = CLIENT_GONE
        self.attempt.abort()

    def close(self) -> None:
        """Release D (and a probe that got no verdict: the client left, the router stops) and
        record the request, once."""
        if self.attempt.probe and self.attempt.p is not None:
            self.attempt.probe = False
            self.pairs.released(self.attempt.p, self.attempt.d)
        self.attempt.release()
        if not self.recorded:
            self.recorded = True
            self.on_close()
            self.proxy.metrics.on_request(self.req.endpoint, self.status)
            self.proxy.metrics.on_latency(self.req.endpoint, time.monotonic() - self.started)

    def _start(self, req: RoutedRequest, prefill: Worker | None, decode: Worker) -> Attempt:
        attempt = Attempt(self.proxy, req, prefill, decode)
        attempt.probe = prefill is not None and self.pairs.sent(prefill, decode)
        return attempt

    async def _answer(self, disconnect: asyncio.Task[None] | None,
                      ) -> tuple[httpx.Response, bytes | None]:
        """D's answer, from the first attempt that gets one (and, for JSON, its body: None
        for a stream); the last failure when no attempt is left."""
        while True:
            attempt = self.attempt
            try:
                upstream = await attempt.answer(disconnect)
                if attempt.p is not None:
                    attempt.probe = False
                    self.pairs.succeeded(attempt.p, attempt.d, time.monotonic() - attempt.started)
                elif attempt.req.kv_from is not None:
                    self.proxy.metrics.on_kv_migration()
                if upstream.headers.get("content-type", "").startswith("text/event-stream"):
                    return upstream, None
                content = await _until(self.proxy.spawn(attempt.read(upstream)), disconnect)
                return upstream, self._for_client(content)
            except UpstreamFailure as f:
                attempt.abort(f)
                self._blame(attempt, f)
                if not self._may_retry(f, attempt):
                    raise
                await _until(self.proxy.spawn(self._backoff()), disconnect)
                self.retries += 1
                await _until(self.proxy.spawn(self._next_try(f)), disconnect)

    def _blame(self, attempt: Attempt, failure: UpstreamFailure) -> None:
        attempt.probe = False  # the verdict follows
        if attempt.p is None and attempt.req.kv_from is not None:
            return  # the moved KV did not come: the tokens are replayed (on any pair)
        if attempt.p is None:
            self.avoid_workers.add(attempt.d)
        elif blames_link(failure):
            self.pairs.failed(attempt.p, attempt.d, str(failure.body.get("error", failure)))
            self.avoid_pairs.add((attempt.p, attempt.d))
        else:
            self.pairs.released(attempt.p, attempt.d)
            self.avoid_workers.add(attempt.p if failure.side == "prefill" else attempt.d)

    def _may_retry(self, failure: UpstreamFailure, attempt: Attempt) -> bool:
        """Another try? Not after the client's own error (a 4xx), except when the try took
        moved KV: whatever went wrong there, the tokens can still be replayed."""
        config = self.proxy.config
        return ((retryable(failure) or attempt.req.kv_from is not None) and not self.cancelled
                and self.retries < config.max_retries
                and time.monotonic() - self.phase_started < config.request_timeout_s)

    async def _backoff(self) -> None:
        base = self.proxy.config.retry_backoff_s * 2 ** self.retries
        await asyncio.sleep(base * random.uniform(0.5, 1.0))

    async def _next_try(self, cause: Cause) -> None:
        """The next attempt, on another pair if there is one; with no ready pair at all, the
        first that is ready within `--retry-wait-s` (when none is, or the request is cancelled
        or out of time meanwhile, raises the failure, or after a hand-over the RouterError).
        A try after a failure counts as a retry; one after a hand-over does not."""
        self.tries += 1
        config = self.proxy.config
        until = min(time.monotonic() + config.retry_wait_s,
                    self.phase_started + config.request_timeout_s)
        while True:
            try:
                req, prefill, decode = self.route(self.base.retried(self.tries),
                                                  self.avoid_workers, self.avoid_pairs)
                break
            except RouterError as e:
                if self.cancelled or time.monotonic() >= until:
                    log.info("%s: no try after %s: %s", self.req.rid, _why(cause), e)
                    raise (cause if isinstance(cause, UpstreamFailure) else e) from None
            await self.recheck()
        log.info("%s: try %d on prefill %s, decode %s after %s", self.req.rid, self.tries + 1,
                 prefill.url if prefill else "(none)", decode.url, _why(cause))
        if isinstance(cause, UpstreamFailure):
            self.proxy.metrics.on_retry(cause.side, cause.reason)
        self.attempt = self._start(req, prefill, decode)

    async def _events(self) -> AsyncIterator[bytes]:
        """The SSE events of D's stream, each without its blank-line terminator."""
        upstream = self.attempt.upstream
        assert upstream is not None
        chunks, buffer = upstream.aiter_bytes(), b""
        while True:
            chunk = await _until(self.proxy.spawn(self._next_chunk(chunks)), None)
            if chunk is None:
                return
            buffer += chunk.replace(b"\r\n", b"\n")
            *events, buffer = buffer.split(b"\n\n")
            for event in events:
                if event.strip():
                    yield event.strip()

    async def _next_chunk(self, chunks: AsyncIterator[bytes]) -> bytes | None:
        try:
            return await anext(chunks)
        except StopAsyncIteration:
            return None
        except httpx.HTTPError as e:
            raise self.proxy.failed(self.attempt.d, e) from None

    def _for_client(self, payload: bytes) -> bytes:
        """What the client gets of D's event (or JSON body): counted by the follower, if any;
        else with the client's own rid where a retry's suffixed one stands."""
        if self.follower is not None:
            return self.follower.event(payload)
        return with_client_rid(payload, self.req.client_rid, self.attempt.req.rid)


def migration_reason(cause: Cause) -> str:
    """The `reason` label of a migration: the hand-over's (`kv_move`, `drained`) or the
    failure's."""
    if isinstance(cause, Handover):
        return "kv_move" if cause.kind == "moved" else "drained"
    return cause.reason


def _why(cause: Cause) -> str:
    if isinstance(cause, Handover):
        return f"decode hand-over ({cause.kind})"
    return f"{cause.side} {cause.reason}: {cause.code}"


def _data(body: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(body, ensure_ascii=False)}".encode()


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _until(work: asyncio.Task[T], disconnect: asyncio.Task[None] | None) -> T:
    """`work`'s result, unless the client leaves first (ClientGone)."""
    watch: set[asyncio.Task[Any]] = {work}
    if disconnect is not None:
        watch.add(disconnect)
    try:
        done, _ = await asyncio.wait(watch, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            return work.result()
        raise ClientGone()
    finally:
        work.cancel()  # a no-op once it is done


class RelayResponse(StreamingResponse):
    """D's event stream relayed to the client. Whatever ends it (the stream's end, a failure,
    the client leaving, even before the first byte), the exchange is closed exactly once."""

    def __init__(self, exchange: Exchange, status: int, media_type: str):
        super().__init__(exchange.relay(), status, headers=HEADERS, media_type=media_type)
        self.exchange = exchange

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.exchange.delivered:
                self.exchange.client_left()
            self.exchange.close()
