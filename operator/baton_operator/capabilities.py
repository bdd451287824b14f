"""What the cluster offers beyond core Kubernetes, asked of the API on every pass.

| capability       | asked as                                    | it decides                    |
|------------------|---------------------------------------------|-------------------------------|
| keda             | GET /apis/keda.sh/v1alpha1 lists scaledobjects | serving-signal autoscaling by a KEDA ScaledObject |
| custom_metrics   | GET /apis/custom.metrics.k8s.io/v1beta1 answers 200 | else by an HPA on a Pods metric (prometheus-adapter) |
| pod_monitors     | GET /apis/monitoring.coreos.com/v1 lists podmonitors | a PodMonitor per service, else scrape annotations |

These are discovery reads: the API server lets every authenticated client make them (the
`system:discovery` role), so they need no RBAC rule and work with a namespaced Role too.
Discovery answers for what is *served*: a CRD that is installed, an aggregated API whose
backend is up (an APIService whose adapter is down answers 503, read as absent).
"""

from __future__ import annotations

from dataclasses import dataclass

from baton_operator.kube import Kube

KEDA = ("keda.sh/v1alpha1", "scaledobjects")
CUSTOM_METRICS = "custom.metrics.k8s.io/v1beta1"
PROMETHEUS_OPERATOR = ("monitoring.coreos.com/v1", "podmonitors")


@dataclass(frozen=True)
class Capabilities:
    keda: bool = False
    custom_metrics: bool = False
    pod_monitors: bool = False
    prometheus_url: str = ""  # what KEDA's Prometheus triggers query (operator config)


def probe(kube: Kube, prometheus_url: str) -> Capabilities:
    """Ask the API server's discovery what this cluster serves right now."""
    return Capabilities(
        keda=KEDA[1] in (kube.discover(KEDA[0]) or ()),
        custom_metrics=kube.discover(CUSTOM_METRICS) is not None,
        pod_monitors=PROMETHEUS_OPERATOR[1] in (kube.discover(PROMETHEUS_OPERATOR[0]) or ()),
        prometheus_url=prometheus_url,
    )
