"""Autoscaling on serving signals and how Prometheus finds the pods (issue 28, items 3-4):
pure builders, one cluster shape at a time (`Capabilities`), no API server."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
from baton_operator.builders import (
    autoscaling_condition,
    build_children,
    build_deployment,
    build_hpa,
    build_pod_monitor,
    build_scaled_object,
    optional_children,
)
from baton_operator.builders.autoscaling import SIGNALS
from baton_operator.builders.pods import spec_revision
from baton_operator.capabilities import Capabilities
from baton_operator.spec import InvalidSpec

from tests.operator.test_operator_builders import service

PROM = "http://prometheus-operated.monitoring.svc:9090"
BARE = Capabilities()
ADAPTER = Capabilities(custom_metrics=True)
KEDA = Capabilities(keda=True, custom_metrics=True, prometheus_url=PROM)
SELECTOR = 'namespace="ml",app_kubernetes_io_instance="llm",baton_dev_role="{}"'
# metric, spec target -> (adapter Pods metric, its averageValue, KEDA metricType, query, threshold)
EXPECTED = {
    "queue": ("baton_queued_prompt_tokens", "512", "AverageValue",
              "sum(baton_queued_prompt_tokens{%s})", "512"),
    "kv": ("baton_kv_usage_ratio", "700m", "AverageValue", "sum(baton_kv_usage_ratio{%s})",
           "0.7"),
    "ttft": ("baton_time_to_first_token_p90_seconds", "1500m", "Value",
             "histogram_quantile(0.9, sum by (le) "
             "(rate(baton_time_to_first_token_seconds_bucket{%s}[2m])))", "1.5"),
    "itl": ("baton_inter_token_latency_p90_seconds", "80m", "Value",
            "histogram_quantile(0.9, sum by (le) "
            "(rate(baton_inter_token_latency_seconds_bucket{%s}[2m])))", "0.08"),
}
TARGETS = {"queue": 512, "kv": 70, "ttft": 1500, "itl": 80}


def scaled(role: str, metric: str | None, **extra: Any) -> Any:
    scale = {"min": 1, "max": 5, **({"metric": metric} if metric else {}), **extra}
    return service(autoscaling={role: scale})


def kinds(children: list[dict[str, Any]]) -> set[tuple[str, str]]:
    return {(c["kind"], c["metadata"]["name"]) for c in children}


@pytest.mark.parametrize(("role", "metric"), [
    (role, metric) for role in ("prefill", "decode") for metric in EXPECTED
    if (role, metric) != ("prefill", "itl")])
def test_with_keda_a_serving_signal_is_a_scaled_object_with_a_prometheus_trigger(
        role: str, metric: str) -> None:
    svc = scaled(role, metric, target=TARGETS[metric])
    _, _, metric_type, query, threshold = EXPECTED[metric]
    scaled_object = build_scaled_object(svc, role, KEDA)  # type: ignore[arg-type]
    assert scaled_object is not None
    assert scaled_object["apiVersion"] == "keda.sh/v1alpha1"
    assert scaled_object["metadata"]["name"] == f"llm-{role}"
    assert scaled_object["spec"] == {
        "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment",
                           "name": f"llm-{role}-{spec_revision(svc)}"},
        "minReplicaCount": 1, "maxReplicaCount": 5,
        "triggers": [{"type": "prometheus", "metricType": metric_type, "metadata": {
            "serverAddress": PROM, "query": query % SELECTOR.format(role),
            "threshold": threshold}}]}
    assert build_hpa(svc, role, KEDA) is None  # type: ignore[arg-type]
    assert "replicas" not in build_deployment(svc, role, KEDA)["spec"]  # type: ignore[arg-type]
    assert ("ScaledObject", f"llm-{role}") in kinds(build_children(svc, KEDA))


@pytest.mark.parametrize("metric", list(EXPECTED))
def test_without_keda_a_serving_signal_is_an_hpa_on_a_pods_metric(metric: str) -> None:
    svc = scaled("decode", metric, target=TARGETS[metric])
    pods_metric, average, *_ = EXPECTED[metric]
    hpa = build_hpa(svc, "decode", ADAPTER)
    assert hpa is not None
    assert hpa["spec"]["metrics"] == [{"type": "Pods", "pods": {
        "metric": {"name": pods_metric},
        "target": {"type": "AverageValue", "averageValue": average}}}]
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 5)
    kubernetes_validate.validate(hpa, "1.30", strict=True)
    assert build_scaled_object(svc, "decode", ADAPTER) is None
    assert "replicas" not in build_deployment(svc, "decode", ADAPTER)["spec"]
    # KEDA without a Prometheus address cannot query anything: the adapter's HPA instead
    no_address = Capabilities(keda=True, custom_metrics=True)
    assert build_scaled_object(svc, "decode", no_address) is None
    assert build_hpa(svc, "decode", no_address) == hpa


@pytest.mark.parametrize("metric", ["queue", "kv", "ttft"])
def test_with_neither_the_pool_keeps_min_and_the_condition_says_why(metric: str) -> None:
    svc = service(autoscaling={"prefill": {"min": 2, "max": 5, "metric": metric},
                               "decode": {"min": 1, "max": 3, "metric": "cpu"}})
    assert build_hpa(svc, "prefill", BARE) is None
    assert build_scaled_object(svc, "prefill", BARE) is None
    assert build_deployment(svc, "prefill", BARE)["spec"]["replicas"] == 2
    assert build_hpa(svc, "decode", BARE) is not None  # cpu needs no metrics API
    condition = autoscaling_condition(svc, BARE)
    assert condition is not None
    assert (condition["type"], condition["status"], condition["reason"]) == (
        "Autoscaling", "False", "NoMetricsSource")
    message = condition["message"]
    assert f"spec.autoscaling.prefill.metric {metric} cannot scale" in message
    assert "keda.sh/v1alpha1" in message and "custom.metrics.k8s.io/v1beta1" in message
    assert "prefill stays at min (2) replicas" in message
    assert "decode: HPA on cpu utilization (80%)" in message
    keda_no_address = autoscaling_condition(svc, Capabilities(keda=True))
    assert keda_no_address is not None
    assert "autoscaling.prometheusAddress" in keda_no_address["message"]


def test_the_condition_names_each_pools_scaler_when_all_can_scale() -> None:
    svc = service(autoscaling={"prefill": {"min": 1, "max": 4}, "decode": {"min": 1, "max": 4}})
    keda = autoscaling_condition(svc, KEDA)
    assert keda == {"type": "Autoscaling", "status": "True", "reason": "ScalerReady",
                    "message": "prefill: KEDA ScaledObject on queued prompt tokens (Prometheus, "
                               "target 2048); decode: KEDA ScaledObject on KV cache use "
                               "(Prometheus, target 0.8)"}
    adapter = autoscaling_condition(svc, ADAPTER)
    assert adapter is not None and adapter["status"] == "True"
    assert "decode: HPA on KV cache use (baton_kv_usage_ratio, target 0.8)" in adapter["message"]
    assert autoscaling_condition(service(), KEDA) is None


def test_defaults_prefill_on_queued_prompt_tokens_decode_on_kv_use() -> None:
    svc = service(autoscaling={"prefill": {"min": 1, "max": 2}, "decode": {"min": 1, "max": 2}})
    assert (svc.autoscaling["prefill"].metric, svc.autoscaling["prefill"].target) == ("queue", 2048)
    assert (svc.autoscaling["decode"].metric, svc.autoscaling["decode"].target) == ("kv", 80)
    assert SIGNALS["queue"].series == "baton_queued_prompt_tokens"


@pytest.mark.parametrize(("scale", "ok"), [
    ({"metric": "queue", "target": 100_000}, True), ({"metric": "ttft", "target": 5000}, True),
    ({"metric": "kv", "target": 101}, False), ({"metric": "cpu", "target": 101}, False),
    ({"metric": "gpu"}, False), ({"metric": "itl", "target": 0}, False)])
def test_targets_are_checked_in_the_metrics_unit(scale: dict[str, Any], ok: bool) -> None:
    with pytest.raises(InvalidSpec, match=r"spec\.autoscaling\.prefill\.metric 'itl'"):
        service(autoscaling={"prefill": {"min": 1, "max": 2, "metric": "itl"}})  # no ITL there
    try:
        service(autoscaling={"decode": {"min": 1, "max": 2, **scale}})
    except InvalidSpec:
        assert not ok
    else:
        assert ok


def test_scalers_that_the_cluster_stops_serving_are_cleaned_up() -> None:
    svc = scaled("decode", "kv")
    assert ("keda.sh/v1alpha1", "ScaledObject", "llm-decode") in optional_children(svc, KEDA)
    # kinds the cluster does not serve are not asked for (no request to a missing API)
    assert not [k for k in optional_children(svc, BARE) if k[1] in ("ScaledObject", "PodMonitor")]
    with_adapter = kinds(build_children(svc, ADAPTER))
    assert ("HorizontalPodAutoscaler", "llm-decode") in with_adapter
    assert ("ScaledObject", "llm-decode") not in with_adapter


# -- how Prometheus finds the pods ---------------------------------------------------------

def test_a_pod_monitor_when_the_prometheus_operator_is_served() -> None:
    svc = service()
    caps = Capabilities(pod_monitors=True)
    monitor = build_pod_monitor(svc, caps)
    assert monitor is not None and monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["name"] == "llm"
    assert monitor["metadata"]["ownerReferences"][0]["uid"] == svc.uid
    assert monitor["spec"] == {
        "selector": {"matchLabels": {"app.kubernetes.io/name": "baton",
                                     "app.kubernetes.io/instance": "llm"}},
        "podTargetLabels": ["app.kubernetes.io/instance", "baton.dev/role"],
        "podMetricsEndpoints": [{"port": "http", "path": "/metrics", "interval": "15s"}]}
    for role in ("prefill", "decode", "router"):
        pod = build_deployment(svc, role, caps)["spec"]["template"]  # type: ignore[arg-type]
        assert not [k for k in pod["metadata"]["annotations"] if k.startswith("prometheus.io")]
        assert any(p["name"] == "http" and p["containerPort"] == 8000
                   for p in pod["spec"]["containers"][0]["ports"])
    # built whenever the API is served, so never deleted by the operator (no RBAC delete)
    assert not [k for k in optional_children(svc, caps) if k[1] == "PodMonitor"]
    assert build_pod_monitor(svc, BARE) is None


def test_scrape_annotations_otherwise_and_a_templates_own_win() -> None:
    svc = service(decode={"template": {"metadata": {"annotations": {
        "prometheus.io/scrape": "false"}}}})
    for role, scrape in (("prefill", "true"), ("decode", "false"), ("router", "true")):
        pod = build_deployment(svc, role, BARE)["spec"]["template"]  # type: ignore[arg-type]
        annotations = pod["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == scrape
        assert annotations["prometheus.io/port"] == "8000"
        assert annotations["prometheus.io/path"] == "/metrics"
