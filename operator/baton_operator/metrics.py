"""The operator's own Prometheus metrics, on their own registry and port.

| metric                                        | type      | labels                    |
|-----------------------------------------------|-----------|---------------------------|
| baton_operator_reconciles_total               | counter   | outcome: ok, invalid, rejected, conflict |
| baton_operator_reconcile_errors_total         | counter   | (API errors: kopf retries) |
| baton_operator_reconcile_seconds              | histogram |                           |
| baton_operator_service_phase                  | gauge     | namespace, name, phase: 1 for the current phase, 0 for the others |

Served on `BATON_OPERATOR_METRICS_PORT` (the chart's `metrics.operatorPort`, 8081) at
/metrics; port 0 serves nothing.
"""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

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

    def serve(self, port: int) -> None:
        """Serve /metrics on 0.0.0.0:`port` from a daemon thread (port 0: not at all)."""
        if port:
            start_http_server(port, registry=self.registry)

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


METRICS = OperatorMetrics()
