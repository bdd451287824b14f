"""How Prometheus finds a service's pods: a PodMonitor where the Prometheus operator's CRDs
are served, else the `prometheus.io/*` scrape annotations on every pod.

Either way every series carries `namespace`, `pod`, `app_kubernetes_io_instance` and
`baton_dev_role` (the PodMonitor copies the two pod labels with `podTargetLabels`; an
annotation-scraping job does the same with a `labelmap` of the pod labels, as the Prometheus
chart's `kubernetes-pods` job does). The dashboard, the alerts, the adapter rules and KEDA's
queries select pools by those labels.
"""

from __future__ import annotations

from typing import Any

from baton_operator import MANAGER
from baton_operator.builders.common import (
    HTTP_PORT,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    LABEL_PART_OF,
    LABEL_ROLE,
    owner_reference,
)
from baton_operator.capabilities import PROMETHEUS_OPERATOR, Capabilities
from baton_operator.spec import InferenceService

METRICS_PATH = "/metrics"
SCRAPE_INTERVAL = "15s"
SCRAPE_ANNOTATIONS = {"prometheus.io/scrape": "true", "prometheus.io/port": str(HTTP_PORT),
                      "prometheus.io/path": METRICS_PATH}


def build_pod_monitor(svc: InferenceService, caps: Capabilities) -> dict[str, Any] | None:
    """monitoring.coreos.com/v1 PodMonitor `<name>` over the router, prefill and decode pods."""
    if not caps.pod_monitors:
        return None
    return {
        "apiVersion": PROMETHEUS_OPERATOR[0],
        "kind": "PodMonitor",
        "metadata": {
            "name": svc.name,
            "namespace": svc.namespace,
            "labels": {LABEL_NAME: "baton", LABEL_INSTANCE: svc.name,
                       LABEL_MANAGED_BY: MANAGER, LABEL_PART_OF: "baton"},
            "ownerReferences": [owner_reference(svc)],
        },
        "spec": {
            "selector": {"matchLabels": {LABEL_NAME: "baton", LABEL_INSTANCE: svc.name}},
            "podTargetLabels": [LABEL_INSTANCE, LABEL_ROLE],
            "podMetricsEndpoints": [{"port": "http", "path": METRICS_PATH,
                                     "interval": SCRAPE_INTERVAL}],
        },
    }


def scrape_annotations(template: dict[str, Any], caps: Capabilities) -> None:
    """Without a PodMonitor, annotate the pod template for annotation-based scraping (a
    template's own `prometheus.io/*` annotations win)."""
    if caps.pod_monitors:
        return
    annotations = template.setdefault("metadata", {}).setdefault("annotations", {})
    for key, value in SCRAPE_ANNOTATIONS.items():
        annotations.setdefault(key, value)
