"""Deployments and PodDisruptionBudgets of the three pools (autoscalers: autoscaling.py)."""

from __future__ import annotations

from typing import Any

from baton_operator.builders.autoscaling import autoscaled
from baton_operator.builders.common import child_name, metadata, selector_labels
from baton_operator.builders.monitoring import scrape_annotations
from baton_operator.builders.pods import build_router_pod, build_worker_pod
from baton_operator.capabilities import Capabilities
from baton_operator.spec import InferenceService, Role

# Workers load a model before they turn ready; give a rollout that long before it is stuck.
WORKER_PROGRESS_DEADLINE = 1800
ROUTER_PROGRESS_DEADLINE = 600


def build_deployment(svc: InferenceService, role: Role,
                     caps: Capabilities | None = None) -> dict[str, Any]:
    """A pool's Deployment. When its autoscaler exists, `spec.replicas` is left to it; an
    autoscaled pool that nothing can scale on this cluster (`caps`) keeps `min`; under the
    planner (spec.autoscaling.mode: planner) a worker pool has the replicas it enacted."""
    surge: int | str
    unavailable: int | str
    if role == "router":
        template = build_router_pod(svc)
        surge, unavailable, deadline = "25%", 0, ROUTER_PROGRESS_DEADLINE
    else:
        pool = svc.pool(role)
        template = build_worker_pod(svc, role)
        surge, unavailable = pool.max_surge, pool.max_unavailable
        deadline = WORKER_PROGRESS_DEADLINE
    caps = caps or Capabilities()
    scrape_annotations(template, caps)
    spec: dict[str, Any] = {
        "selector": {"matchLabels": selector_labels(svc, role)},
        "strategy": {"type": "RollingUpdate",
                     "rollingUpdate": {"maxSurge": surge, "maxUnavailable": unavailable}},
        "revisionHistoryLimit": 5,
        "progressDeadlineSeconds": deadline,
        "template": template,
    }
    scale = svc.autoscaling.get(role)
    if role != "router" and svc.planner_scaled:
        spec = {"replicas": svc.planned_replicas(role), **spec}
    elif scale is None:
        spec = {"replicas": svc.replicas(role), **spec}
    elif not autoscaled(svc, role, caps):
        spec = {"replicas": scale.min, **spec}
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": metadata(svc, child_name(svc, role), role), "spec": spec}


def build_pdb(svc: InferenceService, role: Role) -> dict[str, Any] | None:
    """At most one pod of a pool disrupted at a time; only for pools that can have two or
    more pods (with one pod, `maxUnavailable: 1` protects nothing)."""
    scale = svc.autoscaling.get(role)
    most = scale.max if scale is not None else svc.replicas(role)
    if most < 2:
        return None
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(svc, child_name(svc, role), role),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(svc, role)}},
    }
