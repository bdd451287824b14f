"""The operator's own metrics (issue 28, item 4): `baton operator` as its own process with
BATON_OPERATOR_METRICS_PORT, against the emulated API; its /metrics counts passes by outcome
and API errors, and carries each service's phase until the service is gone."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from tests.kube.isvc_helpers import NAMESPACE, Cluster, isvc, wait_for
from tests.kube.kmock_cluster import EmulatedCluster
from tests.kube.operator_process import running_operator
from tests.ports import free_ports

pytestmark = pytest.mark.timeout(120)


def value(text: str, sample: str) -> float | None:
    m = re.search(rf"^{re.escape(sample)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def phase(name: str, which: str) -> str:
    return f'baton_operator_service_phase{{name="{name}",namespace="{NAMESPACE}",phase="{which}"}}'


def test_reconciles_errors_and_phase_per_service(emulated: EmulatedCluster, cluster: Cluster,
                                                  tmp_path: Path) -> None:
    port, liveness = free_ports(2)  # at once: two picks one by one may give the same port
    url = f"http://127.0.0.1:{port}/metrics"
    with running_operator(["--standalone", f"--namespace={NAMESPACE}"], tmp_path / "log",
                          {"BATON_OPERATOR_METRICS_PORT": str(port),
                           "BATON_OPERATOR_CLUSTER_SCANNING": "false",
                           "BATON_OPERATOR_RETRY_SECONDS": "1"}, liveness):
        def scrape() -> str:
            return httpx.get(url, timeout=5).text

        cluster.create(isvc("llm"))
        cluster.create(isvc("bad", prefill={"gpu": {"count": 2}}))
        wait_for(lambda: value(scrape(), phase("llm", "Pending")) == 1, 20, "llm Pending")
        text = scrape()
        assert value(text, phase("llm", "Ready")) == 0
        assert value(text, phase("bad", "Failed")) == 1
        assert (value(text, 'baton_operator_reconciles_total{outcome="ok"}') or 0) >= 1
        assert (value(text, 'baton_operator_reconciles_total{outcome="invalid"}') or 0) >= 1
        assert value(text, "baton_operator_reconcile_errors_total") == 0
        assert (value(text, "baton_operator_reconcile_seconds_count") or 0) >= 2

        # The next reads of a service fail (503), more of them than the three children's events
        # make: every event's pass fails, and only the operator's own retry of a failed pass
        # (kopf does not retry event handlers) reaches Ready before the resync's 60 s.
        emulated.fail("GET", "inferenceservices", 4)
        for role in ("prefill", "decode", "router"):
            cluster.set_deployment_status(cluster.pool_name("llm", role))
        wait_for(lambda: value(scrape(), phase("llm", "Ready")) == 1, 30, "llm Ready")
        text = scrape()
        assert value(text, phase("llm", "Pending")) == 0
        assert (value(text, "baton_operator_reconcile_errors_total") or 0) >= 1

        cluster.delete("bad")
        wait_for(lambda: value(scrape(), phase("bad", "Failed")) is None, 20, "bad forgotten")
