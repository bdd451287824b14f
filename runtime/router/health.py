"""Worker readiness: every worker's `GET /ready` is polled; only ready workers get requests.

A worker that answers anything but 200, or refuses the connection, is out at once; one that
does not answer in time is out after `failures` such polls in a row (a busy worker may be slow
to answer once). Its next 200 brings it back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

import httpx

from runtime.router.metrics import RouterMetrics
from runtime.router.workers import Worker, Workers

log = logging.getLogger("baton.router")


class HealthChecker:
    def __init__(self, client: httpx.AsyncClient, workers: Workers, metrics: RouterMetrics,
                 interval: float, timeout: float, failures: int = 1):
        self.client, self.workers, self.metrics = client, workers, metrics
        self.interval, self.timeout, self.failures = interval, timeout, failures

    async def check(self, workers: Iterable[Worker]) -> None:
        """Poll each of `workers` once, concurrently, and publish the ready counts."""
        await asyncio.gather(*(self._check_one(w) for w in workers))
        self.publish()

    async def run(self) -> None:
        """Poll every known worker every `interval` seconds (forever; cancel to stop)."""
        while True:
            await self.check(self.workers.all())
            await asyncio.sleep(self.interval)

    def publish(self) -> None:
        for pool in (self.workers.prefill, self.workers.decode):
            self.metrics.set_workers(pool.role, len(pool), len(pool.ready()))

    async def _check_one(self, worker: Worker) -> None:
        try:
            response = await self.client.get(f"{worker.url}/ready", timeout=self.timeout)
            ready, why = response.status_code == 200, f"status {response.status_code}"
            worker.unanswered = 0
        except httpx.ConnectError as e:
            ready, why = False, f"{type(e).__name__}: {e}"
        except httpx.HTTPError as e:
            worker.unanswered += 1
            ready, why = False, f"{type(e).__name__}: {e} ({worker.unanswered} in a row)"
            if worker.unanswered < self.failures:
                log.info("%s worker %s: no answer to GET /ready (%s)", worker.role, worker.url, why)
                return
        if ready != worker.ready:
            log.info("%s worker %s is %s (%s)", worker.role, worker.url,
                     "ready" if ready else "not ready", "GET /ready 200" if ready else why)
        worker.ready = ready
