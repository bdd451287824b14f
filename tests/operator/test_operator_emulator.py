"""The compatibility layer over kmock behaves like an API server where the operator relies on
it; if these fail, the operator tests prove nothing."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
from typing import Any

import kubernetes
import pytest
import yaml

from tests.kube.isvc_helpers import CRD_FILE, Cluster, isvc, wait_for
from tests.kube.kmock_cluster import EmulatedCluster
from tests.kube.kubectl_tool import kubectl, run_kubectl, table_cells

pytestmark = pytest.mark.timeout(60)


def request(cluster: EmulatedCluster, method: str, path: str, body: Any = None,
            content_type: str = "application/merge-patch+json") -> tuple[int, dict[str, Any]]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(cluster.url + path, data=data, method=method,
                                 headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(req, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


ISVC = "/apis/baton.dev/v1alpha1/namespaces/serving/inferenceservices"


def test_bookkeeping_generation_and_status_subresource(emulated: EmulatedCluster,
                                                       cluster: Cluster) -> None:
    created = cluster.create(isvc("x"))
    meta = created["metadata"]
    assert meta["uid"] and meta["generation"] == 1 and meta["creationTimestamp"]
    status, obj = request(emulated, "PATCH", f"{ISVC}/x", {"metadata": {"labels": {"a": "b"}}})
    assert status == 200 and obj["metadata"]["generation"] == 1
    assert int(obj["metadata"]["resourceVersion"]) > int(meta["resourceVersion"])
    _, obj = request(emulated, "PATCH", f"{ISVC}/x", {"spec": {"image": "y"},
                                                      "status": {"phase": "ignored"}})
    assert obj["metadata"]["generation"] == 2 and "status" not in obj
    _, obj = request(emulated, "PATCH", f"{ISVC}/x/status", {"spec": {"image": "ignored"},
                                                             "status": {"phase": "Ready"}})
    assert obj["status"] == {"phase": "Ready"} and obj["spec"]["image"] == "y"
    assert obj["metadata"]["generation"] == 2
    version = obj["metadata"]["resourceVersion"]
    _, same = request(emulated, "PATCH", f"{ISVC}/x", {"spec": {"image": "y"}})
    assert same["metadata"]["resourceVersion"] == version, "a no-op patch changed the object"


def test_json_patch_test_failure_is_422_and_stale_versions_conflict(
        emulated: EmulatedCluster, cluster: Cluster) -> None:
    cluster.create(isvc("x"))
    ops = [{"op": "test", "path": "/metadata/resourceVersion", "value": "0"},
           {"op": "add", "path": "/metadata/finalizers", "value": ["f"]}]
    status, body = request(emulated, "PATCH", f"{ISVC}/x", ops, "application/json-patch+json")
    assert status == 422 and body["reason"] == "Invalid"
    status, _ = request(emulated, "PATCH", f"{ISVC}/x", {"metadata": {"resourceVersion": "1"}})
    assert status == 409


def test_finalizers_hold_deletion_and_owners_collect_their_children(
        emulated: EmulatedCluster, cluster: Cluster) -> None:
    owner = cluster.create(isvc("x"))
    request(emulated, "PATCH", f"{ISVC}/x", {"metadata": {"finalizers": ["f"]}})
    ref = {"apiVersion": "baton.dev/v1alpha1", "kind": "InferenceService", "name": "x",
           "uid": owner["metadata"]["uid"], "controller": True}
    cluster.core.create_namespaced_service("serving", {
        "metadata": {"name": "child", "ownerReferences": [ref]}, "spec": {"ports": [{"port": 1}]}})
    cluster.delete("x")
    held = cluster.get("x")
    assert held is not None and held["metadata"]["deletionTimestamp"]
    assert cluster.child("Service", "child") is not None, "collected before its owner was gone"
    request(emulated, "PATCH", f"{ISVC}/x", {"metadata": {"finalizers": None}})
    assert cluster.get("x") is None
    assert cluster.child("Service", "child") is None
    # A child created after its owner went (by a pass that read the owner before): created,
    # then collected, as kube-controller-manager's garbage collector does.
    cluster.core.create_namespaced_service("serving", {
        "metadata": {"name": "late", "ownerReferences": [ref]}, "spec": {"ports": [{"port": 1}]}})
    assert cluster.child("Service", "late") is None


def test_watch_resumes_after_a_resource_version(emulated: EmulatedCluster,
                                                cluster: Cluster) -> None:
    first = cluster.create(isvc("a"))
    cluster.create(isvc("b"))
    since = first["metadata"]["resourceVersion"]
    url = f"{emulated.url}{ISVC}?watch=true&resourceVersion={since}"
    with urllib.request.urlopen(url, timeout=10) as stream:
        assert stream.headers["Content-Type"].startswith("application/json")
        event = json.loads(stream.readline())
    assert event["type"] == "ADDED" and event["object"]["metadata"]["name"] == "b"


def test_kubectl_delete_waits_for_the_finalizer_of_that_object_only(
        emulated: EmulatedCluster, cluster: Cluster) -> None:
    """`kubectl delete` waits with a watch-list (sendInitialEvents, a bookmark, a field
    selector on the name): it returns once that object is gone, not when another one goes."""
    for name in ("x", "other"):
        cluster.create(isvc(name))
        request(emulated, "PATCH", f"{ISVC}/{name}", {"metadata": {"finalizers": ["f"]}})
    waiting = subprocess.Popen([str(kubectl()), "-n", "serving", "delete", "bisvc", "x",
                                "--timeout=30s"], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: (cluster.get("x") or {})["metadata"].get("deletionTimestamp"), 10,
                 "x marked for deletion")
        cluster.delete("other")
        request(emulated, "PATCH", f"{ISVC}/other", {"metadata": {"finalizers": None}})
        with pytest.raises(subprocess.TimeoutExpired):
            waiting.wait(2)
        request(emulated, "PATCH", f"{ISVC}/x", {"metadata": {"finalizers": None}})
        assert waiting.wait(10) == 0, waiting.communicate()[0]
    finally:
        waiting.kill()
        output = waiting.communicate()[0]
    assert "bookmark" not in output, output  # client-go warns while it waits for one


def test_requests_cost_the_same_after_thousands(emulated: EmulatedCluster,
                                                cluster: Cluster) -> None:
    """kmock routes a request by scanning its log of requests: kept to the requests in
    flight, the thousandth GET costs what the first did."""
    cluster.create(isvc("x"))

    def mean_get_seconds(n: int = 40, rounds: int = 5) -> float:
        """The best of `rounds` means: a busy machine slows some rounds, a scan slows all."""
        means = []
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(n):
                assert request(emulated, "GET", f"{ISVC}/x")[0] == 200
            means.append((time.perf_counter() - start) / n)
        return min(means)

    first = mean_get_seconds()
    for _ in range(1500):
        request(emulated, "GET", f"{ISVC}/missing")
    assert emulated.request_count() > 1600
    assert mean_get_seconds() < 3 * first


DEPLOY = "/apis/apps/v1/namespaces/serving/deployments"


def deployment(name: str = "d", replicas: int = 1) -> dict[str, Any]:
    labels = {"app": name}
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": name, "namespace": "serving"},
            "spec": {"replicas": replicas, "selector": {"matchLabels": labels}, "template": {
                "metadata": {"labels": labels}, "spec": {"containers": [
                    {"name": "main", "image": "x:1", "args": ["a"],
                     "env": [{"name": "A", "value": "1"}]},
                    {"name": "side", "image": "s:1"}]}}}}


def test_strategic_merge_patch_and_scale_as_kubectl_sends_them(cluster: Cluster) -> None:
    """`kubectl set image` (strategic merge: containers merge by name) and `kubectl scale`
    (the scale subresource) change only what they mean to."""
    cluster.apps.create_namespaced_deployment("serving", deployment())
    run_kubectl("set", "image", "deploy/d", "main=evil:2")
    run_kubectl("scale", "deploy/d", "--replicas=5")
    run_kubectl("set", "env", "deploy/d", "-c", "main", "B=2")
    spec = (cluster.child("Deployment", "d") or {})["spec"]
    assert spec["replicas"] == 5
    main, side = spec["template"]["spec"]["containers"]
    assert (main["name"], main["image"], main["args"], side["image"]) == (
        "main", "evil:2", ["a"], "s:1")
    assert main["env"] == [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}]
    assert "$setElementOrder/containers" not in spec["template"]["spec"]
    scale = cluster.apps.read_namespaced_deployment_scale("d", "serving")
    assert scale.spec.replicas == 5 and scale.status.selector == "app=d"


def test_the_api_server_refuses_what_kube_apiserver_refuses(emulated: EmulatedCluster,
                                                            cluster: Cluster) -> None:
    status, body = request(emulated, "POST", DEPLOY, deployment(replicas=2**31),
                           "application/json")
    assert status == 400 and "cannot unmarshal number 2147483648" in body["message"]
    ingress = {"apiVersion": "networking.k8s.io/v1", "kind": "Ingress",
               "metadata": {"name": "i"}, "spec": {"rules": [{"host": "Bad_Host!"}]}}
    path = "/apis/networking.k8s.io/v1/namespaces/serving/ingresses"
    status, body = request(emulated, "POST", path, ingress, "application/json")
    assert status == 422 and 'spec.rules[0].host: Invalid value: "Bad_Host!"' in body["message"]
    emulated.deny("hosts", "ingresses", lambda obj: True, "only corp hosts")
    ingress["spec"]["rules"][0]["host"] = "llm.example.com"
    status, body = request(emulated, "POST", path, ingress, "application/json")
    assert status == 422 and "ValidatingAdmissionPolicy 'hosts'" in body["message"]
    assert cluster.child("Ingress", "i") is None and cluster.child("Deployment", "d") is None
    request(emulated, "POST", DEPLOY, deployment(), "application/json")
    status, _ = request(emulated, "PATCH", f"{DEPLOY}/d", {"spec": {"replicas": 2**31}})
    assert status == 400 and (cluster.child("Deployment", "d") or {})["spec"]["replicas"] == 1


def test_rbac_decides_for_service_accounts(emulated: EmulatedCluster,
                                           cluster: Cluster) -> None:
    rbac = kubernetes.client.RbacAuthorizationV1Api(cluster.client)
    rbac.create_namespaced_role("serving", {"metadata": {"name": "r"}, "rules": [
        {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["get", "list"]},
        {"apiGroups": ["apps"], "resources": ["deployments/scale"], "verbs": ["patch"]}]})
    rbac.create_namespaced_role_binding("serving", {
        "metadata": {"name": "rb"}, "roleRef": {"apiGroup": "rbac.authorization.k8s.io",
                                                "kind": "Role", "name": "r"},
        "subjects": [{"kind": "ServiceAccount", "name": "bot", "namespace": "ops"}]})
    cluster.apps.create_namespaced_deployment("serving", deployment())
    def bot(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(kubectl()), "-n", "serving", "--as",
                               "system:serviceaccount:ops:bot", *args],
                              capture_output=True, text=True, timeout=30)

    assert bot("get", "deploy", "d", "-o", "name").stdout.strip() == "deployment.apps/d"
    assert bot("scale", "deploy/d", "--replicas=3").returncode == 0
    denied = bot("delete", "deploy", "d")
    assert denied.returncode != 0
    assert ('deployments.apps "d" is forbidden: User "system:serviceaccount:ops:bot" cannot '
            'delete resource "deployments"') in denied.stderr
    assert bot("-n", "default", "get", "deploy").returncode != 0, "a Role is namespaced"
    decisions = {(a.verb, a.resource, ok) for a, ok in emulated.rbac_decisions(
        "system:serviceaccount:ops:bot")}
    assert {("get", "deployments", True), ("patch", "deployments/scale", True),
            ("delete", "deployments", False)} <= decisions


def test_custom_resources_print_their_columns_as_kube_apiserver_does(cluster: Cluster) -> None:
    """`kubectl get` receives a Table; every cell equals what kubectl's own JSONPath engine
    finds with the column's jsonPath (so the emulator's JSONPath agrees with client-go's)."""
    cluster.create(isvc("x", ingress={"host": "x.example.com"}))
    status = {"phase": "Progressing", "url": "http://x.example.com",
              "prefill": {"readyReplicas": 1, "desiredReplicas": 1},
              "conditions": [{"type": "Progressing", "status": "True", "reason": "RollingOut"},
                             {"type": "Ready", "status": "False", "reason": "PodsNotReady"}]}
    cluster.custom.patch_namespaced_custom_object_status(
        "baton.dev", "v1alpha1", "serving", "inferenceservices", "x", {"status": status})
    crd = yaml.safe_load(CRD_FILE.read_text())
    columns = crd["spec"]["versions"][0]["additionalPrinterColumns"]
    cells = table_cells(run_kubectl("get", "bisvc", "x", "-o", "wide"))[0]
    assert list(cells) == ["NAME", *(c["name"].upper() for c in columns)]
    for column in columns:
        if column["type"] != "date":
            expected = run_kubectl("get", "bisvc", "x", "-o", f"jsonpath={{{column['jsonPath']}}}")
            assert cells[column["name"].upper()] == expected, column["name"]
    assert "PodsNotReady" in cells.values() and "http://x.example.com" in cells.values()
    assert run_kubectl("get", "bisvc", "-o", "name") == "inferenceservice.baton.dev/x\n"
