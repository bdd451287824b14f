"""Which autoscaler and which scrape target appear depends on what the cluster serves (issue
28, items 3-4): kopf for real against the emulated API, KEDA, the custom metrics API and the
Prometheus operator installed one after the other as stand-in CRDs (tests/kube/stand_in_apis.py)."""

from __future__ import annotations

import pytest

from tests.kube import stand_in_apis
from tests.kube.isvc_helpers import NAMESPACE, Cluster, OperatorFactory, isvc, wait_for

pytestmark = pytest.mark.timeout(120)
SCALED = {"autoscaling": {"prefill": {"min": 1, "max": 3}, "decode": {"min": 2, "max": 4}}}


def test_the_scaler_follows_what_the_cluster_serves(cluster: Cluster,
                                                    operator: OperatorFactory) -> None:
    with operator():
        # 1. a bare cluster: nothing can scale on serving signals; it says so and holds min
        cluster.create(isvc("bare", **SCALED))
        cond = wait_for(lambda: cluster.condition("bare", "Autoscaling"), 20, "a condition")
        assert (cond["status"], cond["reason"]) == ("False", "NoMetricsSource")
        assert "spec.autoscaling.prefill.metric queue cannot scale" in cond["message"]
        assert "spec.autoscaling.decode.metric kv cannot scale" in cond["message"]
        children = cluster.children(pooled=True)
        assert not [k for k in children if k[0] == "HorizontalPodAutoscaler"]
        assert children["Deployment", "bare-decode"]["spec"]["replicas"] == 2
        pod = children["Deployment", "bare-decode"]["spec"]["template"]["metadata"]
        assert pod["annotations"]["prometheus.io/scrape"] == "true"

        # 2. prometheus-adapter's API served: HPAs on Pods metrics
        stand_in_apis.install(cluster.client, "custom-metrics")
        cluster.create(isvc("adapted", **SCALED))
        hpa = wait_for(lambda: cluster.child("HorizontalPodAutoscaler", "adapted-decode"), 20,
                       "the decode HPA")
        assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "baton_kv_usage_ratio"
        prefill = wait_for(lambda: cluster.child("HorizontalPodAutoscaler", "adapted-prefill"))
        assert prefill["spec"]["metrics"][0]["pods"]["metric"]["name"] == (
            "baton_queued_prompt_tokens")
        wait_for(lambda: cluster.condition("adapted", "Autoscaling").get("status") == "True",
                 20, "Autoscaling=True")

        # 3. KEDA served too: ScaledObjects, and the HPAs of a service made earlier go
        stand_in_apis.install(cluster.client, "keda")
        cluster.patch("adapted", {"spec": {"autoscaling": {"decode": {"max": 5}}}})
        # (a pass that began before the patch may write the old max first: wait for the new)
        scaled = wait_for(lambda: (so := stand_in_apis.get(
            cluster.custom, "keda", NAMESPACE, "adapted-decode")) is not None
            and so["spec"]["maxReplicaCount"] == 5 and so, 20, "a ScaledObject with max 5")
        assert scaled["spec"]["maxReplicaCount"] == 5
        trigger = scaled["spec"]["triggers"][0]
        assert trigger["type"] == "prometheus"
        assert trigger["metadata"]["serverAddress"] == "http://prometheus.test:9090"
        assert trigger["metadata"]["query"].startswith("sum(baton_kv_usage_ratio{")
        wait_for(lambda: cluster.child("HorizontalPodAutoscaler", "adapted-decode") is None, 20,
                 "the HPA replaced")
        assert scaled["metadata"]["ownerReferences"][0]["name"] == "adapted"
        wait_for(lambda: "KEDA ScaledObject" in cluster.condition("adapted", "Autoscaling").get(
            "message", ""), 20, "the condition naming KEDA")

        # 4. the Prometheus operator served: a PodMonitor instead of scrape annotations
        stand_in_apis.install(cluster.client, "prometheus-operator")
        cluster.create(isvc("watched"))
        monitor = wait_for(lambda: stand_in_apis.get(cluster.custom, "prometheus-operator",
                                                     NAMESPACE, "watched"), 20, "a PodMonitor")
        assert monitor["spec"]["podTargetLabels"] == ["app.kubernetes.io/instance",
                                                      "baton.dev/role"]
        decode = wait_for(lambda: cluster.pool("watched", "decode"))
        annotations = decode["spec"]["template"]["metadata"]["annotations"]
        assert "prometheus.io/scrape" not in annotations
        assert cluster.condition("watched", "Autoscaling") == {}  # it does not autoscale
