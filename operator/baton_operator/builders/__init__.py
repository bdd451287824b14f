"""Pure `build_*()` functions: a parsed InferenceService in, Kubernetes manifests (dicts) out."""

from __future__ import annotations

from typing import Any

from baton_operator.builders.access import build_router_access, router_access_keys
from baton_operator.builders.autoscaling import (
    autoscaling_condition,
    build_hpa,
    build_scaled_object,
)
from baton_operator.builders.common import (
    child_name,
    labels,
    owner_reference,
    probe_name,
    selector_labels,
)
from baton_operator.builders.monitoring import build_pod_monitor
from baton_operator.builders.network import (
    build_headless_service,
    build_ingress,
    build_router_service,
)
from baton_operator.builders.network_policy import (
    build_network_policies,
    network_policy_keys,
)
from baton_operator.builders.pods import (
    build_router_pod,
    build_worker_pod,
    merge,
    router_command,
    serve_command,
)
from baton_operator.builders.workloads import build_deployment, build_pdb
from baton_operator.capabilities import KEDA, Capabilities
from baton_operator.spec import ROLES, WORKER_ROLES, InferenceService

ChildKey = tuple[str, str, str]  # (apiVersion, kind, name)


def build_children(svc: InferenceService, caps: Capabilities | None = None
                   ) -> list[dict[str, Any]]:
    """Every child the service should have right now on a cluster that offers `caps`,
    Services before their consumers."""
    caps = caps or Capabilities()
    optional = [build_ingress(svc)]
    optional += [build_hpa(svc, role, caps) for role in WORKER_ROLES]
    optional += [build_scaled_object(svc, role, caps) for role in WORKER_ROLES]
    optional += [build_pod_monitor(svc, caps)]
    optional += [build_pdb(svc, role) for role in ROLES]
    return [
        *build_router_access(svc),  # before the router pods that run as its ServiceAccount
        *(build_headless_service(svc, role) for role in WORKER_ROLES),
        build_router_service(svc),
        *(build_deployment(svc, role, caps) for role in ROLES),
        *(child for child in optional if child is not None),
        *build_network_policies(svc),
    ]


def optional_children(svc: InferenceService, caps: Capabilities | None = None
                      ) -> list[ChildKey]:
    """Every child that only exists for some specs or clusters; those not built are to be
    deleted (kinds the cluster does not serve are not asked for)."""
    caps = caps or Capabilities()
    keys: list[ChildKey] = [("networking.k8s.io/v1", "Ingress", svc.name)]
    keys += [("autoscaling/v2", "HorizontalPodAutoscaler", child_name(svc, r)) for r in WORKER_ROLES]
    if caps.keda:
        keys += [(KEDA[0], "ScaledObject", child_name(svc, r)) for r in WORKER_ROLES]
    keys += [("policy/v1", "PodDisruptionBudget", child_name(svc, r)) for r in ROLES]
    keys += [("apps/v1", "Deployment", probe_name(svc, r)) for r in WORKER_ROLES]  # the gate's
    return keys + router_access_keys(svc) + network_policy_keys(svc)


__all__ = [
    "autoscaling_condition",
    "build_children",
    "build_deployment",
    "build_headless_service",
    "build_hpa",
    "build_ingress",
    "build_network_policies",
    "build_pdb",
    "build_pod_monitor",
    "build_router_access",
    "build_router_pod",
    "build_router_service",
    "build_scaled_object",
    "build_worker_pod",
    "child_name",
    "labels",
    "merge",
    "optional_children",
    "owner_reference",
    "router_command",
    "selector_labels",
    "serve_command",
]
