"""Pod templates for the prefill, decode and router pools.

Containers run the runtime CLI of docs/architecture.md "CLI contract" verbatim (`command` + `args`), as a
non-root user on a read-only root filesystem; everything the runtime writes goes to emptyDirs.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from baton_operator.builders import cluster_key
from baton_operator.builders.access import router_account
from baton_operator.builders.common import (
    BOOTSTRAP_PORT,
    HTTP_PORT,
    KV_PORT,
    LABEL_REVISION,
    UCX_PORTS,
    kv_ports,
    labels,
    selector_labels,
    service_host,
)
from baton_operator.model import MODEL_MOUNT
from baton_operator.spec import GPU_RESOURCE, Gpu, InferenceService, Pool, Role, WorkerRole

CONTAINER = "main"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"  # set on each node by NVIDIA's GPU feature discovery
GPU_TOLERATION = {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}
MODEL_VOLUME = "models"  # holds the weights at /models, whatever the source
CACHE_DIR = "/cache"
API_KEYS_VOLUME = "api-keys"
API_KEYS_FILE = "/etc/baton/api-keys/keys"  # one key a line (runtime: --api-key-file)
POD_SECURITY_CONTEXT: dict[str, Any] = {
    "runAsNonRoot": True,
    "runAsUser": 10001,  # the image's user (Dockerfile)
    "runAsGroup": 10001,
    "fsGroup": 10001,
    "seccompProfile": {"type": "RuntimeDefault"},
}
CONTAINER_SECURITY_CONTEXT: dict[str, Any] = {
    "runAsNonRoot": True,
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}
# Why a container ended, in the Pod's status: what it wrote to /dev/termination-log (`baton
# serve`'s refusal, runtime/termination.py), else the tail of its log when it failed. The
# operator reads it (refusal.py), `kubectl describe pod` shows it.
TERMINATION_MESSAGE_POLICY = "FallbackToLogsOnError"
# Writable places for a read-only root filesystem. BATON_CACHE stays the image's own: the builtin
# model is baked there at build time, and an emptyDir over it would hide it.
CACHE_ENV: tuple[dict[str, str], ...] = (
    {"name": "HOME", "value": "/tmp"},
    {"name": "XDG_CACHE_HOME", "value": CACHE_DIR},
    {"name": "HF_HOME", "value": f"{CACHE_DIR}/huggingface"},
)
# The address peers reach a worker's KV endpoint on (runtime: --advertise-host > $POD_IP).
REVISION_ENV = "BATON_REVISION"  # runtime/revision.py
WORKER_ROLES: tuple[WorkerRole, ...] = ("prefill", "decode")
POD_IP_ENV = {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
# Workers: model load can take minutes (conversion, cold page cache); 10 s x 90 = 15 min.
WORKER_STARTUP = {"periodSeconds": 10, "failureThreshold": 90}
ROUTER_STARTUP = {"periodSeconds": 2, "failureThreshold": 30}
LIST_KEYS = {"volumeMounts": "mountPath"}  # how `merge` matches list items (default: name)
DEEP_MERGED = {"containers", "initContainers"}  # matched items merge; others are replaced


def serve_command(svc: InferenceService, role: WorkerRole) -> list[str]:
    """`baton serve` for a worker pool, followed by the pool's extra args."""
    cmd = ["baton", "serve", "--model", svc.model.model_arg, "--role", role,
           "--host", "0.0.0.0", "--port", str(HTTP_PORT)]
    if role == "decode":  # a decode that drains offers its streams' KV on its bootstrap port
        cmd += ["--kv-port", str(KV_PORT), "--move-kv-on-drain"]
    cmd += ["--bootstrap-port", str(BOOTSTRAP_PORT)]
    cmd += ["--kv-transfer", svc.kv_backend, "--served-model-name", svc.model.served_name]
    tp = svc.pool(role).tensor_parallel_size
    if tp > 1:  # the pool's ranks in this pod, one GPU each on a GPU pool
        cmd += ["--tp", str(tp)]
    if role == "decode" and svc.router.fallback == "colocated":
        cmd += ["--allow-local-prefill"]  # the router's fallback with no prefill to pair
    gpu = svc.pool(role).gpu
    if gpu is not None:  # the KV pool takes what the weights leave of this share of the GPU
        cmd += ["--device", "cuda", "--mem-fraction-static", f"{gpu.mem_fraction_static:g}",
                "--attention-backend", "auto"]
    return cmd + list(svc.pool(role).args)


def router_command(svc: InferenceService) -> list[str]:
    """`baton router` finding the pools' Ready pods through the API by their selector labels
    (ports from the pods' named container ports), or re-resolving their headless Services."""
    if svc.router.discovery == "kubernetes":
        workers = ["--discovery", "kubernetes", "--namespace", svc.namespace,
                   "--prefill-selector", _selector(svc, "prefill"),
                   "--decode-selector", _selector(svc, "decode")]
    else:
        workers = ["--prefill-dns", f"{service_host(svc, 'prefill')}:{HTTP_PORT}:{BOOTSTRAP_PORT}",
                   "--decode-dns", f"{service_host(svc, 'decode')}:{HTTP_PORT}"]
    auth = [] if svc.router.api_key_secret is None else ["--api-key-file", API_KEYS_FILE]
    # the image carries the builtin models: the router reads prompts with the same tokenizer;
    # another model only the workers have: the router asks them for its tokenizer files
    tokenizer = ["--tokenizer", svc.model.model_arg if svc.model.kind == "builtin" else "workers"]
    return ["baton", "router", "--host", "0.0.0.0", "--port", str(HTTP_PORT), *workers,
            "--policy", svc.router.policy, "--fallback", svc.router.fallback, *tokenizer, *auth,
            *svc.router.args]


def _selector(svc: InferenceService, role: Role) -> str:
    return ",".join(f"{k}={v}" for k, v in selector_labels(svc, role).items())


def build_worker_pod(svc: InferenceService, role: WorkerRole) -> dict[str, Any]:
    """Pod template of a worker pool, with `spec.<role>.template` merged in (see `merge`), and
    the spec's revision as the label `baton.dev/revision` and $BATON_REVISION."""
    pod = _worker_pod(svc, role)
    revision = spec_revision(svc)
    pod["metadata"]["labels"][LABEL_REVISION] = revision
    container = pod["spec"]["containers"][0]  # the operator's value, over any of the spec's
    container["env"] = [*(e for e in container["env"] if e.get("name") != REVISION_ENV),
                        {"name": REVISION_ENV, "value": revision}]
    return pod


def spec_revision(svc: InferenceService) -> str:
    """The revision of the spec's workers (runtime/revision.py): 12 hex digits of a digest of
    what both worker pools compute with, as rendered: each one's image, command, args and env
    and its model's init containers. Replicas, resources and placement are not in it; a change
    to either pool's computing makes a new revision for both, since a prefill hands its KV only
    to a decode of its own revision."""
    computes = []
    for role in WORKER_ROLES:
        spec = _worker_pod(svc, role)["spec"]
        computes.append([{k: c.get(k) for k in ("image", "command", "args", "env")}
                         for c in [*spec.get("initContainers", []), *spec["containers"]]])
    return hashlib.sha256(json.dumps(computes, sort_keys=True).encode()).hexdigest()[:12]


def _worker_pod(svc: InferenceService, role: WorkerRole) -> dict[str, Any]:
    pool = svc.pool(role)
    volumes, mounts, init = _model_source(svc, role)
    # every port of the KV plane is declared: bootstrap (prefill; decode: where a draining
    # decode offers KV), KV receivers (decode: `kv`, and `kv-R` for TP rank R), and UCX's TCP
    # listeners confined to a range (nixl)
    ports = [_port("http", HTTP_PORT), _port("bootstrap", BOOTSTRAP_PORT)]
    if role == "decode":
        ports += [_port(f"kv-{port - KV_PORT}" if port > KV_PORT else "kv", port)
                  for port in kv_ports(pool.tensor_parallel_size)]
    env: tuple[Mapping[str, Any], ...] = (POD_IP_ENV, cluster_key.ENV, *_ucx_env(svc, pool.gpu),
                                          *pool.env)
    container = _container(svc, role, serve_command(svc, role), ports, _resources(pool), env,
                           mounts=[*_scratch_mounts(), {"name": "dshm", "mountPath": "/dev/shm"},
                                   cluster_key.key_mount(), *mounts],
                           startup=WORKER_STARTUP)
    spec: dict[str, Any] = {
        "containers": [container],
        "volumes": [*_scratch_volumes(),
                    {"name": "dshm", "emptyDir": {"medium": "Memory",
                                                  "sizeLimit": pool.shared_memory_size}},
                    cluster_key.key_volume(svc), *volumes],
        "terminationGracePeriodSeconds": 60,
        **_pod_basics(),
    }
    if init:
        spec["initContainers"] = init
    spec.update(_placement(pool))
    generated = {"metadata": _pod_metadata(svc, role), "spec": spec}
    pod: dict[str, Any] = merge(generated, pool.template)
    pod["metadata"]["labels"].update(labels(svc, role))  # the selector must keep matching
    return pod


def build_router_pod(svc: InferenceService) -> dict[str, Any]:
    volumes, mounts = _api_keys(svc)
    container = _container(svc, "router", router_command(svc), [_port("http", HTTP_PORT)],
                           svc.router.resources, (cluster_key.ENV, *svc.router.env),
                           mounts=[*_scratch_mounts(), cluster_key.key_mount(), *mounts],
                           startup=ROUTER_STARTUP)
    spec = {"containers": [container],
            "volumes": [*_scratch_volumes(), cluster_key.key_volume(svc), *volumes],
            "terminationGracePeriodSeconds": 30, **_pod_basics()}
    if svc.router.discovery == "kubernetes":  # it reads pods with its own ServiceAccount
        spec.update(serviceAccountName=router_account(svc), automountServiceAccountToken=True)
    return {"metadata": _pod_metadata(svc, "router"), "spec": spec}


def _api_keys(svc: InferenceService) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """`spec.router.auth.apiKeySecretRef` as a file the router reads again when it changes.
    A whole-volume mount (never subPath), so the kubelet's update of a rotated Secret reaches
    the running router: no restart, no cut stream."""
    ref = svc.router.api_key_secret
    if ref is None:
        return [], []
    items = [{"key": ref.key, "path": API_KEYS_FILE.rsplit("/", 1)[1]}]
    volume = {"name": API_KEYS_VOLUME,
              "secret": {"secretName": ref.name, "items": items, "defaultMode": 0o440}}
    mount = {"name": API_KEYS_VOLUME, "mountPath": API_KEYS_FILE.rsplit("/", 1)[0],
             "readOnly": True}
    return [volume], [mount]


def merge(base: Any, override: Any, field: str = "") -> Any:
    """The one merge rule for user templates and env: `override` wins. Mappings merge key by
    key. Lists whose items all carry their key (`mountPath` for volumeMounts, else `name`)
    merge item by item on it and new keys are appended: a container merges into the
    container of the same name (so a template container "main" merges into the runtime
    container and any other becomes a sidecar), every other keyed item (a volume, an env var,
    a port, a mount) is replaced whole, since its source is one thing (an emptyDir and a
    hostPath never mix). Every other value, lists included, is replaced."""
    if isinstance(base, Mapping) and isinstance(override, Mapping):
        out = {k: copy.deepcopy(v) for k, v in base.items()}
        for key, value in override.items():
            out[key] = merge(base[key], value, key) if key in base else copy.deepcopy(value)
        return out
    key = LIST_KEYS.get(field, "name")
    if _keyed_list(base, key) and _keyed_list(override, key):
        merged = [copy.deepcopy(item) for item in base]
        index = {item[key]: i for i, item in enumerate(merged)}
        for item in override:
            if item[key] not in index:
                merged.append(copy.deepcopy(item))
            elif field in DEEP_MERGED:
                merged[index[item[key]]] = merge(merged[index[item[key]]], item)
            else:
                merged[index[item[key]]] = copy.deepcopy(item)
        return merged
    return copy.deepcopy(override)


def _keyed_list(value: Any, key: str) -> bool:
    return isinstance(value, list) and all(
        isinstance(item, Mapping) and isinstance(item.get(key), (str, int)) for item in value)


def _container(svc: InferenceService, role: Role, command: list[str], ports: list[dict[str, Any]],
               resources: Mapping[str, Any], env: tuple[Mapping[str, Any], ...], *,
               mounts: list[dict[str, Any]], startup: Mapping[str, int]) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": svc.image_for(role),
        "imagePullPolicy": svc.image_pull_policy,
        "command": command[:1],
        "args": command[1:],
        "ports": ports,
        "env": merge([dict(e) for e in CACHE_ENV], [dict(e) for e in env]),
        "volumeMounts": mounts,
        "startupProbe": _http_probe("/health", timeoutSeconds=5, **startup),
        "readinessProbe": _http_probe("/ready", periodSeconds=5, failureThreshold=3,
                                      timeoutSeconds=5),
        "livenessProbe": _http_probe("/health", periodSeconds=10, failureThreshold=3,
                                     timeoutSeconds=5),
        "securityContext": copy.deepcopy(CONTAINER_SECURITY_CONTEXT),
        "terminationMessagePolicy": TERMINATION_MESSAGE_POLICY,
    }
    if resources:
        container["resources"] = copy.deepcopy(dict(resources))
    return container


def _model_source(svc: InferenceService, role: WorkerRole) -> tuple[list[dict[str, Any]], list[dict[str, Any]],
                                                  list[dict[str, Any]]]:
    """Volumes, main-container mounts and init containers that put the model at /models."""
    model = svc.model
    mount = {"name": MODEL_VOLUME, "mountPath": MODEL_MOUNT, "readOnly": True}
    if model.kind == "pvc":
        claim = {"claimName": model.location, "readOnly": True}
        return [{"name": MODEL_VOLUME, "persistentVolumeClaim": claim}], [mount], []
    if model.kind == "file":
        host = {"path": model.location, "type": "Directory"}
        return [{"name": MODEL_VOLUME, "hostPath": host}], [mount], []
    if model.kind == "hf":
        return [{"name": MODEL_VOLUME, "emptyDir": {}}], [mount], [_model_pull(svc, role)]
    return [], [], []  # builtin: shipped in the image, converted into the cache on start


def _model_pull(svc: InferenceService, role: WorkerRole) -> dict[str, Any]:
    env: list[dict[str, Any]] = [dict(e) for e in CACHE_ENV]
    secret = svc.model.token_secret
    if secret is not None:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": secret.name, "key": secret.key}}})
    return {
        "name": "model-pull",
        "image": svc.image_for(role),
        "imagePullPolicy": svc.image_pull_policy,
        "command": ["baton"],
        "args": ["model", "pull", svc.model.uri, "--dest", svc.model.model_arg],
        "env": env,
        "volumeMounts": [*_scratch_mounts(), {"name": MODEL_VOLUME, "mountPath": MODEL_MOUNT}],
        "securityContext": copy.deepcopy(CONTAINER_SECURITY_CONTEXT),
        "terminationMessagePolicy": TERMINATION_MESSAGE_POLICY,
    }


def _pod_metadata(svc: InferenceService, role: Role) -> dict[str, Any]:
    return {"labels": labels(svc, role),
            "annotations": {"kubectl.kubernetes.io/default-container": CONTAINER}}


def _pod_basics() -> dict[str, Any]:
    return {
        "securityContext": copy.deepcopy(POD_SECURITY_CONTEXT),
        "automountServiceAccountToken": False,  # workers never talk to the API
        "enableServiceLinks": False,
    }


def _scratch_volumes() -> list[dict[str, Any]]:
    return [{"name": "tmp", "emptyDir": {}}, {"name": "cache", "emptyDir": {}}]


def _scratch_mounts() -> list[dict[str, Any]]:
    return [{"name": "tmp", "mountPath": "/tmp"}, {"name": "cache", "mountPath": CACHE_DIR}]


def _ucx_env(svc: InferenceService, gpu: Gpu | None) -> tuple[dict[str, str], ...]:
    if svc.kv_backend != "nixl":
        return ()
    env = [{"name": "UCX_TCP_PORT_RANGE", "value": UCX_PORTS}]
    if gpu is not None:  # KV moves GPU to GPU: CUDA IPC on one node, RDMA (when given) across
        tls = ["rc"] if gpu.rdma_resource else []
        env.append({"name": "UCX_TLS", "value": ",".join([*tls, "cuda_ipc", "cuda_copy", "tcp"])})
    return tuple(env)


def _resources(pool: Pool) -> Mapping[str, Any]:
    """The pool's resources, with the GPU (and RDMA device) limits a GPU pool needs."""
    gpu = pool.gpu
    if gpu is None:
        return pool.resources
    resources = copy.deepcopy(dict(pool.resources))
    limits = resources.setdefault("limits", {})
    limits[GPU_RESOURCE] = gpu.count
    if gpu.rdma_resource:
        limits.setdefault(gpu.rdma_resource, 1)
    return resources


def _placement(pool: Pool) -> dict[str, Any]:
    """nodeSelector, tolerations and runtimeClassName: the pool's own, and for a GPU pool the
    product's label, the GPU nodes' taint and the runtime class. Routers get none of these,
    so they never land on a tainted GPU node."""
    selector = dict(pool.node_selector)
    tolerations = copy.deepcopy(list(pool.tolerations))
    out: dict[str, Any] = {}
    if pool.gpu is not None:
        if pool.gpu.product:
            selector.setdefault(GPU_PRODUCT_LABEL, pool.gpu.product)
        if not any(t.get("key") == GPU_RESOURCE for t in tolerations):
            tolerations.append(copy.deepcopy(GPU_TOLERATION))
        if pool.gpu.runtime_class:
            out["runtimeClassName"] = pool.gpu.runtime_class
    if selector:
        out["nodeSelector"] = selector
    if tolerations:
        out["tolerations"] = tolerations
    return out


def _port(name: str, port: int) -> dict[str, Any]:
    return {"name": name, "containerPort": port, "protocol": "TCP"}


def _http_probe(path: str, **timing: int) -> dict[str, Any]:
    probe: dict[str, Any] = {"httpGet": {"path": path, "port": "http"}}
    return {**probe, **timing}
