"""`--discovery kubernetes` against the emulated API: which pods are workers, and the router
following them through list + watch with a ServiceAccount that may only read pods."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import kubernetes
import pytest

from runtime.router.config import WorkerAddress
from runtime.router.kubernetes import worker_address
from tests.kube.isvc_helpers import wait_for
from tests.kube.kmock_cluster import EmulatedCluster
from tests.router.fake_worker import FakeWorker
from tests.router.router_process import start_router

NS = "ml"
SELECT = "app=llm,role={role}"


def pod(name: str, role: str, ports: dict[str, int], *, ready: bool = True,
        ip: str = "127.0.0.1", app: str = "llm") -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": NS, "labels": {"app": app, "role": role}},
        "spec": {"containers": [{"name": "main", "ports": [
            {"name": k, "containerPort": v} for k, v in ports.items()]}]},
        "status": {"podIP": ip, "conditions": [
            {"type": "Ready", "status": "True" if ready else "False"}]},
    }


def test_only_ready_pods_with_an_http_port_are_workers() -> None:
    assert worker_address("prefill", pod("p", "prefill", {"http": 8000, "bootstrap": 9000})) == (
        WorkerAddress("http://127.0.0.1:8000", 9000))
    assert worker_address("decode", pod("d", "decode", {"http": 8001})) == (
        WorkerAddress("http://127.0.0.1:8001"))
    assert worker_address("prefill", pod("p", "prefill", {"http": 8000})).bootstrap_port == 8998  # type: ignore[union-attr]
    assert worker_address("decode", pod("d", "decode", {"http": 1}, ready=False)) is None
    assert worker_address("decode", pod("d", "decode", {"metrics": 1})) is None
    assert worker_address("decode", pod("d", "decode", {"http": 1}, ip="")) is None
    terminating = pod("d", "decode", {"http": 1})
    terminating["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert worker_address("decode", terminating) is None
    assert worker_address("decode", pod("d", "decode", {"http": 1}, ip="fd00::1")) == (
        WorkerAddress("http://[fd00::1]:1"))


@pytest.fixture
def api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[EmulatedCluster, Any]]:
    """The emulated API, namespace ml, and a ServiceAccount `router` allowed to read pods."""
    with EmulatedCluster().running() as cluster:
        admin = httpx.Client(base_url=cluster.url, trust_env=False, timeout=10)
        admin.post("/api/v1/namespaces", json={"metadata": {"name": NS}}).raise_for_status()
        rbac = f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}"
        admin.post(f"{rbac}/roles", json={"metadata": {"name": "router"}, "rules": [
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]}
        ).raise_for_status()
        admin.post(f"{rbac}/rolebindings", json={
            "metadata": {"name": "router"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                        "name": "router"},
            "subjects": [{"kind": "ServiceAccount", "name": "router", "namespace": NS}]}
        ).raise_for_status()
        config = tmp_path / "router.kubeconfig"
        config.write_text(cluster.service_account_kubeconfig(NS, "router"))
        monkeypatch.setenv("KUBECONFIG", str(config))
        monkeypatch.setattr(kubernetes.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION",
                            str(config))
        yield cluster, admin
        admin.close()


def put_pod(admin: httpx.Client, body: dict[str, Any]) -> None:
    """Create the pod (or find it) and set its status, as kubelet reports it."""
    path = f"/api/v1/namespaces/{NS}/pods"
    status = body.pop("status")
    admin.post(path, json=body)
    admin.patch(f"{path}/{body['metadata']['name']}/status", content=json.dumps(
        {"status": status}), headers={"Content-Type": "application/merge-patch+json"}
    ).raise_for_status()


def test_the_router_follows_ready_pods_through_the_api(
        api: tuple[EmulatedCluster, httpx.Client], tmp_path: Path) -> None:
    cluster, admin = api
    prefill, decode = FakeWorker("prefill").start(), FakeWorker("decode").start()
    try:
        pport, dport = (int(w.url.rsplit(":", 1)[1]) for w in (prefill, decode))
        put_pod(admin, pod("p-1", "prefill", {"http": pport, "bootstrap": 9123}))
        put_pod(admin, pod("d-1", "decode", {"http": dport}, ready=False))
        put_pod(admin, pod("d-other", "decode", {"http": dport}, app="other"))
        router = start_router("--discovery", "kubernetes", "--namespace", NS,
                              "--prefill-selector", SELECT.format(role="prefill"),
                              "--decode-selector", SELECT.format(role="decode"),
                              log_path=tmp_path / "router.log", ready=False)
        try:
            def ready() -> int:
                try:
                    return httpx.get(f"{router.url}/ready", trust_env=False).status_code
                except httpx.HTTPError:
                    return 0

            wait_for(lambda: ready() == 503, 20, "the router up, no ready decode")
            put_pod(admin, pod("d-1", "decode", {"http": dport}))  # turns Ready: watch event
            wait_for(lambda: ready() == 200, 20, "the decode pod joined")
            r = httpx.post(f"{router.url}/generate", json={"text": "hi"}, trust_env=False,
                           timeout=10)
            assert r.status_code == 200, r.text
            sent = prefill.generation().body
            assert (sent["bootstrap_host"], sent["bootstrap_port"]) == ("127.0.0.1", 9123)
            admin.delete(f"/api/v1/namespaces/{NS}/pods/d-1").raise_for_status()
            wait_for(lambda: ready() == 503, 20, "the deleted decode pod left")
        finally:
            assert router.stop() == 0, router.log()
    finally:
        prefill.stop()
        decode.stop()
    asked = {(a.verb, a.resource, a.namespace, ok) for a, ok in
             cluster.rbac_decisions(f"system:serviceaccount:{NS}:router")}
    assert asked == {("list", "pods", NS, True), ("watch", "pods", NS, True)}
