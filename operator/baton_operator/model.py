"""`spec.model`: the model URI schemes and what each one renders to in a pod."""

from __future__ import annotations

import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from baton_operator.checks import DNS_SUBDOMAIN, InvalidSpec, mapping, matching, string

ModelKind = Literal["builtin", "hf", "pvc", "file"]
MODEL_MOUNT = "/models"

_HF_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_BUILTIN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")


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


def parse_model(model: Mapping[str, Any]) -> ModelSource:
    """Parse `spec.model`; see docs/architecture.md "CLI contract" for what each scheme renders to."""
    uri = string(model.get("uri"), "spec.model.uri")
    kind, location, sub_path = _split_uri(uri)
    secret = secret_ref(model.get("tokenSecretRef"), "spec.model.tokenSecretRef",
                        default_key="token")
    if secret is not None and kind != "hf":
        raise InvalidSpec("spec.model.tokenSecretRef: only hf:// models take a token Secret")
    served = model.get("servedName") or _default_served_name(location, sub_path)
    served = string(served, "spec.model.servedName")
    if any(c.isspace() for c in served):
        raise InvalidSpec(f"spec.model.servedName {served!r}: must not contain whitespace")
    return ModelSource(uri=uri, kind=kind, location=location, sub_path=sub_path,
                       served_name=served, token_secret=secret)


def secret_ref(raw: Any, where: str, *, default_key: str) -> SecretKeyRef | None:
    """A `{name, key}` reference to one key of a Secret; None when absent."""
    if raw is None:
        return None
    ref = mapping(raw, where)
    return SecretKeyRef(name=matching(ref.get("name"), f"{where}.name", DNS_SUBDOMAIN),
                        key=matching(ref.get("key", default_key), f"{where}.key", _SECRET_KEY))


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
        if not DNS_SUBDOMAIN.match(claim) or len(claim) > 253:
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


def _default_served_name(location: str, sub_path: str) -> str:
    """The last path segment, lower-cased: builtin:smollm2-135m -> smollm2-135m."""
    last = (sub_path or location).rstrip("/").rsplit("/", 1)[-1]
    return last.lower()
