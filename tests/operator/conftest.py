"""Fixtures: an emulated API server per test, the CRD from the chart, the operator for real."""

from __future__ import annotations

import os

# Read once when kopf loads the handlers: retry transient API errors after 1 s, not 15 s.
os.environ.setdefault("BATON_OPERATOR_RETRY_SECONDS", "1")
# What KEDA's triggers would query (tests/operator/test_operator_scalers.py).
os.environ.setdefault("BATON_OPERATOR_PROMETHEUS_URL", "http://prometheus.test:9090")

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import kubernetes
import pytest
from baton_operator.main import kopf_args
from kopf.testing import KopfRunner

from tests.kube.isvc_helpers import CRD_FILE, NAMESPACE, Cluster, OperatorFactory
from tests.kube.kmock_cluster import EmulatedCluster


@pytest.fixture
def emulated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[EmulatedCluster]:
    """A kmock-based API server on a random loopback port, as the current kubeconfig."""
    with EmulatedCluster().running() as cluster:
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(cluster.kubeconfig())
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        # The kubernetes client read $KUBECONFIG at import time; kopf's login uses this default.
        monkeypatch.setattr(kubernetes.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION",
                            str(kubeconfig))
        yield cluster


@pytest.fixture
def cluster(emulated: EmulatedCluster) -> Cluster:
    """Test-side client; the namespace and the CRD (from the chart's file) created through
    the API."""
    if not CRD_FILE.exists():
        pytest.fail(f"{CRD_FILE} is missing (the chart owns the CRD)")
    client = Cluster(NAMESPACE)
    client.create_namespace()
    client.install_crd()
    return client


@pytest.fixture
def operator(emulated: EmulatedCluster) -> OperatorFactory:
    """Start `baton operator` in-process (kopf's KopfRunner); may be entered several times."""

    @contextmanager
    def run() -> Iterator[KopfRunner]:
        args = ["run", *kopf_args(["--standalone", "--namespace", NAMESPACE, "--verbose"])]
        with KopfRunner(args, timeout=30) as runner:
            yield runner
        assert runner.exception is None, runner.output
        assert runner.exit_code == 0, runner.output

    return run
