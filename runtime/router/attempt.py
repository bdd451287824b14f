"""One try of a request on one (prefill P, decode D) pair, until D's first answer.

Both calls start at once. The attempt has an answer when D answers 2xx: for a stream, D sends
its headers only once it holds the prompt's KV and its first token (a decode worker waits for
the handoff before it starts a response), so from then on the request no longer needs P: P's
reply is awaited in the background and a failure of it is counted, never passed on. Before
that, P failing (non-2xx, no answer) or D failing fails the attempt with an `UpstreamFailure`;
the exchange then aborts both sides and may try another pair (`exchange.py`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

from runtime.router.errors import UpstreamFailure
from runtime.router.proxy import Proxy
from runtime.router.request import RoutedRequest
from runtime.router.workers import Worker
from runtime.sse import ClientGone

TRANSFER_FAILED = "kv_transfer_failed"  # a worker's code for a KV handoff that did not happen


class Attempt:
    """One try; without a prefill, D takes the KV a draining decode moved (`req.kv_from`), or
    (the router's fallback) prefills the request itself."""

    def __init__(self, proxy: Proxy, req: RoutedRequest, prefill: Worker | None, decode: Worker):
        self.proxy, self.req, self.p, self.d = proxy, req, prefill, decode
        self.started = time.monotonic()
        self.upstream: httpx.Response | None = None
        self.released = False
        self.probe = False  # the probe of a pair back from quarantine, owing it a verdict
        # counted now, not when the tasks start, so the next pick already sees the load
        proxy.enter(decode)
        self.prefill_task = proxy.spawn(self._call_prefill(prefill))
        if prefill is not None:
            proxy.enter(prefill)
            self.prefill_task.add_done_callback(lambda _: proxy.leave(prefill))
        self.decode_task = proxy.spawn(self._open_decode())

    async def answer(self, disconnect: asyncio.Task[None] | None) -> httpx.Response:
        """D's 2xx response, headers in, body still to read; raises the attempt's failure
        (P's if P failed first) or ClientGone."""
        watch: set[asyncio.Task[Any]] = {self.decode_task, self.prefill_task}
        if disconnect is not None:
            watch.add(disconnect)
        while True:
            done, _ = await asyncio.wait(watch, return_when=asyncio.FIRST_COMPLETED)
            if disconnect in done:
                raise ClientGone()
            if self.decode_task in done:
                return self.decode_task.result()  # D's answer wins over P's failure
            watch.discard(self.prefill_task)
            if not self.prefill_task.cancelled() and self.prefill_task.exception() is not None:
                raise self.prefill_task.exception()  # type: ignore[misc]

    async def read(self, upstream: httpx.Response) -> bytes:
        try:
            return await upstream.aread()
        except httpx.HTTPError as e:
            raise self.proxy.failed(self.d, e) from None

    def cancel(self, failure: UpstreamFailure | None = None) -> None:
        """Ask the sides to drop the request; a stream D has started ends with its finish
        reason "abort". A side that answered a failure holds nothing and is left alone (an
        abort it got late could hit the client's next request of the same rid); a side that
        timed out is abandoned, so it is aborted too."""
        for worker in (self.p, self.d):
            if worker is not None and (failure is None or failure.reason == "timeout"
                                       or worker.role != failure.side):
                self.proxy.abort(worker, self.req.rid)

    def abort(self, failure: UpstreamFailure | None = None) -> None:
        """Drop the attempt (after `failure`, if it failed): the sides abort as `cancel`
        says, and its calls are let go."""
        self.cancel(failure)
        self._let_go()

    def handed_over(self) -> None:
        """D ended its stream with a hand-over (runtime/handover.py): it holds nothing of the
        request, so only P is told to drop it, as after a failure of D; the calls are let go."""
        if self.p is not None:
            self.proxy.abort(self.p, self.req.rid)
        self._let_go()

    def _let_go(self) -> None:
        if not self.prefill_task.done():
            self.prefill_task.cancel()
        self.release()

    def release(self) -> None:
        """Let go of D: its connection and its in-flight count (P's goes with its call)."""
        if self.released:
            return
        self.released = True
        if self.upstream is not None:
            self.proxy.spawn(self.upstream.aclose())
        if not self.decode_task.done():
            self.decode_task.cancel()
        self.proxy.leave(self.d)

    async def _call_prefill(self, p: Worker | None) -> None:
        if p is None:
            return
        body = self.req.for_prefill(p)
        try:
            r = await self.proxy.client.post(f"{p.url}{self.req.endpoint}", json=body,
                                             timeout=self.proxy.timeout)
        except httpx.HTTPError as e:
            raise self.proxy.failed(p, e) from None
        if not r.is_success:
            raise self.proxy.count(UpstreamFailure.answered("prefill", r.status_code, r.content))

    async def _open_decode(self) -> httpx.Response:
        """D's response with its headers in and its body still to read (a 2xx only)."""
        client = self.proxy.client
        moving = self.p is not None or self.req.kv_from is not None
        body = self.req.for_decode(self.p) if moving else self.req.for_local()
        request = client.build_request("POST", f"{self.d.url}{self.req.endpoint}", json=body,
                                       timeout=self.proxy.timeout)
        try:
            self.upstream = r = await client.send(request, stream=True)
        except httpx.HTTPError as e:
            raise self.proxy.failed(self.d, e) from None
        if r.is_success:
            return r
        content = await self.read(r)
        raise self.proxy.count(UpstreamFailure.answered("decode", r.status_code, content))


def retryable(failure: UpstreamFailure) -> bool:
    """May another pair succeed where this failed? Not for a worker's 4xx: that is the
    client's request (too long, a bad field) and another worker would say the same. A 409
    (a room in use, a rid a worker still holds) is retried: the retry has fresh ones."""
    return failure.status >= 500 or failure.status in (408, 409, 429)


def blames_link(failure: UpstreamFailure) -> bool:
    """A failure of the KV handoff between the two (a transfer that failed or timed out)."""
    return failure.code == TRANSFER_FAILED
