"""Deployments and PodDisruptionBudgets of the three pools (autoscalers: autoscaling.py)."""

from __future__ import annotations

from typing import Any

from baton_operator.builders.autoscaling import autoscaled
from baton_operator.builders.common import (
    LABEL_COMPONENT,
    LABEL_NAME,
    LABEL_REVISION,
    PROBING,
    child_name,
    deployment_name,
    metadata,
    probe_name,
    selector_labels,
)
from baton_operator.builders.monitoring import scrape_annotations
from baton_operator.builders.pods import build_router_pod, build_worker_pod, spec_revision
from baton_operator.capabilities import Capabilities
from baton_operator.spec import InferenceService, Role, WorkerRole

# Workers load a model before they turn ready; give a rollout that long before it is stuck.
WORKER_PROGRESS_DEADLINE = 1800
ROUTER_PROGRESS_DEADLINE = 600


def build_deployment(svc: InferenceService, role: Role,
                     caps: Capabilities | None = None) -> dict[str, Any]:
    """A pool's Deployment; a worker pool's is its current revision's (`deployment_name`,
    selected by the revision too: rollout.py scales it and the older revisions' in step). When
    its autoscaler exists, `spec.replicas` is left to it; an autoscaled pool that nothing can
    scale on this cluster (`caps`) keeps `min`; under the planner (spec.autoscaling.mode:
    planner) a worker pool has the replicas it enacted."""
    surge: int | str
    unavailable: int | str
    selector = selector_labels(svc, role)
    if role == "router":
        template = build_router_pod(svc)
        surge, unavailable, deadline = "25%", 0, ROUTER_PROGRESS_DEADLINE
        meta = metadata(svc, deployment_name(svc, role), role)
    else:
        pool = svc.pool(role)
        template = build_worker_pod(svc, role)
        surge, unavailable = pool.max_surge, pool.max_unavailable
        deadline = WORKER_PROGRESS_DEADLINE
        revision = spec_revision(svc)
        selector[LABEL_REVISION] = revision
        meta = metadata(svc, deployment_name(svc, role, revision), role)
        meta["labels"][LABEL_REVISION] = revision
    caps = caps or Capabilities()
    scrape_annotations(template, caps)
    spec: dict[str, Any] = {
        "selector": {"matchLabels": selector},
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
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta, "spec": spec}


PROBE_ARGS = ("--sampler-backend", "token_oracle", "--kv-canary", "raise",
              "--kv-canary-bytes", "all")


def build_probe_deployment(svc: InferenceService, role: WorkerRole) -> dict[str, Any]:
    """One pod of the current revision's `role` pool for the rollout gate (probing.py): the
    pool's template with the token oracle and the KV canary on (PROBE_ARGS, last, so they win
    over the pool's args), labelled `app.kubernetes.io/name: baton-probe` so that neither the
    router's discovery nor the Services select it: its tokens are the oracle's, not the
    model's, and no client may see them. Its own NetworkPolicy lets the router and the other
    probe pod in (network_policy.py)."""
    template = build_worker_pod(svc, role)
    template["metadata"]["labels"].update({LABEL_NAME: PROBING, LABEL_COMPONENT: "probe"})
    container = template["spec"]["containers"][0]
    container["args"] = [*container.get("args", []), *PROBE_ARGS]
    selector = {**selector_labels(svc, role), LABEL_NAME: PROBING}
    meta = metadata(svc, probe_name(svc, role), role)
    meta["labels"].update({LABEL_NAME: PROBING, LABEL_COMPONENT: "probe",
                           LABEL_REVISION: spec_revision(svc)})
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
            "spec": {"replicas": 1, "selector": {"matchLabels": selector},
                     "strategy": {"type": "Recreate"}, "revisionHistoryLimit": 1,
                     "progressDeadlineSeconds": WORKER_PROGRESS_DEADLINE,
                     "template": template}}


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
