"""Prometheus metrics of the router, on its own registry (served by GET /metrics)."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from runtime.router.config import Role

_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)


class RouterMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "baton_router_requests", "Client requests by endpoint and response status",
            ["endpoint", "status"], registry=r)
        self.latency = Histogram(
            "baton_router_request_latency_seconds",
            "End-to-end latency of generation requests (until the last byte)", ["endpoint"],
            registry=r, buckets=_LATENCY_BUCKETS)
        self.in_flight = Gauge(
            "baton_router_worker_in_flight", "Requests this router has in flight per worker",
            ["role", "worker"], registry=r)
        self.workers = Gauge(
            "baton_router_workers", "Workers discovered per role", ["role"], registry=r)
        self.ready_workers = Gauge(
            "baton_router_ready_workers", "Workers whose GET /ready is 200, per role", ["role"],
            registry=r)
        self.upstream_failures = Counter(
            "baton_router_upstream_failures",
            "Failed calls to workers by side (prefill, decode) and reason", ["side", "reason"],
            registry=r)

        self.retries = Counter(
            "baton_router_retries",
            "Requests tried again on another pair, by the failed side and reason",
            ["side", "reason"], registry=r)
        self.fallbacks = Counter(
            "baton_router_pd_fallback",
            "Requests a decode prefilled itself because no prefill could take them "
            "(--fallback colocated)", registry=r)
        self.migrations = Counter(
            "baton_router_migrations",
            "Streams moved to another decode after their first byte, by why: a draining "
            "decode's hand-over (kv_move, drained) or the decode's failure",
            ["reason"], registry=r)
        self.kv_migrations = Counter(
            "baton_kv_migrations",
            "Streams a draining decode handed to another decode with their KV (nothing "
            "recomputed)", registry=r)
        self.pair_state = Gauge(
            "baton_router_pair_state",
            "State of each (prefill, decode) pair that has seen a request: 0 healthy, "
            "1 probing, 2 quarantined", ["prefill", "decode"], registry=r)

    def on_retry(self, side: str, reason: str) -> None:
        self.retries.labels(side=side, reason=reason).inc()

    def on_fallback(self) -> None:
        self.fallbacks.inc()

    def on_migration(self, reason: str) -> None:
        self.migrations.labels(reason=reason).inc()

    def on_kv_migration(self) -> None:
        self.kv_migrations.inc()

    def set_pairs(self, states: Mapping[tuple[str, str], int]) -> None:
        self.pair_state.clear()
        for (prefill, decode), state in states.items():
            self.pair_state.labels(prefill=prefill, decode=decode).set(int(state))

    def on_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def on_latency(self, endpoint: str, seconds: float) -> None:
        self.latency.labels(endpoint=endpoint).observe(seconds)

    def on_upstream_failure(self, side: str, reason: str) -> None:
        self.upstream_failures.labels(side=side, reason=reason).inc()

    def set_in_flight(self, role: Role, worker: str, n: int) -> None:
        self.in_flight.labels(role=role, worker=worker).set(n)

    def forget_worker(self, role: Role, worker: str) -> None:
        with contextlib.suppress(KeyError):  # never had a request
            self.in_flight.remove(role, worker)

    def set_workers(self, role: Role, known: int, ready: int) -> None:
        self.workers.labels(role=role).set(known)
        self.ready_workers.labels(role=role).set(ready)

    def render(self) -> bytes:
        return generate_latest(self.registry)
