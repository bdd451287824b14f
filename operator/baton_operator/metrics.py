"""The operator's own Prometheus metrics, on their own registry and port.

| metric                                        | type      | labels                    |
|-----------------------------------------------|-----------|---------------------------|
| baton_operator_reconciles_total               | counter   | outcome: ok, invalid, rejected, conflict |
| baton_operator_reconcile_errors_total         | counter   | (API errors: kopf retries) |
| baton_operator_reconcile_seconds              | histogram |                           |
| baton_operator_service_phase                  | gauge     | namespace, name, phase: 1 for the current phase, 0 for the others |
| baton_recommended_replicas                    | gauge     | namespace, name, role: the P:D planner's replicas (planning.py) |

Served on `BATON_OPERATOR_METRICS_PORT` (the chart's `metrics.operatorPort`, 8081) at
/metrics, with the planner's explanation of every service it plans at /debug/planner (JSON:
the router's figures, the targets, each role's plan and why); port 0 serves nothing.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

PHASES = ("Pending", "Progressing", "Ready", "Degraded", "Failed")


class OperatorMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.reconciles = Counter("baton_operator_reconciles", "Complete reconcile passes, by "
                                  "outcome", ["outcome"], registry=r)
        self.errors = Counter("baton_operator_reconcile_errors", "Passes cut short by the "
                              "Kubernetes API (retried)", registry=r)
        self.seconds = Histogram("baton_operator_reconcile_seconds", "Duration of one pass",
                                 registry=r)
        self.phase = Gauge("baton_operator_service_phase", "1 for the phase each "
                           "InferenceService is in, 0 for the others",
                           ["namespace", "name", "phase"], registry=r)
        self.recommended = Gauge("baton_recommended_replicas", "Replicas the P:D planner "
                                 "recommends per worker pool", ["namespace", "name", "role"],
                                 registry=r)
        self.explain: Callable[[], Any] = dict  # GET /debug/planner's body (handlers.py sets it)

    def serve(self, port: int) -> ThreadingHTTPServer | None:
        """Serve /metrics and /debug/planner on 0.0.0.0:`port` from a daemon thread (port 0:
        not at all)."""
        if not port:
            return None
        server = ThreadingHTTPServer(("0.0.0.0", port), _handler(self))
        threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
        return server

    def set_recommended(self, namespace: str, name: str, replicas: dict[str, int]) -> None:
        for role, n in replicas.items():
            self.recommended.labels(namespace=namespace, name=name, role=role).set(n)

    def on_pass(self, outcome: str, seconds: float) -> None:
        self.reconciles.labels(outcome=outcome).inc()
        self.seconds.observe(seconds)

    def set_phase(self, namespace: str, name: str, phase: str) -> None:
        for each in PHASES:
            self.phase.labels(namespace=namespace, name=name, phase=each).set(each == phase)

    def forget(self, namespace: str, name: str) -> None:
        """A deleted service: its series go."""
        for each in PHASES:
            with contextlib.suppress(KeyError):  # never set
                self.phase.remove(namespace, name, each)
        for role in ("prefill", "decode"):
            with contextlib.suppress(KeyError):
                self.recommended.remove(namespace, name, role)


def _handler(metrics: OperatorMetrics) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._send(200, CONTENT_TYPE_LATEST, generate_latest(metrics.registry))
            elif path == "/debug/planner":
                body = json.dumps(metrics.explain(), indent=1, default=str).encode()
                self._send(200, "application/json", body)
            else:
                self._send(404, "text/plain", b"not found: /metrics or /debug/planner\n")

        def _send(self, code: int, kind: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: Any) -> None:  # scrapes every few seconds: not worth a line
            return

    return Handler


METRICS = OperatorMetrics()
