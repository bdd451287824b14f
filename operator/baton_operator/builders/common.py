"""Names, labels and ownership shared by every child object."""

from __future__ import annotations

from typing import Any

from baton_operator import API_VERSION, KIND, MANAGER
from baton_operator.spec import InferenceService, Role

LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_PART_OF = "app.kubernetes.io/part-of"
LABEL_ROLE = "baton.dev/role"
LABEL_REVISION = "baton.dev/revision"  # a worker pod's revision (pods.py `spec_revision`)
SERVING = "baton"  # LABEL_NAME of the pods that serve: the router and Services select them
PROBING = "baton-probe"  # LABEL_NAME of the rollout gate's probe pods (never serve clients)

HTTP_PORT = 8000
BOOTSTRAP_PORT = 8998
KV_PORT = 8999  # decode: the KV receiver prefill pods open their links to; rank r's: + r
UCX_PORT_RANGE = (20000, 20015)  # nixl: UCX's TCP listeners (two per worker: lo and the NIC)
UCX_PORTS = "{}-{}".format(*UCX_PORT_RANGE)


def kv_ports(tp: int) -> range:
    """A decode pod's KV receivers, one per TP rank (runtime: `--kv-port` + rank)."""
    return range(KV_PORT, KV_PORT + tp)


def child_name(svc: InferenceService, role: Role) -> str:
    return f"{svc.name}-{role}"


def deployment_name(svc: InferenceService, role: Role, revision: str | None = None) -> str:
    """A pool's Deployment: the router's `<name>-router`; a worker pool has one per revision,
    `<name>-<role>-<revision>`, so that a rollout scales the old and the new revision of both
    pools in step (rollout.py)."""
    return child_name(svc, role) if revision is None else f"{child_name(svc, role)}-{revision}"


def probe_name(svc: InferenceService, role: Role) -> str:
    """The Deployment of the rollout gate's probe pod of a pool (probing.py)."""
    return f"{child_name(svc, role)}-probe"


def service_host(svc: InferenceService, role: Role) -> str:
    """Cluster DNS name of a pool's headless Service."""
    return f"{child_name(svc, role)}.{svc.namespace}.svc.cluster.local"


def selector_labels(svc: InferenceService, role: Role) -> dict[str, str]:
    """Pod selector of a pool; immutable on Deployments, so it never grows."""
    return {LABEL_NAME: SERVING, LABEL_INSTANCE: svc.name, LABEL_ROLE: role}


def labels(svc: InferenceService, role: Role) -> dict[str, str]:
    return {
        **selector_labels(svc, role),
        LABEL_COMPONENT: role,
        LABEL_MANAGED_BY: MANAGER,
        LABEL_PART_OF: "baton",
    }


def owner_reference(svc: InferenceService) -> dict[str, Any]:
    """Controller reference: the garbage collector deletes children with their service."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": svc.name,
        "uid": svc.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def metadata(svc: InferenceService, name: str, role: Role) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": svc.namespace,
        "labels": labels(svc, role),
        "ownerReferences": [owner_reference(svc)],
    }
