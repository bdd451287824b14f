"""The compatibility layer over kmock behaves like an API server where the operator relies on
it; if these fail, the operator tests prove nothing."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import pytest
from isvc_helpers import Cluster, isvc
from kmock_compat import EmulatedCluster

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
