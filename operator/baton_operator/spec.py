"""The InferenceService spec, parsed once into frozen dataclasses.

`parse_service()` applies the CRD's defaults and rejects what can never work with `InvalidSpec`.
The API server validates against the CRD schema too, but the operator must not trust that
alone (an older CRD, a schema-less test server): everything the builders rely on is checked
here, so the builders can stay simple.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from baton_operator.checks import (
    DNS_LABEL,
    DNS_SUBDOMAIN,
    HOSTNAME,
    LABEL_VALUE,
    QUANTITY,
    RESOURCE_NAME,
    InvalidSpec,
    choice,
    env_vars,
    int_or_percent,
    integer,
    mapping,
    matching,
    objects,
    peers,
    string,
    string_map,
    strings,
)
from baton_operator.model import ModelSource, SecretKeyRef, parse_model, secret_ref
from baton_operator.parallel import check_pool, tensor_parallel_size

__all__ = ["ROLES", "WORKER_ROLES", "InferenceService", "InvalidSpec", "ModelSource",
           "Role", "WorkerRole", "parse_service"]

Role = Literal["prefill", "decode", "router"]
WorkerRole = Literal["prefill", "decode"]
WORKER_ROLES: tuple[WorkerRole, ...] = ("prefill", "decode")
ROLES: tuple[Role, ...] = ("prefill", "decode", "router")

KV_BACKENDS = ("nixl", "tcp")
ROUTER_POLICIES = ("cache_aware", "round_robin", "least_load", "prefix")
# with no prefill to pair: a 503 (fail), or the decodes prefill locally (colocated)
ROUTER_FALLBACKS = ("fail", "colocated")
# kubernetes: the router reads Ready pods through the API (its own ServiceAccount and Role);
# dns: it re-resolves the pools' headless Services (no API access, no readiness from the API).
ROUTER_DISCOVERY = ("kubernetes", "dns")
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
# cpu | memory: a resource HPA on utilization; the serving signals (builders/autoscaling.py):
# queue = prompt tokens waiting per pod, kv = KV cache use, ttft / itl = p90 latencies.
METRICS = ("cpu", "memory", "queue", "kv", "ttft", "itl")
PERCENT_METRICS = ("cpu", "memory", "kv")  # target: percent, 1..100
# default target per metric: percent, tokens (queue) or milliseconds (ttft, itl)
TARGETS = {"cpu": 80, "memory": 80, "kv": 80, "queue": 2048, "ttft": 1000, "itl": 100}
DEFAULT_METRIC = {"prefill": "queue", "decode": "kv"}
# a prefill server makes one token per request: it has no inter-token latency
NO_SIGNAL = {("prefill", "itl")}
# spec.autoscaling.mode: metrics (an HPA / KEDA per pool, above) or planner (the operator sizes
# both pools with the P:D planner, planning.py, toward ttftTarget and itlTarget)
AUTOSCALING_MODES = ("metrics", "planner")
PLANNER_COOLDOWN_S = 120  # default spec.autoscaling.cooldownSeconds

_LONGEST_SUFFIX = len("-prefill")


GPU_RESOURCE = "nvidia.com/gpu"
# /dev/shm in GiB: NCCL and UCX stage through it on a GPU node; 1 GiB more per rank past the
# first (NCCL's shared-memory transport between a pod's ranks)
CPU_SHM_GIB, GPU_SHM_GIB = 1, 8
CPU_SHM = f"{CPU_SHM_GIB}Gi"


@dataclass(frozen=True)
class Images:
    """The operator's images (chart values image.cpu / image.cuda), for a spec without
    `image`: GPU pools run the CUDA one, everything else the CPU one."""

    cpu: str = "baton:0.1.0"
    cuda: str = "baton:0.1.0-cuda"


@dataclass(frozen=True)
class Gpu:
    """`spec.<pool>.gpu`: the pool runs on NVIDIA GPUs, `count` per pod, one per TP rank
    (docs/operator.md "GPU pools")."""

    count: int = 1
    product: str | None = None  # the nodes' nvidia.com/gpu.product label
    runtime_class: str | None = None
    mem_fraction_static: float = 0.85
    rdma_resource: str | None = None  # an RDMA device resource, e.g. rdma/hca_shared_devices_a


@dataclass(frozen=True)
class Pool:
    """One worker pool (prefill or decode)."""

    replicas: int = 1
    resources: Mapping[str, Any] = field(default_factory=dict)
    args: tuple[str, ...] = ()
    env: tuple[Mapping[str, Any], ...] = ()
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    shared_memory_size: str = CPU_SHM
    max_surge: int | str = "25%"
    max_unavailable: int | str = 0
    template: Mapping[str, Any] = field(default_factory=dict)
    gpu: Gpu | None = None
    tensor_parallel_size: int = 1  # ranks in each pod (`--tp`); the GPU count on a GPU pool


@dataclass(frozen=True)
class RouterPool:
    replicas: int = 1
    policy: str = "cache_aware"
    discovery: str = "kubernetes"
    fallback: str = "fail"
    resources: Mapping[str, Any] = field(default_factory=dict)
    args: tuple[str, ...] = ()
    env: tuple[Mapping[str, Any], ...] = ()
    api_key_secret: SecretKeyRef | None = None  # spec.router.auth.apiKeySecretRef


@dataclass(frozen=True)
class NetworkPolicies:
    """spec.networkPolicy: one ingress NetworkPolicy per pool. `router_from` None lets anyone
    reach the router's port; `metrics_from` peers may also reach every pod's HTTP port (which
    serves /metrics)."""

    enabled: bool = True
    router_from: tuple[Mapping[str, Any], ...] | None = None
    metrics_from: tuple[Mapping[str, Any], ...] = ()


@dataclass(frozen=True)
class Ingress:
    host: str
    class_name: str | None = None
    tls_secret: str | None = None


@dataclass(frozen=True)
class Autoscale:
    """`spec.autoscaling.<pool>`; `target` is in the metric's unit (see TARGETS)."""

    min: int
    max: int
    metric: str = "cpu"
    target: int = 80


@dataclass(frozen=True)
class PlannerSpec:
    """spec.autoscaling's planner keys: the latency targets the P:D planner sizes the pools
    for (planner.py) and whether it sets the replicas (`mode: planner`) or only recommends."""

    ttft_ms: int
    itl_ms: int
    enact: bool = False
    cooldown_s: int = PLANNER_COOLDOWN_S


@dataclass(frozen=True)
class RolloutSpec:
    """`spec.rollout`: how a new revision replaces the serving one (rollout.py). `max_skew`:
    the most, in percent of each pool, that one pool's share of new-revision pods may lead the
    other's; `gate`: probe a pair of the new revision with the token oracle and the KV canary
    before it serves (probing.py); `probe_timeout_s`: how long the probe pods may take to
    turn ready before the gate fails."""

    max_skew: int = 50
    gate: bool = True
    probe_timeout_s: int = 900


ROLLOUT_GATES = ("probes", "none")


@dataclass(frozen=True)
class InferenceService:
    """A parsed InferenceService: identity from metadata plus the defaulted, validated spec."""

    name: str
    namespace: str
    uid: str
    model: ModelSource
    generation: int = 1
    image: str | None = None  # spec.image: every pod runs it; None: `images` decide
    images: Images = field(default_factory=Images)
    image_pull_policy: str = "IfNotPresent"
    prefill: Pool = field(default_factory=Pool)
    decode: Pool = field(default_factory=Pool)
    router: RouterPool = field(default_factory=RouterPool)
    kv_backend: str = "nixl"
    ingress: Ingress | None = None
    autoscaling: Mapping[str, Autoscale] = field(default_factory=dict)
    network_policy: NetworkPolicies = field(default_factory=NetworkPolicies)
    planner: PlannerSpec | None = None  # spec.autoscaling.ttftTarget/itlTarget set
    # status.planner.<role>.replicas: what the planner enacted (mode: planner), kept in the
    # status so a restarted operator goes on from it
    planned: Mapping[str, int] = field(default_factory=dict)
    rollout: RolloutSpec = field(default_factory=RolloutSpec)

    def pool(self, role: WorkerRole) -> Pool:
        return self.prefill if role == "prefill" else self.decode

    @property
    def planner_scaled(self) -> bool:
        """The planner sets the worker pools' replicas (spec.autoscaling.mode: planner)."""
        return self.planner is not None and self.planner.enact

    def planned_replicas(self, role: WorkerRole) -> int:
        """mode: planner: the pool's replicas, as the planner last enacted them, within its
        min and max (before the first plan: its `replicas`, within them)."""
        low, high = self.bounds(role)
        return min(max(self.planned.get(role, self.pool(role).replicas), low), high)

    def bounds(self, role: WorkerRole) -> tuple[int, int]:
        """A worker pool's (min, max) replicas: its autoscaling's, else its replicas alone."""
        scale = self.autoscaling.get(role)
        if scale is None:
            return self.pool(role).replicas, self.pool(role).replicas
        return scale.min, scale.max

    def image_for(self, role: Role) -> str:
        """`spec.image`, else the CUDA image for a GPU pool and the CPU image for the rest."""
        if self.image is not None:
            return self.image
        if role == "router":
            return self.images.cpu
        return self.images.cuda if self.pool(role).gpu is not None else self.images.cpu

    def replicas(self, role: Role) -> int:
        return self.router.replicas if role == "router" else self.pool(role).replicas

    @property
    def url(self) -> str:
        if self.ingress is not None:
            scheme = "https" if self.ingress.tls_secret else "http"
            return f"{scheme}://{self.ingress.host}"
        return f"http://{self.name}.{self.namespace}.svc.cluster.local:8000"


def parse_service(body: Mapping[str, Any], images: Images | None = None) -> InferenceService:
    """Parse an InferenceService object (metadata + spec) or raise `InvalidSpec`; `images`:
    what pods run when the spec names no image."""
    meta = body.get("metadata") or {}
    name = str(meta.get("name") or "")
    if not DNS_LABEL.match(name) or len(name) > 63 - _LONGEST_SUFFIX:
        raise InvalidSpec(
            f"metadata.name {name!r}: must be a DNS-1035 label of at most "
            f"{63 - _LONGEST_SUFFIX} characters (children are named <name>-prefill)"
        )
    spec = mapping(body.get("spec"), "spec")
    svc = InferenceService(
        name=name,
        namespace=str(meta.get("namespace") or "default"),
        uid=str(meta.get("uid") or ""),
        generation=int(meta.get("generation") or 1),
        model=parse_model(mapping(spec.get("model"), "spec.model")),
        image=None if spec.get("image") is None else string(spec.get("image"), "spec.image"),
        images=images or Images(),
        image_pull_policy=choice(spec.get("imagePullPolicy", "IfNotPresent"),
                                 "spec.imagePullPolicy", PULL_POLICIES),
        prefill=_pool(spec.get("prefill"), "spec.prefill"),
        decode=_pool(spec.get("decode"), "spec.decode"),
        router=_router(spec.get("router"), "spec.router"),
        kv_backend=choice(mapping(spec.get("kvTransfer"), "spec.kvTransfer").get("backend", "nixl"),
                          "spec.kvTransfer.backend", KV_BACKENDS),
        ingress=_ingress(spec.get("ingress")),
        autoscaling=_autoscaling(mapping(spec.get("autoscaling"), "spec.autoscaling")),
        planner=_planner(mapping(spec.get("autoscaling"), "spec.autoscaling")),
        planned=_planned(body.get("status")),
        network_policy=_network_policy(mapping(spec.get("networkPolicy"), "spec.networkPolicy")),
        rollout=_rollout(mapping(spec.get("rollout"), "spec.rollout")),
    )
    for role in WORKER_ROLES:
        pool = svc.pool(role)
        check_pool(f"spec.{role}", pool.tensor_parallel_size, kv_backend=svc.kv_backend,
                   args=pool.args, model=svc.model)
    return svc


def _pool(raw: Any, where: str) -> Pool:
    pool = mapping(raw, where)
    rollout = mapping(pool.get("rolloutStrategy"), f"{where}.rolloutStrategy")
    resources = mapping(pool.get("resources"), f"{where}.resources")
    gpu = _gpu(pool.get("gpu"), resources, where)
    tp = tensor_parallel_size(pool.get("tensorParallelSize"),
                              None if gpu is None else gpu.count, where)
    base = GPU_SHM_GIB if gpu is not None else CPU_SHM_GIB
    shm = pool.get("sharedMemorySize", f"{base + tp - 1}Gi")
    if isinstance(shm, bool) or not ((isinstance(shm, int) and shm >= 0) or
                                     (isinstance(shm, str) and QUANTITY.match(shm))):
        raise InvalidSpec(f"{where}.sharedMemorySize {shm!r}: expected a quantity such as 1Gi")
    return Pool(
        replicas=integer(pool.get("replicas", 1), f"{where}.replicas", minimum=0),
        resources=resources,
        args=strings(pool.get("args"), f"{where}.args"),
        env=env_vars(pool.get("env"), f"{where}.env"),
        node_selector=string_map(pool.get("nodeSelector"), f"{where}.nodeSelector"),
        tolerations=objects(pool.get("tolerations"), f"{where}.tolerations"),
        shared_memory_size=str(shm),
        max_surge=int_or_percent(rollout.get("maxSurge", "25%"),
                                 f"{where}.rolloutStrategy.maxSurge"),
        max_unavailable=int_or_percent(rollout.get("maxUnavailable", 0),
                                       f"{where}.rolloutStrategy.maxUnavailable"),
        template=_template(pool.get("template"), f"{where}.template"),
        gpu=gpu,
        tensor_parallel_size=tp,
    )


def _gpu(raw: Any, resources: Mapping[str, Any], where: str) -> Gpu | None:
    """`gpu`, or a GPU limit in the pool's resources (the same thing said the Kubernetes way)."""
    limit = mapping(resources.get("limits"), f"{where}.resources.limits").get(GPU_RESOURCE)
    if raw is None and limit is None:
        return None
    gpu = mapping(raw, f"{where}.gpu")
    field = f"{where}.gpu.count"
    count = integer(gpu.get("count", 1), field, minimum=1)
    if limit is not None:
        limit_field = f"{where}.resources.limits[{GPU_RESOURCE}]"
        limit_count = integer(int(limit) if isinstance(limit, str) and limit.isdigit() else limit,
                              limit_field, minimum=1)
        if raw is not None and "count" in gpu and limit_count != count:
            raise InvalidSpec(f"{field} {count} and {limit_field} {limit_count} disagree")
        count = limit_count
    fraction = gpu.get("memFractionStatic", 0.85)
    if isinstance(fraction, bool) or not isinstance(fraction, int | float) or \
            not 0 < fraction < 1:
        raise InvalidSpec(f"{where}.gpu.memFractionStatic {fraction!r}: a fraction in (0, 1)")
    return Gpu(
        count=count,
        product=_optional(gpu.get("product"), f"{where}.gpu.product", LABEL_VALUE),
        runtime_class=_optional(gpu.get("runtimeClassName"), f"{where}.gpu.runtimeClassName",
                                DNS_SUBDOMAIN),
        mem_fraction_static=float(fraction),
        rdma_resource=_optional(gpu.get("rdmaResource"), f"{where}.gpu.rdmaResource",
                                RESOURCE_NAME),
    )


def _optional(value: Any, where: str, pattern: re.Pattern[str]) -> str | None:
    return None if value is None else matching(value, where, pattern)


def _router(raw: Any, where: str) -> RouterPool:
    router = mapping(raw, where)
    return RouterPool(
        replicas=integer(router.get("replicas", 1), f"{where}.replicas", minimum=0),
        policy=choice(router.get("policy", "cache_aware"), f"{where}.policy", ROUTER_POLICIES),
        discovery=choice(router.get("discovery", "kubernetes"), f"{where}.discovery",
                         ROUTER_DISCOVERY),
        fallback=choice(router.get("fallback", "fail"), f"{where}.fallback", ROUTER_FALLBACKS),
        resources=mapping(router.get("resources"), f"{where}.resources"),
        args=strings(router.get("args"), f"{where}.args"),
        env=env_vars(router.get("env"), f"{where}.env"),
        api_key_secret=secret_ref(mapping(router.get("auth"), f"{where}.auth").get(
            "apiKeySecretRef"), f"{where}.auth.apiKeySecretRef", default_key="api-keys"),
    )


def _network_policy(raw: Mapping[str, Any]) -> NetworkPolicies:
    enabled = raw.get("enabled", True)
    if not isinstance(enabled, bool):
        raise InvalidSpec(f"spec.networkPolicy.enabled {enabled!r}: expected true or false")
    router_from = raw.get("routerFrom")
    return NetworkPolicies(
        enabled=enabled,
        router_from=None if router_from is None else peers(router_from,
                                                            "spec.networkPolicy.routerFrom"),
        metrics_from=peers(raw.get("metricsFrom"), "spec.networkPolicy.metricsFrom"),
    )


def _ingress(raw: Any) -> Ingress | None:
    if raw is None:
        return None
    ingress = mapping(raw, "spec.ingress")
    tls = ingress.get("tls")
    class_name = ingress.get("className")
    host = matching(ingress.get("host"), "spec.ingress.host", HOSTNAME)
    if len(host) > 253:
        raise InvalidSpec(f"spec.ingress.host {host!r}: longer than 253 characters")
    return Ingress(
        host=host,
        class_name=None if class_name is None else string(class_name, "spec.ingress.className"),
        tls_secret=None if tls is None else matching(
            mapping(tls, "spec.ingress.tls").get("secretName"),
            "spec.ingress.tls.secretName", DNS_SUBDOMAIN),
    )


_PLANNER_KEYS = ("mode", "ttftTarget", "itlTarget", "cooldownSeconds")


def _autoscaling(raw: Mapping[str, Any]) -> dict[str, Autoscale]:
    result: dict[str, Autoscale] = {}
    for role, value in raw.items():
        where = f"spec.autoscaling.{role}"
        if role in _PLANNER_KEYS:
            continue
        if role not in WORKER_ROLES:
            raise InvalidSpec(f"{where}: only prefill and decode pools autoscale (and the "
                              f"planner's keys: {', '.join(_PLANNER_KEYS)})")
        scale = mapping(value, where)
        low = integer(scale.get("min"), f"{where}.min", minimum=1)
        high = integer(scale.get("max"), f"{where}.max", minimum=1)
        if low > high:
            raise InvalidSpec(f"{where}: min ({low}) must not exceed max ({high})")
        metric = choice(scale.get("metric", DEFAULT_METRIC[role]), f"{where}.metric",
                        tuple(m for m in METRICS if (role, m) not in NO_SIGNAL))
        target = integer(scale.get("target", TARGETS[metric]), f"{where}.target", minimum=1)
        if metric in PERCENT_METRICS and target > 100:
            raise InvalidSpec(f"{where}.target {target}: {metric} takes a percentage, 1..100")
        result[role] = Autoscale(min=low, max=high, metric=metric, target=target)
    return result


def _planner(raw: Mapping[str, Any]) -> PlannerSpec | None:
    """The planner's targets (milliseconds) and mode. `mode: planner` needs both targets and
    min/max for both pools; with `mode: metrics` (the default) targets only make it recommend."""
    mode = choice(raw.get("mode", "metrics"), "spec.autoscaling.mode", AUTOSCALING_MODES)
    ttft, itl = raw.get("ttftTarget"), raw.get("itlTarget")
    cooldown = integer(raw.get("cooldownSeconds", PLANNER_COOLDOWN_S),
                       "spec.autoscaling.cooldownSeconds", minimum=0)
    if mode == "planner":
        missing = [f"spec.autoscaling.{key}" for key, value in
                   (("ttftTarget", ttft), ("itlTarget", itl), ("prefill", raw.get("prefill")),
                    ("decode", raw.get("decode"))) if value is None]
        if missing:
            raise InvalidSpec(f"spec.autoscaling.mode planner needs {', '.join(missing)} (the "
                              "targets it sizes the pools for, in milliseconds, and each pool's "
                              "min and max)")
    if ttft is None and itl is None:
        return None
    if ttft is None or itl is None:
        raise InvalidSpec("spec.autoscaling: the planner needs both ttftTarget and itlTarget "
                          "(milliseconds)")
    return PlannerSpec(ttft_ms=integer(ttft, "spec.autoscaling.ttftTarget", minimum=1),
                       itl_ms=integer(itl, "spec.autoscaling.itlTarget", minimum=1),
                       enact=mode == "planner", cooldown_s=cooldown)


def _rollout(raw: Mapping[str, Any]) -> RolloutSpec:
    unknown = sorted(set(raw) - {"maxSkew", "gate", "probeTimeoutSeconds"})
    if unknown:
        raise InvalidSpec(f"spec.rollout.{unknown[0]}: unknown field (maxSkew, gate, "
                          "probeTimeoutSeconds)")
    skew = raw.get("maxSkew", 50)
    percent = skew
    if isinstance(skew, str):  # "50%"; a string without the sign is refused, as by the CRD
        digits = skew[:-1] if skew.endswith("%") else ""
        percent = int(digits) if digits.isdigit() else None
    if isinstance(percent, bool) or not isinstance(percent, int) or not 1 <= percent <= 100:
        raise InvalidSpec(f"spec.rollout.maxSkew {skew!r}: a percentage of each pool, 1..100 "
                          "(e.g. 50 or \"50%\")")
    gate = choice(raw.get("gate", "probes"), "spec.rollout.gate", ROLLOUT_GATES)
    timeout = integer(raw.get("probeTimeoutSeconds", 900), "spec.rollout.probeTimeoutSeconds",
                      minimum=30)
    return RolloutSpec(max_skew=percent, gate=gate == "probes", probe_timeout_s=timeout)


def _planned(status: Any) -> dict[str, int]:
    """status.planner.<role>.replicas as the planner last enacted them (ignored when mangled:
    the pools then start again from their min)."""
    planner = status.get("planner") if isinstance(status, Mapping) else None
    out: dict[str, int] = {}
    for role in WORKER_ROLES:
        entry = planner.get(role) if isinstance(planner, Mapping) else None
        replicas = entry.get("replicas") if isinstance(entry, Mapping) else None
        if type(replicas) is int and replicas >= 0:
            out[role] = replicas
    return out


def _template(raw: Any, where: str) -> Mapping[str, Any]:
    template = mapping(raw, where)
    pod_spec = mapping(template.get("spec"), f"{where}.spec")
    for key in ("containers", "initContainers", "volumes"):
        for i, item in enumerate(objects(pod_spec.get(key), f"{where}.spec.{key}")):
            if not isinstance(item.get("name"), str) or not item["name"]:
                raise InvalidSpec(f"{where}.spec.{key}[{i}]: every entry needs a name")
    for container in objects(pod_spec.get("containers"), f"{where}.spec.containers"):
        if container["name"] == "main" and "command" in container and "args" not in container:
            raise InvalidSpec(
                f"{where}.spec.containers[main].command: replaces the runtime's command but "
                "not its args, so the rendered `baton serve` arguments would be appended to "
                "your command; set args as well (args: [] runs your command alone)")
    return template
