"""The operator as a real process (`baton operator`, through the console script's own entry
point `runtime.cli`),
driven with a real kubectl against the emulated API, following manifests/README.md:
`kubectl apply -f manifests/`, then `kubectl apply -f manifests/samples/inferenceservice.yaml`."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from isvc_helpers import NAMESPACE, REPO, SAMPLE_FILE, Cluster, wait_for
from kmock_cluster import EmulatedCluster
from kubectl_tool import run_kubectl

pytestmark = pytest.mark.timeout(120)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return bool(response.status == 200)
    except OSError:
        return False


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
    """`baton operator` flags, a one-second resync timer, and its liveness endpoint."""
    liveness = f"http://127.0.0.1:{free_port()}/healthz"
    log = tmp_path / "operator.log"
    env = {**os.environ, "BATON_OPERATOR_RESYNC_SECONDS": "1"}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "runtime.cli", "operator", "--standalone",
             "--namespace", NAMESPACE, f"--liveness={liveness}", "--verbose"],
            env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: healthy(liveness) or proc.poll() is not None, 30, "operator liveness")
        assert proc.poll() is None, log.read_text()
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        text = log.read_text()
        assert code == 0, text
        assert "Traceback" not in text, text


def test_kubectl_applied_sample_is_reconciled_by_the_operator_process(
        applied: Cluster, operator_process: subprocess.Popen[bytes]) -> None:
    out = run_kubectl("--validate=false", "apply", "-f", str(SAMPLE_FILE))
    assert "inferenceservice.baton.dev/smollm2 created" in out

    names = {"deployment.apps/smollm2-prefill", "deployment.apps/smollm2-decode",
             "deployment.apps/smollm2-router"}
    wait_for(lambda: names <= set(run_kubectl("get", "deployments", "-o", "name").split()),
             30, "the sample's Deployments")
    services = set(run_kubectl("get", "services", "-o", "name").split())
    assert {"service/smollm2", "service/smollm2-prefill", "service/smollm2-decode"} <= services

    for role in ("prefill", "decode", "router"):
        applied.set_deployment_status(f"smollm2-{role}")
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
