"""Every PromQL expression baton ships, in one list: the Grafana dashboard's panels, the alert
rules, the prometheus-adapter rules (their templates filled in as the adapter does) and the
queries the operator writes into KEDA triggers; and the metric names each one reads."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import yaml
from baton_operator.builders.autoscaling import SIGNALS, pool_selector
from baton_operator.spec import NO_SIGNAL, parse_service

FILES = Path(__file__).resolve().parents[2] / "charts" / "baton" / "files"
DASHBOARD = FILES / "dashboards" / "baton.json"
RULES = FILES / "prometheus-rules.yaml"
ADAPTER = FILES / "prometheus-adapter-values.yaml"
# what the checks put for Grafana's variables and the adapter's templates
ANY = ".+"
LOCAL = {"namespace": "local", "instance": "local"}  # the labels the test scrape config sets


@dataclass(frozen=True)
class Query:
    where: str  # e.g. "dashboard: KV cache use [A]"
    expr: str
    alert: bool = False  # an alert's condition: data only while it fires


def dashboard_queries(rate_interval: str = "1m") -> list[Query]:
    dashboard = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = (target["expr"].replace("$namespace", ANY).replace("$service", ANY)
                    .replace("$__rate_interval", rate_interval))
            out.append(Query(f"dashboard: {panel['title']} [{target['refId']}]", expr))
    return out


_THRESHOLD = re.compile(r"\s*(>|<|==|!=|>=|<=)\s*[0-9.]+\s*$")


def alert_queries() -> list[Query]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [Query(f"alert: {rule['alert']}", rule["expr"], alert=True)
            for group in groups for rule in group["rules"]]


def alert_signals() -> list[Query]:
    """Each alert's expression without its threshold: what it compares, which has data
    whether or not the alert fires."""
    out = []
    for q in alert_queries():
        signal = _THRESHOLD.sub("", q.expr.strip())
        assert signal != q.expr.strip(), f"{q.where}: no threshold at the end"
        out.append(Query(q.where.replace("alert:", "alert signal:"), signal))
    return out


def adapter_rules() -> list[dict]:  # type: ignore[type-arg]
    return list(yaml.safe_load(ADAPTER.read_text())["rules"]["custom"])


def adapter_queries() -> list[Query]:
    """Each rule's metricsQuery as the adapter sends it for the pods of one namespace."""
    out = []
    for rule in adapter_rules():
        series = rule["seriesQuery"].split("{")[0]
        expr = (rule["metricsQuery"].replace("<<.Series>>", series)
                .replace("<<.LabelMatchers>>", f'namespace="{LOCAL["namespace"]}",pod=~"{ANY}"')
                .replace("<<.GroupBy>>", "pod"))
        out.append(Query(f"adapter: {rule['name']['as']}", expr))
    return out


def keda_queries() -> list[Query]:
    """The operator's KEDA trigger queries for a service named like the test's scrape labels."""
    svc = parse_service({"metadata": {"name": LOCAL["instance"], "namespace": LOCAL["namespace"]},
                         "spec": {"model": {"uri": "builtin:smollm2-135m"}}})
    return [Query(f"keda: {metric} on {role}", signal.query(pool_selector(svc, role)))
            for metric, signal in SIGNALS.items() for role in ("prefill", "decode")
            if (role, metric) not in NO_SIGNAL]


def all_queries() -> list[Query]:
    return dashboard_queries() + alert_queries() + adapter_queries() + keda_queries()


_GROUPING = re.compile(r"\b(by|without|on|ignoring)\s*\([^)]*\)")
_MATCHER = re.compile(r"\b[a-zA-Z_]\w*\s*(=~|!~|!=|=)")
_STRING = re.compile(r'"[^"]*"')
_NAME = re.compile(r"\bbaton_\w+")


def metric_names(expr: str) -> set[str]:
    """The baton_* series an expression reads (label names and strings left out)."""
    bare = _MATCHER.sub(" ", _GROUPING.sub(" ", _STRING.sub('""', expr)))
    return set(_NAME.findall(bare))
