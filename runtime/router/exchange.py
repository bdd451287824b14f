"""One request forwarded to its (prefill P, decode D) pair (docs/disaggregation.md "Wire contract").

Both calls start at once. The client gets D's response: SSE relayed chunk by chunk as D sends
it, JSON as is, with D's status. The failure rules:
- P fails (non-2xx, or no answer): abort D; the client gets P's error, or, once D's stream has
  started, an in-band `data: {"error": ...}` event and `data: [DONE]`.
- D fails (non-2xx, no answer, or its stream breaks off before `data: [DONE]`): abort P; the
  client gets D's error (mid-stream: in-band, as above). A side that timed out is aborted too.
- The client leaves: abort both.
Every call has a timeout: `--request-timeout-s` bounds how long a worker may stay silent.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from runtime.router.errors import UpstreamFailure
from runtime.router.proxy import Proxy
from runtime.router.request import RoutedRequest
from runtime.router.workers import Worker
from runtime.sse import CLIENT_GONE, DONE_BYTES, HEADERS, ClientGone

T = TypeVar("T")


async def forward(proxy: Proxy, request: Request, req: RoutedRequest, prefill: Worker,
                  decode: Worker) -> Response:
    """D's response to `req` for the client of `request` (see the module's failure rules)."""
    disconnect = proxy.spawn(_wait_disconnect(request))
    try:
        return await Exchange(proxy, req, prefill, decode).respond(disconnect)
    finally:
        disconnect.cancel()


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Exchange:
    """One request's calls to P and D, from the start until the client has D's last byte."""

    def __init__(self, proxy: Proxy, req: RoutedRequest, prefill: Worker, decode: Worker):
        self.proxy, self.req, self.p, self.d = proxy, req, prefill, decode
        self.started = time.monotonic()
        self.status = CLIENT_GONE  # what the client got, for the metrics
        self.upstream: httpx.Response | None = None
        self.delivered = False  # the client has D's whole response: nothing left to abort
        self.recorded = False
        # counted now, not when the tasks start, so the next pick already sees the load
        proxy.enter(prefill)
        proxy.enter(decode)
        self.watching_prefill = True
        self.prefill_task = proxy.spawn(self._call_prefill())
        self.prefill_task.add_done_callback(lambda _: proxy.leave(prefill))
        self.decode_task = proxy.spawn(self._open_decode())

    async def respond(self, disconnect: asyncio.Task[None]) -> Response:
        relaying = False
        try:
            upstream = await self._until(self.decode_task, disconnect)
            self.status = upstream.status_code
            media_type = upstream.headers.get("content-type", "application/json")
            if media_type.startswith("text/event-stream"):
                relaying = True
                return RelayResponse(self, upstream.status_code, media_type)
            content = await self._until(self.proxy.spawn(self._read(upstream)), disconnect)
            return Response(content, upstream.status_code, media_type=media_type)
        except UpstreamFailure as f:
            self.status = f.status
            self._abort_after(f)
            return f.response()
        except ClientGone:
            self.client_left()
            return Response(status_code=CLIENT_GONE)
        except asyncio.CancelledError:  # the server is shutting down: the request is abandoned
            self._abort(self.p, self.d)
            raise
        finally:
            if not relaying:
                self.close()

    async def relay(self) -> AsyncIterator[bytes]:
        """D's stream as it comes; a failure on either side ends it in-band."""
        assert self.upstream is not None
        try:
            async for chunk in self._chunks(self.upstream):
                yield chunk
        except UpstreamFailure as f:
            self._abort_after(f)
            yield f"data: {json.dumps(f.body, ensure_ascii=False)}\n\n".encode()
            yield DONE_BYTES
        self.delivered = True

    def client_left(self) -> None:
        self.status = CLIENT_GONE
        self._abort(self.p, self.d)

    def close(self) -> None:
        """Release D (its connection and its in-flight count) and record the request."""
        if self.upstream is not None:
            self.proxy.spawn(self.upstream.aclose())
            self.upstream = None
        if not self.decode_task.done():
            self.decode_task.cancel()
        if not self.recorded:
            self.recorded = True
            self.proxy.leave(self.d)
            self.proxy.metrics.on_request(self.req.endpoint, self.status)
            self.proxy.metrics.on_latency(self.req.endpoint, time.monotonic() - self.started)

    def _abort_after(self, failure: UpstreamFailure) -> None:
        """Abort the other side; a side that timed out is abandoned, so it is aborted too."""
        if failure.reason == "timeout":
            self._abort(self.p, self.d)
        else:
            self._abort(self.d if failure.side == "prefill" else self.p)

    def _abort(self, *workers: Worker) -> None:
        for worker in workers:
            self.proxy.abort(worker, self.req.rid)
        if self.p in workers and not self.prefill_task.done():
            self.prefill_task.cancel()

    async def _call_prefill(self) -> None:
        body = self.req.for_prefill(self.p)
        try:
            r = await self.proxy.client.post(f"{self.p.url}{self.req.endpoint}", json=body,
                                             timeout=self.proxy.timeout)
        except httpx.HTTPError as e:
            raise self.proxy.failed(self.p, e) from None
        if not r.is_success:
            raise self.proxy.count(UpstreamFailure.answered("prefill", r.status_code, r.content))

    async def _open_decode(self) -> httpx.Response:
        """D's response with its headers in and its body still to read (a 2xx only)."""
        client = self.proxy.client
        request = client.build_request("POST", f"{self.d.url}{self.req.endpoint}",
                                       json=self.req.for_decode(self.p), timeout=self.proxy.timeout)
        try:
            self.upstream = r = await client.send(request, stream=True)
        except httpx.HTTPError as e:
            raise self.proxy.failed(self.d, e) from None
        if r.is_success:
            return r
        content = await self._read(r)
        raise self.proxy.count(UpstreamFailure.answered("decode", r.status_code, content))

    async def _read(self, upstream: httpx.Response) -> bytes:
        try:
            return await upstream.aread()
        except httpx.HTTPError as e:
            raise self.proxy.failed(self.d, e) from None

    async def _next_chunk(self, chunks: AsyncIterator[bytes]) -> bytes | None:
        try:
            return await anext(chunks)
        except StopAsyncIteration:
            return None
        except httpx.HTTPError as e:
            raise self.proxy.failed(self.d, e) from None

    async def _chunks(self, upstream: httpx.Response) -> AsyncIterator[bytes]:
        chunks, tail = upstream.aiter_bytes(), b""
        while True:
            chunk = await self._until(self.proxy.spawn(self._next_chunk(chunks)), None)
            if chunk is None:
                break
            tail = (tail + chunk)[-64:]
            yield chunk
        if DONE_BYTES.strip() not in tail:
            raise self.proxy.count(UpstreamFailure.truncated("decode", self.d.url))

    async def _until(self, work: asyncio.Task[T], disconnect: asyncio.Task[None] | None) -> T:
        """`work`'s result, unless the client leaves (ClientGone) or P fails first (its
        UpstreamFailure). A result that is ready wins over a P failure seen at the same time."""
        watch: set[asyncio.Task[Any]] = {work}
        if disconnect is not None:
            watch.add(disconnect)
        try:
            while True:
                if self.watching_prefill:
                    watch.add(self.prefill_task)
                done, _ = await asyncio.wait(watch, return_when=asyncio.FIRST_COMPLETED)
                if disconnect is not None and disconnect in done:
                    raise ClientGone()
                if work in done and work.exception() is None:
                    return work.result()
                if self.prefill_task in done:
                    watch.discard(self.prefill_task)
                    self._check_prefill()
                if work in done:
                    return work.result()  # raises D's failure
        finally:
            work.cancel()  # a no-op once it is done

    def _check_prefill(self) -> None:
        """Raise P's failure, once."""
        self.watching_prefill = False
        if not self.prefill_task.cancelled():
            exc = self.prefill_task.exception()
            if exc is not None:
                raise exc


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
