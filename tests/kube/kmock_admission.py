"""What the API server does to a write before storing it, for the emulated API (kmock_compat).

- Structural defaulting of custom resources from their CRD's schema (`default:` values of
  missing properties, then the defaults inside them), as on every create and update.

- A few of kube-apiserver's own validations, with its status codes and messages: integers
  beyond int32 in the fields the operator sets (400: the JSON cannot be decoded into the Go
  type), Ingress rule hosts that are not DNS-1123 subdomains and object names that are not
  valid for their kind (422 Invalid).
- Admission policies a test installs (`Policy`), standing in for a ValidatingAdmissionPolicy:
  a denial is 422 Invalid with the policy's message, as `reason: Invalid` (the default) gives.
Everything else is accepted: there is no OpenAPI schema validation (kubectl --validate=false).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

INT32_MAX = 2**31 - 1
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
SUBDOMAIN_HELP = ("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric "
                  "characters, '-' or '.', and must start and end with an alphanumeric character")
# kind -> (Go type, [path to an int32 field]) for the kinds the operator writes
INT32_FIELDS: dict[str, list[tuple[str, tuple[str, ...]]]] = {
    "Deployment": [("DeploymentSpec", ("spec", "replicas"))],
    "HorizontalPodAutoscaler": [("HorizontalPodAutoscalerSpec", ("spec", "minReplicas")),
                                ("HorizontalPodAutoscalerSpec", ("spec", "maxReplicas"))],
}
GROUPS = {"Ingress": "networking.k8s.io", "Deployment": "apps",
          "HorizontalPodAutoscaler": "autoscaling", "PodDisruptionBudget": "policy"}
NAMED_KINDS = {"Service", *GROUPS}  # the kinds whose names are checked here


class Rejected(Exception):
    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status, self.reason, self.message = status, reason, message


@dataclass(frozen=True)
class Policy:
    """Deny writes of `plural` objects for which `denies(obj)` is true."""

    name: str
    plural: str
    denies: Callable[[Mapping[str, Any]], bool]
    message: str


def apply_defaults(obj: Any, schema: Mapping[str, Any]) -> Any:
    """Fill in the schema's defaults where properties are missing (in place; returns obj)."""
    if isinstance(obj, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key not in obj and "default" in sub:
                obj[key] = copy.deepcopy(sub["default"])
            if key in obj:
                apply_defaults(obj[key], sub)
    elif isinstance(obj, list) and "items" in schema:
        for item in obj:
            apply_defaults(item, schema["items"])
    return obj


def check(plural: str, obj: Mapping[str, Any], policies: list[Policy]) -> None:
    """Raise `Rejected` the way the API server answers a bad create/update of `obj`."""
    kind = str(obj.get("kind") or "")
    _int32(kind, obj)
    problems = _invalid(kind, obj)
    name = (obj.get("metadata") or {}).get("name", "")
    group = GROUPS.get(kind)
    qualified = f"{kind}.{group}" if group else kind
    if problems:
        raise Rejected(422, "Invalid", f'{qualified} "{name}" is invalid: {"; ".join(problems)}')
    for policy in policies:
        if policy.plural == plural and policy.denies(obj):
            raise Rejected(422, "Invalid", (
                f'{qualified.lower()}s "{name}" is forbidden: ValidatingAdmissionPolicy '
                f"'{policy.name}' with binding '{policy.name}' denied request: {policy.message}"))


def _int32(kind: str, obj: Mapping[str, Any]) -> None:
    for go_type, path in INT32_FIELDS.get(kind, []):
        value: Any = obj
        for key in path:
            value = value.get(key) if isinstance(value, Mapping) else None
        if isinstance(value, int) and not -INT32_MAX - 1 <= value <= INT32_MAX:
            raise Rejected(400, "BadRequest", (
                f"json: cannot unmarshal number {value} into Go struct field "
                f"{go_type}.{'.'.join(path)} of type int32"))


def _invalid(kind: str, obj: Mapping[str, Any]) -> list[str]:
    problems = []
    name = str((obj.get("metadata") or {}).get("name") or "")
    if kind == "Service" and (not DNS1035_LABEL.match(name) or len(name) > 63):
        problems.append(f'metadata.name: Invalid value: "{name}": a DNS-1035 label must consist '
                        "of lower case alphanumeric characters or '-', start with an alphabetic "
                        "character, and end with an alphanumeric character")
    elif kind in NAMED_KINDS and (not DNS1123_SUBDOMAIN.match(name) or len(name) > 253):
        problems.append(f'metadata.name: Invalid value: "{name}": {SUBDOMAIN_HELP}')
    if kind == "Ingress":
        for i, rule in enumerate((obj.get("spec") or {}).get("rules") or []):
            host = str(rule.get("host", ""))
            bare = host.removeprefix("*.")
            if host and not (DNS1123_SUBDOMAIN.match(bare) and len(bare) <= 253):
                problems.append(f'spec.rules[{i}].host: Invalid value: "{host}": '
                                f"{SUBDOMAIN_HELP} (e.g. 'example.com')")
    return problems
