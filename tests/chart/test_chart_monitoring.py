"""The chart's monitoring pieces (issue 28, item 4): the operator's metrics port and who may
reach it, the Grafana dashboard ConfigMap, the PrometheusRule and the operator's PodMonitor,
each off or on by values; built-in kinds validated with kubernetes-validate."""

from __future__ import annotations

import json

import pytest
import yaml
from chart_support import Render, only, operator_container, validate_builtin

from charts.manifests import CHART_DIR

pytestmark = pytest.mark.timeout(120)
FILES = CHART_DIR / "files"


def kinds(objs: list[dict]) -> list[str]:  # type: ignore[type-arg]
    return sorted(o["kind"] for o in objs)


def test_by_default_the_operator_serves_metrics_to_nobody_and_nothing_else_renders(
        render: Render) -> None:
    objs = render()
    assert kinds(objs) == ["ClusterRole", "ClusterRoleBinding", "Deployment", "NetworkPolicy",
                           "ServiceAccount"]
    container = operator_container(objs)
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["BATON_OPERATOR_METRICS_PORT"] == "8081"
    assert env["BATON_OPERATOR_PROMETHEUS_URL"] == "http://prometheus-operated.monitoring.svc:9090"
    pod = only(objs, "Deployment")["spec"]["template"]["metadata"]
    assert pod["annotations"] == {"prometheus.io/scrape": "true", "prometheus.io/port": "8081",
                                  "prometheus.io/path": "/metrics"}
    assert only(objs, "NetworkPolicy")["spec"]["ingress"] == []


def test_metrics_off(render: Render) -> None:
    objs = render({"metrics": {"operatorPort": 0}, "podAnnotations": {"a": "b"}})
    container = operator_container(objs)
    assert [p["name"] for p in container["ports"]] == ["health"]
    assert only(objs, "Deployment")["spec"]["template"]["metadata"]["annotations"] == {"a": "b"}


def test_everything_on(render: Render) -> None:
    peer = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    objs = render({"dashboards": {"enabled": True, "namespace": "grafana"},
                   "prometheusRules": {"enabled": True, "labels": {"release": "kps"}},
                   "metrics": {"podMonitor": True, "scrapeFrom": [peer]}})
    assert kinds(objs) == ["ClusterRole", "ClusterRoleBinding", "ConfigMap", "Deployment",
                           "NetworkPolicy", "PodMonitor", "PrometheusRule", "ServiceAccount"]
    dashboard = only(objs, "ConfigMap")
    assert dashboard["metadata"]["namespace"] == "grafana"
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads((FILES / "dashboards" / "baton.json").read_text())
    assert json.loads(dashboard["data"]["baton.json"]) == shipped
    rule = only(objs, "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "kps"
    assert rule["spec"] == yaml.safe_load((FILES / "prometheus-rules.yaml").read_text())
    monitor = only(objs, "PodMonitor")
    assert monitor["spec"]["podMetricsEndpoints"] == [{"port": "metrics", "path": "/metrics"}]
    assert "annotations" not in only(objs, "Deployment")["spec"]["template"]["metadata"]
    policy = only(objs, "NetworkPolicy")
    assert policy["spec"]["ingress"] == [{"from": [peer],
                                          "ports": [{"port": 8081, "protocol": "TCP"}]}]
    for obj in objs:
        if obj["kind"] not in ("PodMonitor", "PrometheusRule"):  # CRDs: no schema shipped
            validate_builtin(obj)


def test_every_dashboard_panel_has_a_query_and_a_unique_id() -> None:
    dashboard = json.loads((FILES / "dashboards" / "baton.json").read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)) >= 12
    assert all(p["targets"] and all(t["expr"] for t in p["targets"]) for p in dashboard["panels"])
    names = [v["name"] for v in dashboard["templating"]["list"]]
    assert names == ["datasource", "namespace", "service"]
