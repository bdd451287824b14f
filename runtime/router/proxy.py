"""What every forwarded request shares: the HTTP client to the workers, timeouts, in-flight
accounting, aborts, and the background tasks that carry them (`exchange.py` is one request).

Aborts go out as tasks of their own, so nothing that cancels a request can cut them short.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

import httpx

from runtime.router.config import RouterConfig
from runtime.router.errors import UpstreamFailure
from runtime.router.metrics import RouterMetrics
from runtime.router.workers import Worker

log = logging.getLogger("baton.router")
T = TypeVar("T")


class Proxy:
    """What all requests share: the HTTP client, metrics, timeouts and background tasks."""

    def __init__(self, client: httpx.AsyncClient, metrics: RouterMetrics, config: RouterConfig):
        self.client, self.metrics, self.config = client, metrics, config
        self.timeout = httpx.Timeout(config.request_timeout_s, connect=config.connect_timeout_s)
        self.tasks: set[asyncio.Task[Any]] = set()

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


