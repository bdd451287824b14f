"""The InferenceService spec, parsed once into frozen dataclasses.

`parse_service()` applies the CRD's defaults and rejects what can never work with `InvalidSpec`.
The API server validates against the CRD schema too, but the operator must not trust that
alone (an older CRD, a schema-less test server): everything the builders rely on is checked
here, so the builders can stay simple.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

ModelKind = Literal["builtin", "hf", "pvc", "file"]
Role = Literal["prefill", "decode", "router"]
WorkerRole = Literal["prefill", "decode"]
WORKER_ROLES: tuple[WorkerRole, ...] = ("prefill", "decode")
ROLES: tuple[Role, ...] = ("prefill", "decode", "router")

KV_BACKENDS = ("nixl", "tcp")
ROUTER_POLICIES = ("round_robin", "least_load", "prefix")
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
METRICS = ("cpu", "memory")
MODEL_MOUNT = "/models"

_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
_HF_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_BUILTIN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?([KMGTPE]i|[kMGTPE])?$")
_PERCENT = re.compile(r"^[0-9]+%$")
_LONGEST_SUFFIX = len("-prefill")


class InvalidSpec(ValueError):
    """A spec that can never work as written; the message names the field and the reason."""


@dataclass(frozen=True)
class SecretKeyRef:
    name: str
    key: str = "token"


@dataclass(frozen=True)
class ModelSource:
    """Where the weights come from. `location` is the builtin name, `org/name`, the claim or
    the absolute host path; `sub_path` is the path inside a claim (pvc:// only)."""

    uri: str
    kind: ModelKind
    location: str
    served_name: str
    sub_path: str = ""
    token_secret: SecretKeyRef | None = None

    @property
    def model_arg(self) -> str:
        """The `--model` value the runtime gets inside the pod."""
        if self.kind == "builtin":
            return self.uri
        if self.kind == "hf":
            return f"{MODEL_MOUNT}/{self.location}"
        if self.kind == "pvc" and self.sub_path:
            return f"{MODEL_MOUNT}/{self.sub_path}"
        return MODEL_MOUNT


@dataclass(frozen=True)
class Pool:
    """One worker pool (prefill or decode)."""

    replicas: int = 1
    resources: Mapping[str, Any] = field(default_factory=dict)
    args: tuple[str, ...] = ()
    env: tuple[Mapping[str, Any], ...] = ()
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    shared_memory_size: str = "1Gi"
    max_surge: int | str = "25%"
    max_unavailable: int | str = 0
    template: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RouterPool:
    replicas: int = 1
    policy: str = "round_robin"
    resources: Mapping[str, Any] = field(default_factory=dict)
    args: tuple[str, ...] = ()
    env: tuple[Mapping[str, Any], ...] = ()


@dataclass(frozen=True)
class Ingress:
    host: str
    class_name: str | None = None
    tls_secret: str | None = None


@dataclass(frozen=True)
class Autoscale:
    min: int
    max: int
    metric: str = "cpu"
    target: int = 80


@dataclass(frozen=True)
class InferenceService:
    """A parsed InferenceService: identity from metadata plus the defaulted, validated spec."""

    name: str
    namespace: str
    uid: str
    model: ModelSource
    generation: int = 1
    image: str = "baton:0.1.0"
    image_pull_policy: str = "IfNotPresent"
    prefill: Pool = field(default_factory=Pool)
    decode: Pool = field(default_factory=Pool)
    router: RouterPool = field(default_factory=RouterPool)
    kv_backend: str = "nixl"
    ingress: Ingress | None = None
    autoscaling: Mapping[str, Autoscale] = field(default_factory=dict)

    def pool(self, role: WorkerRole) -> Pool:
        return self.prefill if role == "prefill" else self.decode

    def replicas(self, role: Role) -> int:
        return self.router.replicas if role == "router" else self.pool(role).replicas

    @property
    def url(self) -> str:
        if self.ingress is not None:
            scheme = "https" if self.ingress.tls_secret else "http"
            return f"{scheme}://{self.ingress.host}"
        return f"http://{self.name}.{self.namespace}.svc.cluster.local:8000"


def parse_service(body: Mapping[str, Any]) -> InferenceService:
    """Parse an InferenceService object (metadata + spec) or raise `InvalidSpec`."""
    meta = body.get("metadata") or {}
    name = str(meta.get("name") or "")
    if not _DNS_LABEL.match(name) or len(name) > 63 - _LONGEST_SUFFIX:
        raise InvalidSpec(
            f"metadata.name {name!r}: must be a DNS-1035 label of at most "
            f"{63 - _LONGEST_SUFFIX} characters (children are named <name>-prefill)"
        )
    spec = _mapping(body.get("spec"), "spec")
    return InferenceService(
        name=name,
        namespace=str(meta.get("namespace") or "default"),
        uid=str(meta.get("uid") or ""),
        generation=int(meta.get("generation") or 1),
        model=parse_model(_mapping(spec.get("model"), "spec.model")),
        image=_string(spec.get("image", "baton:0.1.0"), "spec.image"),
        image_pull_policy=_choice(spec.get("imagePullPolicy", "IfNotPresent"),
                                  "spec.imagePullPolicy", PULL_POLICIES),
        prefill=_pool(spec.get("prefill"), "spec.prefill"),
        decode=_pool(spec.get("decode"), "spec.decode"),
        router=_router(spec.get("router"), "spec.router"),
        kv_backend=_choice(_mapping(spec.get("kvTransfer"), "spec.kvTransfer").get("backend", "nixl"),
                           "spec.kvTransfer.backend", KV_BACKENDS),
        ingress=_ingress(spec.get("ingress")),
        autoscaling=_autoscaling(_mapping(spec.get("autoscaling"), "spec.autoscaling")),
    )


def parse_model(model: Mapping[str, Any]) -> ModelSource:
    """Parse `spec.model`; see DESIGN.md "CLI contract" for what each scheme renders to."""
    uri = _string(model.get("uri"), "spec.model.uri")
    kind, location, sub_path = _split_uri(uri)
    token = model.get("tokenSecretRef")
    secret: SecretKeyRef | None = None
    if token is not None:
        if kind != "hf":
            raise InvalidSpec("spec.model.tokenSecretRef: only hf:// models take a token Secret")
        token = _mapping(token, "spec.model.tokenSecretRef")
        secret = SecretKeyRef(
            name=_matching(token.get("name"), "spec.model.tokenSecretRef.name", _DNS_SUBDOMAIN),
            key=_matching(token.get("key", "token"), "spec.model.tokenSecretRef.key", _SECRET_KEY),
        )
    served = model.get("servedName") or _default_served_name(kind, location, sub_path)
    served = _string(served, "spec.model.servedName")
    if any(c.isspace() for c in served):
        raise InvalidSpec(f"spec.model.servedName {served!r}: must not contain whitespace")
    return ModelSource(uri=uri, kind=kind, location=location, sub_path=sub_path,
                       served_name=served, token_secret=secret)


def _split_uri(uri: str) -> tuple[ModelKind, str, str]:
    bad = f"spec.model.uri {uri!r}"
    if uri.startswith("builtin:"):
        name = uri.removeprefix("builtin:")
        if not _BUILTIN.match(name):
            raise InvalidSpec(f"{bad}: expected builtin:NAME, e.g. builtin:smollm2-135m")
        return "builtin", name, ""
    if uri.startswith("hf://"):
        parts = uri.removeprefix("hf://").split("/")
        if len(parts) != 2 or not all(_HF_PART.match(p) for p in parts):
            raise InvalidSpec(f"{bad}: expected hf://ORG/NAME")
        return "hf", "/".join(parts), ""
    if uri.startswith("pvc://"):
        claim, _, rest = uri.removeprefix("pvc://").partition("/")
        if not _DNS_SUBDOMAIN.match(claim) or len(claim) > 253:
            raise InvalidSpec(f"{bad}: expected pvc://CLAIM[/PATH] with CLAIM a valid claim name")
        return "pvc", claim, _clean_relative(rest.strip("/"), bad)
    if uri.startswith("file:///"):
        path = uri.removeprefix("file://")
        if _clean_relative(path.strip("/"), bad) == "":
            raise InvalidSpec(f"{bad}: expected file:///ABSOLUTE/PATH (not the root)")
        return "file", posixpath.normpath(path), ""
    raise InvalidSpec(f"{bad}: scheme must be one of builtin:, hf://, pvc://, file:///")


def _clean_relative(path: str, bad: str) -> str:
    parts = path.split("/") if path else []
    if any(p in ("", ".", "..") for p in parts):
        raise InvalidSpec(f"{bad}: path must not contain empty, '.' or '..' segments")
    return path


def _default_served_name(kind: ModelKind, location: str, sub_path: str) -> str:
    last = (sub_path or location).rstrip("/").rsplit("/", 1)[-1]
    return last.lower()


def _pool(raw: Any, where: str) -> Pool:
    pool = _mapping(raw, where)
    rollout = _mapping(pool.get("rolloutStrategy"), f"{where}.rolloutStrategy")
    shm = pool.get("sharedMemorySize", "1Gi")
    if isinstance(shm, bool) or not (isinstance(shm, int) and shm >= 0 or
                                     isinstance(shm, str) and _QUANTITY.match(shm)):
        raise InvalidSpec(f"{where}.sharedMemorySize {shm!r}: expected a quantity such as 1Gi")
    return Pool(
        replicas=_integer(pool.get("replicas", 1), f"{where}.replicas", minimum=0),
        resources=_mapping(pool.get("resources"), f"{where}.resources"),
        args=_strings(pool.get("args"), f"{where}.args"),
        env=_env(pool.get("env"), f"{where}.env"),
        node_selector=_string_map(pool.get("nodeSelector"), f"{where}.nodeSelector"),
        tolerations=_objects(pool.get("tolerations"), f"{where}.tolerations"),
        shared_memory_size=str(shm),
        max_surge=_int_or_percent(rollout.get("maxSurge", "25%"), f"{where}.rolloutStrategy.maxSurge"),
        max_unavailable=_int_or_percent(rollout.get("maxUnavailable", 0),
                                        f"{where}.rolloutStrategy.maxUnavailable"),
        template=_template(pool.get("template"), f"{where}.template"),
    )


def _router(raw: Any, where: str) -> RouterPool:
    router = _mapping(raw, where)
    return RouterPool(
        replicas=_integer(router.get("replicas", 1), f"{where}.replicas", minimum=0),
        policy=_choice(router.get("policy", "round_robin"), f"{where}.policy", ROUTER_POLICIES),
        resources=_mapping(router.get("resources"), f"{where}.resources"),
        args=_strings(router.get("args"), f"{where}.args"),
        env=_env(router.get("env"), f"{where}.env"),
    )


def _ingress(raw: Any) -> Ingress | None:
    if raw is None:
        return None
    ingress = _mapping(raw, "spec.ingress")
    tls = ingress.get("tls")
    class_name = ingress.get("className")
    return Ingress(
        host=_string(ingress.get("host"), "spec.ingress.host"),
        class_name=None if class_name is None else _string(class_name, "spec.ingress.className"),
        tls_secret=None if tls is None else _matching(
            _mapping(tls, "spec.ingress.tls").get("secretName"),
            "spec.ingress.tls.secretName", _DNS_SUBDOMAIN),
    )


def _autoscaling(raw: Mapping[str, Any]) -> dict[str, Autoscale]:
    result: dict[str, Autoscale] = {}
    for role, value in raw.items():
        where = f"spec.autoscaling.{role}"
        if role not in WORKER_ROLES:
            raise InvalidSpec(f"{where}: only prefill and decode pools autoscale")
        scale = _mapping(value, where)
        low = _integer(scale.get("min"), f"{where}.min", minimum=1)
        high = _integer(scale.get("max"), f"{where}.max", minimum=1)
        if low > high:
            raise InvalidSpec(f"{where}: min ({low}) must not exceed max ({high})")
        target = _integer(scale.get("target", 80), f"{where}.target", minimum=1)
        if target > 100:
            raise InvalidSpec(f"{where}.target {target}: a utilization percentage, 1..100")
        result[role] = Autoscale(min=low, max=high, target=target,
                                 metric=_choice(scale.get("metric", "cpu"), f"{where}.metric", METRICS))
    return result


def _template(raw: Any, where: str) -> Mapping[str, Any]:
    template = _mapping(raw, where)
    pod_spec = _mapping(template.get("spec"), f"{where}.spec")
    for key in ("containers", "initContainers", "volumes"):
        for i, item in enumerate(_objects(pod_spec.get(key), f"{where}.spec.{key}")):
            if not isinstance(item.get("name"), str) or not item["name"]:
                raise InvalidSpec(f"{where}.spec.{key}[{i}]: every entry needs a name")
    return template


# -- scalar checks -------------------------------------------------------------------------

def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidSpec(f"{where}: expected an object, got {type(value).__name__}")
    return value


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidSpec(f"{where}: expected a non-empty string, got {value!r}")
    return value


def _matching(value: Any, where: str, pattern: re.Pattern[str]) -> str:
    text = _string(value, where)
    if not pattern.match(text):
        raise InvalidSpec(f"{where} {text!r}: must match {pattern.pattern}")
    return text


def _choice(value: Any, where: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise InvalidSpec(f"{where} {value!r}: must be one of {', '.join(choices)}")
    return str(value)


def _integer(value: Any, where: str, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidSpec(f"{where} {value!r}: expected an integer >= {minimum}")
    return value


def _int_or_percent(value: Any, where: str) -> int | str:
    if isinstance(value, str) and _PERCENT.match(value):
        return value
    return _integer(value, where, minimum=0)


def _strings(value: Any, where: str) -> tuple[str, ...]:
    items = _list(value, where)
    if not all(isinstance(item, str) for item in items):
        raise InvalidSpec(f"{where}: expected a list of strings")
    return tuple(items)


def _objects(value: Any, where: str) -> tuple[Mapping[str, Any], ...]:
    items = _list(value, where)
    if not all(isinstance(item, Mapping) for item in items):
        raise InvalidSpec(f"{where}: expected a list of objects")
    return tuple(items)


def _env(value: Any, where: str) -> tuple[Mapping[str, Any], ...]:
    items = _objects(value, where)
    for i, item in enumerate(items):
        _string(item.get("name"), f"{where}[{i}].name")
    return items


def _string_map(value: Any, where: str) -> Mapping[str, str]:
    mapping = _mapping(value, where)
    if not all(isinstance(v, str) for v in mapping.values()):
        raise InvalidSpec(f"{where}: expected string values")
    return mapping


def _list(value: Any, where: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidSpec(f"{where}: expected a list, got {type(value).__name__}")
    return value
