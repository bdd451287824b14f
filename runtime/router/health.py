"""Worker readiness: every worker's `GET /ready` is polled; only ready workers get requests.

A worker that answers anything but 200, or refuses the connection, is out at once; one that
does not answer in time is out after `failures` such polls in a row (a busy worker may be slow
to answer once). Its next 200 brings it back. A prefill/decode worker's 200 also says its KV
transfer backend and layout (`kv_transfer`): the router pairs only workers that agree, and says
so in its own /ready (and log) when none do. Every 200's body also carries the worker's figures,
which go to the P:D planner's view (runtime/router/figures.py).

A request whose retry finds no ready pair does not wait for the next interval: `recheck` polls
the workers that are out at once (one poll at a time, shared by every request waiting).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Any

import httpx

from runtime.router.figures import PlannerFigures
from runtime.router.metrics import RouterMetrics
from runtime.router.workers import Worker, Workers

log = logging.getLogger("baton.router")
RECHECK_S = 0.25  # a recheck's pause after its poll: how often a waiting retry looks again


class HealthChecker:
    def __init__(self, client: httpx.AsyncClient, workers: Workers, metrics: RouterMetrics,
                 interval: float, timeout: float, failures: int = 1,
                 figures: PlannerFigures | None = None):
        self.client, self.workers, self.metrics = client, workers, metrics
        self.figures = figures or PlannerFigures()
        self.interval, self.timeout, self.failures = interval, timeout, failures
        self.unready: str | None = "starting"  # the reason last logged
        self.rechecking: asyncio.Task[None] | None = None  # the shared poll, if one runs

    async def check(self, workers: Iterable[Worker]) -> None:
        """Poll each of `workers` once, concurrently, and publish the ready counts."""
        await asyncio.gather(*(self._check_one(w) for w in workers))
        self.publish()

    async def run(self) -> None:
        """Poll every known worker every `interval` seconds (forever; cancel to stop)."""
        while True:
            await self.check(self.workers.all())
            await asyncio.sleep(self.interval)

    async def recheck(self) -> None:
        """Poll the workers that are out now, then pause RECHECK_S: what a retry that found
        no ready pair waits on (a worker the router has not seen ready yet, one starting
        again). Callers that come while one runs share it."""
        if self.rechecking is None or self.rechecking.done():
            out = [w for w in self.workers.all() if not w.ready]
            self.rechecking = asyncio.create_task(self._poll_then_pause(out))
        await asyncio.shield(self.rechecking)

    async def _poll_then_pause(self, workers: list[Worker]) -> None:
        await self.check(workers)
        await asyncio.sleep(RECHECK_S)

    def publish(self) -> None:
        for pool in (self.workers.prefill, self.workers.decode):
            self.metrics.set_workers(pool.role, len(pool), len(pool.ready()))
        reason = self.workers.unready_reason()
        if reason != self.unready:
            if reason is None:
                log.info("router ready: requests can be served")
            else:
                log.warning("router not ready: %s", reason)
            self.unready = reason

    async def _check_one(self, worker: Worker) -> None:
        try:
            response = await self.client.get(f"{worker.url}/ready", timeout=self.timeout)
            ready, why = response.status_code == 200, f"status {response.status_code}"
            worker.unanswered = 0
            if ready:
                body = json_body(response)
                learn(worker, body)
                self.figures.observe(worker.role, worker.url, body, time.monotonic())
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


def learn(worker: Worker, body: dict[str, Any]) -> None:
    """What a ready worker's /ready body tells the router, set on `worker`."""
    worker.kv_transfer, worker.instance_id, worker.local_prefill = _kv_transfer(body)
    worker.tp, worker.revision = _shown(body)


def json_body(response: httpx.Response) -> dict[str, Any]:
    """A worker's answer (/ready, /server_info) as a JSON object ({} when it is none)."""
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _shown(body: dict[str, Any]) -> tuple[int, str | None]:
    """A worker's TP size (1 when it does not say) and revision (None), from its /ready body:
    shown, not paired by (the revision pairs through the KV layout)."""
    tp, revision = body.get("tp", 1), body.get("revision")
    return (tp if type(tp) is int and tp >= 1 else 1,
            revision if isinstance(revision, str) and len(revision) <= 64 else None)


def _kv_transfer(body: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None, bool]:
    """A prefill/decode worker's backend and KV layout, its instance id (None where absent),
    and whether it prefills requests without a room itself, from its /ready body."""
    kv, instance = body.get("kv_transfer"), body.get("instance_id")
    return ((kv if isinstance(kv, dict) else None),
            (instance if isinstance(instance, str) else None), body.get("local_prefill") is True)
