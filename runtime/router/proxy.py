"""Forwarding one request to its (prefill P, decode D) pair (.notes/pd_contract.md).

Both calls start at once. The client gets D's response: SSE relayed chunk by chunk as D sends
it, JSON as is, with D's status. The failure rules:
- P fails (non-2xx, or no answer): abort D; the client gets P's error, or, once D's stream has
  started, an in-band `data: {"error": ...}` event and `data: [DONE]`.
- D fails (non-2xx, no answer, or its stream breaks off before `data: [DONE]`): abort P; the
  client gets D's error (mid-stream: in-band, as above).
- The client leaves: abort both.
Every call has a timeout (`--request-timeout-s` bounds a worker's silence); aborts go out as
background tasks so that nothing a cancelled request does can be cut short.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from runtime.router.config import RouterConfig
from runtime.router.errors import UpstreamFailure
from runtime.router.metrics import RouterMetrics
from runtime.router.request import PDRequest
from runtime.router.workers import Worker

log = logging.getLogger("baton.router")
T = TypeVar("T")
DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
CLIENT_GONE = 499  # nginx's "client closed request", for the metrics


class ClientGone(Exception):
    pass


class Proxy:
    """What all requests share: the HTTP client, metrics, timeouts and background tasks."""

    def __init__(self, client: httpx.AsyncClient, metrics: RouterMetrics, config: RouterConfig):
        self.client, self.metrics, self.config = client, metrics, config
        self.timeout = httpx.Timeout(config.request_timeout_s, connect=config.connect_timeout_s)
        self.tasks: set[asyncio.Task[Any]] = set()

    async def forward(self, request: Request, req: PDRequest, prefill: Worker,
                      decode: Worker) -> Response:
        disconnect = self.spawn(_wait_disconnect(request))
        try:
            return await Exchange(self, req, prefill, decode).respond(disconnect)
        finally:
            disconnect.cancel()

    def spawn(self, work: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """A task the proxy keeps alive; failures are counted where they happen."""
        task = asyncio.ensure_future(work)
        self.tasks.add(task)
        task.add_done_callback(self._reap)
        return task

    def _reap(self, task: asyncio.Task[Any]) -> None:
        self.tasks.discard(task)
        if not task.cancelled():
            task.exception()  # marks it retrieved

    def enter(self, worker: Worker) -> None:
        worker.in_flight += 1
        self.metrics.set_in_flight(worker.role, worker.url, worker.in_flight)

    def leave(self, worker: Worker) -> None:
        worker.in_flight -= 1
        self.metrics.set_in_flight(worker.role, worker.url, worker.in_flight)

    def failed(self, worker: Worker, exc: Exception) -> UpstreamFailure:
        """A call to `worker` got no usable answer; a refused connection also marks it not
        ready until its next health check says otherwise."""
        if isinstance(exc, httpx.ConnectError):
            worker.ready = False
        log.warning("%s worker %s: %s: %s", worker.role, worker.url, type(exc).__name__, exc)
        return self.count(UpstreamFailure.unreachable(worker.role, worker.url, exc))

    def count(self, failure: UpstreamFailure) -> UpstreamFailure:
        self.metrics.on_upstream_failure(failure.side, failure.reason)
        return failure

    def abort(self, worker: Worker, rid: str) -> None:
        self.spawn(self._abort(worker, rid))

    async def _abort(self, worker: Worker, rid: str) -> None:
        try:
            r = await self.client.post(f"{worker.url}/abort", json={"rid": rid},
                                       timeout=self.config.abort_timeout_s)
            problem = None if r.is_success else f"status {r.status_code}"
        except httpx.HTTPError as e:
            problem = f"{type(e).__name__}: {e}"
        if problem is not None:
            log.warning("abort of %s on %s worker %s failed: %s", rid, worker.role, worker.url,
                        problem)
            self.metrics.on_upstream_failure(worker.role, "abort")

    async def drain(self, timeout: float) -> None:
        """Let pending aborts go out before the process exits."""
        if self.tasks:
            await asyncio.wait(set(self.tasks), timeout=timeout)


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Exchange:
    """One request's calls to P and D, from the start until the client has D's last byte."""

    def __init__(self, proxy: Proxy, req: PDRequest, prefill: Worker, decode: Worker):
        self.proxy, self.req, self.p, self.d = proxy, req, prefill, decode
        self.started = time.monotonic()
        self.status = CLIENT_GONE  # what the client got, for the metrics
        self.upstream: httpx.Response | None = None
        self.closed = False  # the client has D's whole response: nothing left to abort
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
            self.status = CLIENT_GONE
            self._abort(self.p, self.d)
            return Response(status_code=CLIENT_GONE)
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
            yield DONE
        self.closed = True  # ran to its end: nothing left to abort

    def close(self, client_left: bool = False) -> None:
        """Release D (its connection and its in-flight count) and record the request."""
        if client_left and not self.closed:
            self.status = CLIENT_GONE
            self._abort(self.p, self.d)
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
        if b"data: [DONE]" not in tail:
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
        super().__init__(exchange.relay(), status, headers=SSE_HEADERS, media_type=media_type)
        self.exchange = exchange

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.exchange.close(client_left=True)
