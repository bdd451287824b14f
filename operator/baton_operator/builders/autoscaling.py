"""Autoscalers of the worker pools, and the status condition that says how each one scales.

| metric        | scaled by                                   | target unit            |
|---------------|---------------------------------------------|------------------------|
| cpu, memory   | HPA (autoscaling/v2), Resource utilization   | percent                |
| queue, kv, ttft, itl | KEDA ScaledObject with a Prometheus trigger when KEDA is served and the operator knows a Prometheus address; else an HPA on a Pods metric when the custom metrics API is served (prometheus-adapter with the chart's rules); else nothing: the pool stays at `min` and the condition says why | tokens per pod, percent, milliseconds |

A pool whose autoscaler exists leaves `spec.replicas` of its Deployment to it. With
`spec.autoscaling.mode: planner` there is none: the operator's P:D planner (planning.py) sets
both worker pools' replicas, and the Autoscaling condition says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from baton_operator.builders.common import child_name, deployment_name, metadata
from baton_operator.builders.pods import spec_revision
from baton_operator.capabilities import CUSTOM_METRICS, KEDA, Capabilities
from baton_operator.spec import WORKER_ROLES, Autoscale, InferenceService, WorkerRole

Scaler = Literal["hpa", "keda"]
QUANTILE = 0.9
RATE_WINDOW = "2m"


@dataclass(frozen=True)
class Signal:
    """A serving signal: the series the workers export, the Pods metric the adapter serves
    (tests/chart checks the chart's adapter rules serve every one) and how a target reads."""

    describe: str
    series: str  # what the workers export (a histogram's name without _bucket)
    pods_metric: str  # per pod, through the custom metrics API
    per_pod: bool  # KEDA: the pool's sum, divided by the pods (AverageValue), or one Value
    scale: float  # spec target -> the metric's unit (percent -> ratio, ms -> seconds)

    def threshold(self, target: int) -> str:
        return _number(target * self.scale)

    def quantity(self, target: int) -> str:
        """The target as a Kubernetes quantity (milli-units keep a fraction exact)."""
        milli = round(target * self.scale * 1000)
        return str(milli // 1000) if milli % 1000 == 0 else f"{milli}m"

    def query(self, selector: str) -> str:
        """PromQL for KEDA over one pool's pods."""
        if self.per_pod:
            return f"sum({self.series}{{{selector}}})"
        return (f"histogram_quantile({QUANTILE}, sum by (le) "
                f"(rate({self.series}_bucket{{{selector}}}[{RATE_WINDOW}])))")


SIGNALS = {
    "queue": Signal("queued prompt tokens", "baton_queued_prompt_tokens",
                    "baton_queued_prompt_tokens", True, 1.0),
    "kv": Signal("KV cache use", "baton_kv_usage_ratio", "baton_kv_usage_ratio", True, 0.01),
    "ttft": Signal("p90 time to first token", "baton_time_to_first_token_seconds",
                   "baton_time_to_first_token_p90_seconds", False, 0.001),
    "itl": Signal("p90 inter-token latency", "baton_inter_token_latency_seconds",
                  "baton_inter_token_latency_p90_seconds", False, 0.001),
}


def scaler_for(scale: Autoscale, caps: Capabilities) -> Scaler | None:
    """What scales a pool on this cluster by its metric; None when nothing can."""
    if scale.metric not in SIGNALS:
        return "hpa"  # cpu and memory: metrics-server, part of every cluster we target
    if caps.keda and caps.prometheus_url:
        return "keda"
    return "hpa" if caps.custom_metrics else None


def autoscaled(svc: InferenceService, role: str, caps: Capabilities) -> bool:
    """Whether an autoscaler owns the pool's replicas."""
    scale = svc.autoscaling.get(role)
    return (scale is not None and not svc.planner_scaled
            and scaler_for(scale, caps) is not None)


def pool_selector(svc: InferenceService, role: WorkerRole) -> str:
    """PromQL label matchers of one pool's pods: the labels a PodMonitor (podTargetLabels) or
    an annotation-scraping job (labelmap of the pod labels) puts on the series."""
    return (f'namespace="{svc.namespace}",app_kubernetes_io_instance="{svc.name}",'
            f'baton_dev_role="{role}"')


def build_hpa(svc: InferenceService, role: WorkerRole, caps: Capabilities
              ) -> dict[str, Any] | None:
    """autoscaling/v2 HPA: Resource utilization, or a Pods metric of the custom metrics API."""
    scale = svc.autoscaling.get(role)
    if scale is None or svc.planner_scaled or scaler_for(scale, caps) != "hpa":
        return None
    name = child_name(svc, role)
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": metadata(svc, name, role),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment",
                               "name": deployment_name(svc, role, spec_revision(svc))},
            "minReplicas": scale.min,
            "maxReplicas": scale.max,
            "metrics": [_hpa_metric(scale)],
        },
    }


def _hpa_metric(scale: Autoscale) -> dict[str, Any]:
    signal = SIGNALS.get(scale.metric)
    if signal is None:
        return {"type": "Resource", "resource": {
            "name": scale.metric,
            "target": {"type": "Utilization", "averageUtilization": scale.target}}}
    return {"type": "Pods", "pods": {
        "metric": {"name": signal.pods_metric},
        "target": {"type": "AverageValue", "averageValue": signal.quantity(scale.target)}}}


def build_scaled_object(svc: InferenceService, role: WorkerRole, caps: Capabilities
                        ) -> dict[str, Any] | None:
    """keda.sh/v1alpha1 ScaledObject with one Prometheus trigger on the pool's signal."""
    scale = svc.autoscaling.get(role)
    if scale is None or svc.planner_scaled or scaler_for(scale, caps) != "keda":
        return None
    signal = SIGNALS[scale.metric]
    name = child_name(svc, role)
    return {
        "apiVersion": KEDA[0],
        "kind": "ScaledObject",
        "metadata": metadata(svc, name, role),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment",
                               "name": deployment_name(svc, role, spec_revision(svc))},
            "minReplicaCount": scale.min,
            "maxReplicaCount": scale.max,
            "triggers": [{
                "type": "prometheus",
                "metricType": "AverageValue" if signal.per_pod else "Value",
                "metadata": {"serverAddress": caps.prometheus_url,
                             "query": signal.query(pool_selector(svc, role)),
                             "threshold": signal.threshold(scale.target)},
            }],
        },
    }



def autoscaling_condition(svc: InferenceService, caps: Capabilities) -> dict[str, Any] | None:
    """`Autoscaling` condition: True when every autoscaled pool has a scaler, else False
    naming what is missing. None when no pool autoscales."""
    if svc.planner_scaled:
        return {"type": "Autoscaling", "status": "True", "reason": "Planner",
                "message": planner_mode(svc)}
    if not svc.autoscaling:
        return None
    how, missing = [], []
    for role in WORKER_ROLES:
        scale = svc.autoscaling.get(role)
        if scale is None:
            continue
        scaler = scaler_for(scale, caps)
        if scaler is None:
            missing.append(_why_not(role, scale, caps))
        else:
            how.append(f"{role}: {_how(scale, scaler)}")
    if missing:
        return {"type": "Autoscaling", "status": "False", "reason": "NoMetricsSource",
                "message": "; ".join(missing + how)}
    return {"type": "Autoscaling", "status": "True", "reason": "ScalerReady",
            "message": "; ".join(how)}


def planner_mode(svc: InferenceService) -> str:
    """How the planner scales the pools (spec.autoscaling.mode: planner)."""
    assert svc.planner is not None
    bounds = ", ".join(f"{role} {'..'.join(map(str, svc.bounds(role)))}" for role in WORKER_ROLES)
    return (f"the P:D planner sets the replicas ({bounds}) for a mean TTFT of "
            f"{svc.planner.ttft_ms} ms and an ITL of {svc.planner.itl_ms} ms, at most one "
            f"change per pool every {svc.planner.cooldown_s} s (status.planner says why)")


def _how(scale: Autoscale, scaler: Scaler) -> str:
    signal = SIGNALS.get(scale.metric)
    if signal is None:
        return f"HPA on {scale.metric} utilization ({scale.target}%)"
    kind = "KEDA ScaledObject" if scaler == "keda" else "HPA"
    source = "Prometheus" if scaler == "keda" else signal.pods_metric
    return f"{kind} on {signal.describe} ({source}, target {signal.threshold(scale.target)})"


def _why_not(role: str, scale: Autoscale, caps: Capabilities) -> str:
    keda = ("KEDA is served but the operator has no Prometheus address (chart value "
            "autoscaling.prometheusAddress)" if caps.keda else
            f"KEDA ({KEDA[0]} {KEDA[1]}) is not served")
    return (f"spec.autoscaling.{role}.metric {scale.metric} cannot scale: {keda}, and neither "
            f"is the custom metrics API ({CUSTOM_METRICS}; prometheus-adapter with the chart's "
            f"rules serves it); {role} stays at min ({scale.min}) replicas")


def _number(value: float) -> str:
    return f"{value:.6g}"
