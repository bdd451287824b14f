"""The service's cluster key: one Secret per InferenceService, made once, mounted into every
prefill, decode and router pod (runtime: $BATON_CLUSTER_KEY_FILE), so room tickets, bootstrap
calls and KV links are authenticated within the service and nobody else's.

The key is random, so it is no pure manifest: `ensure_cluster_key` creates the Secret with a
fresh key when it is missing and never rewrites one (pods read the key at start: a new key would
split a running service in two). The operator needs only get and create on Secrets; the garbage
collector deletes the Secret with its service (owner reference).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from typing import Any

from baton_operator.builders.common import metadata
from baton_operator.kube import Kube
from baton_operator.spec import InferenceService

MOUNT = "/etc/baton/cluster-key"
FILE = "key"
VOLUME = "cluster-key"
ENV = {"name": "BATON_CLUSTER_KEY_FILE", "value": f"{MOUNT}/{FILE}"}


def cluster_key_name(svc: InferenceService) -> str:
    return f"{svc.name}-cluster-key"


def build_cluster_key(svc: InferenceService) -> dict[str, Any]:
    """The Secret without its key (what `ensure_cluster_key` creates it from)."""
    meta = metadata(svc, cluster_key_name(svc), "router")
    meta["labels"]["app.kubernetes.io/component"] = "cluster-key"
    return {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "type": "Opaque"}


def ensure_cluster_key(kube: Kube, svc: InferenceService) -> tuple[dict[str, Any], bool]:
    """The live Secret, created with a new random key if it did not exist (then True)."""
    live = kube.get("v1", "Secret", svc.namespace, cluster_key_name(svc))
    if live is not None:
        return live, False
    secret = build_cluster_key(svc)
    secret["data"] = {FILE: base64.b64encode(secrets.token_hex(32).encode()).decode()}
    return kube.create(secret), True


def key_volume(svc: InferenceService) -> dict[str, Any]:
    """The Secret as a read-only volume (the pod's group may read the file, nobody else)."""
    return {"name": VOLUME, "secret": {"secretName": cluster_key_name(svc), "defaultMode": 0o440}}


def key_mount() -> dict[str, Any]:
    return {"name": VOLUME, "mountPath": MOUNT, "readOnly": True}


def operator_token(key: bytes) -> str:
    """The admin credential the router derives from the cluster key (runtime/auth/key.py
    `ClusterKey.operator_token`, the same HMAC-SHA256 under the key's subkey for the purpose
    "operator-admin", over no parts; written here because the operator does not import the
    runtime, and tested against it): what the operator presents to the router's
    `/debug/probe` for the rollout gate (probing.py)."""
    sub = hmac.new(key, b"baton/operator-admin", hashlib.sha256).digest()
    return hmac.new(sub, digestmod=hashlib.sha256).hexdigest()
