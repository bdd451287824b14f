"""The router's API access (discovery `kubernetes`): its own ServiceAccount, and a Role that
allows exactly what the router sends (get, list, watch Pods in the service's namespace)."""

from __future__ import annotations

from typing import Any

from baton_operator.builders.common import child_name, metadata
from baton_operator.spec import InferenceService

RBAC_API = "rbac.authorization.k8s.io/v1"
ROUTER_RULES = ({"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},)


def router_account(svc: InferenceService) -> str:
    """Name of the router's ServiceAccount, Role and RoleBinding."""
    return child_name(svc, "router")


def build_router_access(svc: InferenceService) -> list[dict[str, Any]]:
    """ServiceAccount, Role, RoleBinding; none when the router discovers through DNS."""
    if svc.router.discovery != "kubernetes":
        return []
    name = router_account(svc)
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount",
         "metadata": metadata(svc, name, "router"), "automountServiceAccountToken": False},
        {"apiVersion": RBAC_API, "kind": "Role", "metadata": metadata(svc, name, "router"),
         "rules": [dict(rule) for rule in ROUTER_RULES]},
        {"apiVersion": RBAC_API, "kind": "RoleBinding", "metadata": metadata(svc, name, "router"),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": svc.namespace}]},
    ]


def router_access_keys(svc: InferenceService) -> list[tuple[str, str, str]]:
    """(apiVersion, kind, name) of every object `build_router_access` may build."""
    name = router_account(svc)
    return [("v1", "ServiceAccount", name), (RBAC_API, "Role", name),
            (RBAC_API, "RoleBinding", name)]
