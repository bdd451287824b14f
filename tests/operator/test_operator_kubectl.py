"""The operator as a real process (`baton operator`, through the console script's own entry
point `runtime.cli`),
driven with a real kubectl against the emulated API, following manifests/README.md:
`kubectl apply -f manifests/`, then `kubectl apply -f manifests/samples/inferenceservice.yaml`."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.kube.isvc_helpers import NAMESPACE, REPO, SAMPLE_FILE, Cluster, wait_for
from tests.kube.kmock_cluster import EmulatedCluster
from tests.kube.kubectl_tool import run_kubectl
from tests.kube.operator_process import running_operator

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def applied(emulated: EmulatedCluster) -> Cluster:
    """The documented install: `kubectl apply -f manifests/` (the CRD registers the resource,
    the operator's own objects are created), plus the namespace the services live in."""
    out = run_kubectl("--validate=false", "apply", "-f", str(REPO / "manifests"), namespace=None)
    assert set(out.split("\n")) >= {
        "customresourcedefinition.apiextensions.k8s.io/inferenceservices.baton.dev created",
        "namespace/baton-system created",
        "serviceaccount/baton-operator created",
        "clusterrole.rbac.authorization.k8s.io/baton-operator created",
        "clusterrolebinding.rbac.authorization.k8s.io/baton-operator created",
        "deployment.apps/baton-operator created",
    }, out
    client = Cluster(NAMESPACE)
    client.create_namespace()
    return client


@pytest.fixture
def operator_process(applied: Cluster, tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """`baton operator` flags and a one-second resync timer."""
    with running_operator(["--standalone", "--namespace", NAMESPACE, "--verbose"],
                          tmp_path / "operator.log",
                          {"BATON_OPERATOR_RESYNC_SECONDS": "1"}) as proc:
        yield proc


def test_kubectl_applied_sample_is_reconciled_by_the_operator_process(
        applied: Cluster, operator_process: subprocess.Popen[bytes]) -> None:
    out = run_kubectl("--validate=false", "apply", "-f", str(SAMPLE_FILE))
    assert "inferenceservice.baton.dev/smollm2 created" in out

    # one Deployment per pool (a worker pool's carries its revision: smollm2-prefill-<rev>)
    wait_for(lambda: {("Deployment", f"smollm2-{role}") for role in ("prefill", "decode", "router")}
             <= applied.children(pooled=True).keys(), 30, "the sample's Deployments")
    names = set(run_kubectl("get", "deployments", "-o", "name").split())
    assert {f"deployment.apps/{applied.pool_name('smollm2', role)}"
            for role in ("prefill", "decode", "router")} <= names
    services = set(run_kubectl("get", "services", "-o", "name").split())
    assert {"service/smollm2", "service/smollm2-prefill", "service/smollm2-decode"} <= services

    for role in ("prefill", "decode", "router"):
        applied.set_deployment_status(applied.pool_name("smollm2", role))
    ready = '{.status.conditions[?(@.type=="Ready")].status}'
    wait_for(lambda: run_kubectl("get", "bisvc", "smollm2", "-o", f"jsonpath={ready}") == "True",
             30, "Ready=True through kubectl")
    table = run_kubectl("get", "inferenceservices")
    assert "smollm2" in table

    # Level-based: the resync timer recreates a child deleted behind the operator's back.
    run_kubectl("delete", "deployment", "smollm2-router", "--wait=false")
    wait_for(lambda: "deployment.apps/smollm2-router" in run_kubectl(
        "get", "deployments", "-o", "name").split(), 30, "the router Deployment to come back")

    assert "unchanged" in run_kubectl("--validate=false", "apply", "-f", str(SAMPLE_FILE))
    assert operator_process.poll() is None
