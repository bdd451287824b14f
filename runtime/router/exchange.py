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
them, with D's status. A stream that breaks off before `data: [DONE]` ends in-band with
`data: {"error": ...}` and `data: [DONE]`. The request is delivered once the client has the
[DONE] event (or the JSON body): a client that hangs up after that is no 499 and aborts
nothing. A client that leaves earlier aborts both sides.
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

from runtime.router.attempt import Attempt, blames_link, retryable
from runtime.router.errors import RouterError, UpstreamFailure
from runtime.router.follow import StreamError, follower_for, with_client_rid
from runtime.router.pairs import PairTable
from runtime.router.proxy import Proxy
from runtime.router.request import CHAT, COMPLETIONS, RoutedRequest
from runtime.router.workers import Worker
from runtime.sse import CLIENT_GONE, DONE_BYTES, HEADERS, ClientGone

log = logging.getLogger("baton.router")
Route = Callable[[RoutedRequest, set[Worker], set[tuple[Worker, Worker]]],
                 tuple[RoutedRequest, Worker | None, Worker]]  # no prefill: the fallback
# (request, the draining decode, its `kv_move`) -> (request, the decode that takes the KV)
MoveRoute = Callable[[RoutedRequest, Worker, dict[str, Any]], tuple[RoutedRequest, Worker] | None]
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
        """D's stream as it comes, event by event, until [DONE]. When D fails, a stream the
        router follows goes on on another pair (`_migrate`); else, or when that fails too,
        it ends in-band with the error and [DONE]."""
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
            except (UpstreamFailure, StreamError) as e:
                f = e if isinstance(e, UpstreamFailure) else self.proxy.count(
                    UpstreamFailure("decode", "stream_error", 502, e.body))
                self.attempt.abort(f)
                try:
                    await self._migrate(f)
                    continue
                except UpstreamFailure as last:
                    f = last
                if self.follower is None or not self.follower.finished:
                    yield f"data: {json.dumps(f.body, ensure_ascii=False)}\n\n".encode()
                self.delivered = True  # the error (or a stream that had finished) is the end
                yield DONE_BYTES
                return

    async def _migrate(self, failure: UpstreamFailure) -> None:
        """Go on with the stream on another pair from the tokens the client has (raises
        `failure` when it cannot: not followed, finished already, cancelled, no migrations
        left; or the last failure of the new pair's tries)."""
        follower = self.follower
        if (follower is None or follower.finished or self.cancelled
                or self.migrations >= self.proxy.config.max_migrations):
            raise failure
        self.migrations += 1
        follower.migrated = True
        self.base = replace(self.req, body={**self.req.body, "resume": follower.resume()})
        self.avoid_workers.add(self.attempt.d)
        self.phase_started, self.retries = time.monotonic(), 0
        move = failure.body.get("kv_move")
        self.proxy.metrics.on_migration("kv_move" if move else failure.reason)
        if not (isinstance(move, dict) and self._move_try(move)):
            await self._next_try(failure)
        await self._answer(None)

    def _move_try(self, move: dict[str, Any]) -> bool:
        """The next attempt takes the KV the draining decode offers where `move` says, on
        another decode (False: none can; then the tokens are replayed on a pair)."""
        source = self.attempt.d
        self.tries += 1
        target = self.move(self.base.retried(self.tries), source, move) if self.move else None
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

    async def _next_try(self, failure: UpstreamFailure) -> None:
        """The next attempt, on another pair if there is one; with no ready pair at all, the
        first that is ready within `--retry-wait-s` (raises the failure when none is, or when
        the request is cancelled or out of time meanwhile)."""
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
                    log.info("%s: no try after %s %s: %s", self.req.rid, failure.side,
                             failure.reason, e)
                    raise failure from None
            await self.recheck()
        log.info("%s: try %d on prefill %s, decode %s after %s %s: %s", self.req.rid,
                 self.tries + 1, prefill.url if prefill else "(none)", decode.url, failure.side,
                 failure.reason, failure.code)
        self.proxy.metrics.on_retry(failure.side, failure.reason)
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
