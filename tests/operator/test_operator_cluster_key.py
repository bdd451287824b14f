"""Each InferenceService gets one cluster-key Secret: created with its children, owned by the
service, never rewritten by later passes (its pods read it once at start), kept apart from
every other service's, and a name held by someone else is a conflict, not a takeover."""

from __future__ import annotations

import base64

import pytest
from kubernetes.client.exceptions import ApiException

from tests.kube.isvc_helpers import Cluster, OperatorFactory, isvc, wait_for
from tests.kube.kmock_cluster import EmulatedCluster

pytestmark = pytest.mark.timeout(90)


def key_of(cluster: Cluster, name: str) -> dict | None:
    try:
        secret = cluster.core.read_namespaced_secret(f"{name}-cluster-key", cluster.namespace)
    except ApiException as e:
        if e.status == 404:
            return None
        raise
    return dict(cluster.client.sanitize_for_serialization(secret))


def test_one_stable_key_per_service(emulated: EmulatedCluster, cluster: Cluster,
                                    operator: OperatorFactory) -> None:
    with operator():
        a = cluster.create(isvc("a"))
        cluster.create(isvc("b"))
        first = wait_for(lambda: key_of(cluster, "a"), 20, "a's cluster key")
        other = wait_for(lambda: key_of(cluster, "b"), 20, "b's cluster key")
        (ref,) = first["metadata"]["ownerReferences"]
        assert (ref["name"], ref["uid"], ref["controller"]) == ("a", a["metadata"]["uid"], True)
        secret = base64.b64decode(first["data"]["key"])
        assert len(secret) == 64 and secret != base64.b64decode(other["data"]["key"])
        cluster.patch("a", {"spec": {"decode": {"replicas": 2}}})  # another pass, and another
        wait_for(lambda: (cluster.pool("a", "decode") or {}).get("spec", {}).get(
            "replicas") == 2, 20, "the decode scaled")
        assert key_of(cluster, "a")["data"] == first["data"]  # never rewritten


def test_a_secret_of_that_name_held_by_another_is_a_conflict(
        emulated: EmulatedCluster, cluster: Cluster, operator: OperatorFactory) -> None:
    cluster.core.create_namespaced_secret(cluster.namespace, {
        "metadata": {"name": "c-cluster-key"}, "data": {"key": base64.b64encode(b"x").decode()}})
    with operator():
        cluster.create(isvc("c"))
        cond = wait_for(lambda: [c for c in (cluster.get("c") or {}).get("status", {}).get(
            "conditions", []) if c.get("reason") == "NameConflict"], 20, "a NameConflict")
        assert "c-cluster-key" in cond[0]["message"]
    assert key_of(cluster, "c")["data"]["key"] == base64.b64encode(b"x").decode()  # untouched
