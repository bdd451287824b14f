"""The fast check (no Prometheus needed): every series any panel, alert, adapter rule or KEDA
trigger reads is one the workers, the router or the operator export, read from their
registries; the adapter serves every Pods metric the operator's HPAs ask for; the dashboard
covers what an operator of the service needs to see (issue 28, item 4)."""

from __future__ import annotations

import pytest
from baton_operator.builders.autoscaling import SIGNALS
from baton_operator.metrics import OperatorMetrics
from prometheus_client import CollectorRegistry

from runtime.router.metrics import RouterMetrics
from runtime.server.metrics import Metrics
from tests.monitoring.queries import (
    adapter_rules,
    all_queries,
    dashboard_queries,
    metric_names,
)


def sample_names(registry: CollectorRegistry) -> set[str]:
    """Every series name a registry exposes (counters' _total, histograms' _bucket ...)."""
    names = set()
    for family in registry.collect():
        names.add(family.name)
        names |= {sample.name for sample in family.samples}
        if family.type == "counter":
            names.add(f"{family.name}_total")
        if family.type == "histogram":
            names |= {f"{family.name}_{s}" for s in ("bucket", "sum", "count")}
    return names


def exported() -> set[str]:
    server = Metrics()
    return (sample_names(server.registry) | sample_names(RouterMetrics().registry)
            | sample_names(OperatorMetrics().registry))


def test_names_are_read_from_queries_not_labels() -> None:
    expr = ('histogram_quantile(0.9, sum by (le, baton_dev_role) (rate(baton_x_bucket'
            '{namespace=~".+",baton_dev_role="decode"}[1m]))) / max(baton_y) > 2')
    assert metric_names(expr) == {"baton_x_bucket", "baton_y"}
    assert "baton_no_such_metric" not in exported()  # so the check below can fail


@pytest.mark.parametrize("query", all_queries(), ids=lambda q: q.where)
def test_every_query_reads_exported_series(query) -> None:  # type: ignore[no-untyped-def]
    names = metric_names(query.expr)
    assert names, f"{query.where}: reads no baton series: {query.expr}"
    missing = names - exported()
    assert not missing, f"{query.where}: {sorted(missing)} not exported"


def test_the_adapter_serves_every_pods_metric_the_hpas_ask_for() -> None:
    served = {rule["name"]["as"] for rule in adapter_rules()}
    assert served == {signal.pods_metric for signal in SIGNALS.values()}
    for rule in adapter_rules():
        series = rule["seriesQuery"].split("{")[0]
        assert series in exported(), series
        assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"},
                                                  "pod": {"resource": "pod"}}


def test_the_dashboard_covers_the_serving_signals() -> None:
    read = set().union(*(metric_names(q.expr) for q in dashboard_queries()))
    wanted = {
        "TTFT": "baton_time_to_first_token_seconds_bucket",
        "ITL": "baton_inter_token_latency_seconds_bucket",
        "throughput": "baton_generation_tokens_total",
        "queue depth": "baton_queue_depth",
        "queued prompt tokens": "baton_queued_prompt_tokens",
        "KV use": "baton_kv_usage_ratio",
        "transfer latency": "baton_kv_transfer_seconds_bucket",
        "transfer bytes": "baton_kv_transfer_bytes_total",
        "transfer failures": "baton_kv_transfer_failures_total",
        "prefix cache hits": "baton_prefix_cache_hit_tokens_total",
    }
    assert not {topic for topic, name in wanted.items() if name not in read}
