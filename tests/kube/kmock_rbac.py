"""RBAC for the emulated API: the bearer token names the caller, the Role/ClusterRole objects
stored in the emulator decide, as kube-apiserver's RBAC authorizer does.

Tokens of the form `serviceaccount:NAMESPACE:NAME` authenticate as
`system:serviceaccount:NAMESPACE:NAME` (groups `system:serviceaccounts`,
`system:serviceaccounts:NAMESPACE`, `system:authenticated`) and are authorized by RBAC; any other
token is an administrator (`system:masters`, everything allowed), which is what the tests'
own client uses. An administrator may impersonate (`kubectl --as=USER`, the Impersonate-User
header): kubectl sends no bearer token over plain HTTP, so that is how a test runs kubectl as
a ServiceAccount. Discovery (/api, /apis, /version) is open to everyone, as the default
`system:discovery` binding makes it. Verbs follow the API server: GET of one object `get`, of a
collection `list` (`watch` with ?watch=true), POST `create`, PUT `update`, PATCH `patch`,
DELETE `delete` (`deletecollection` without a name); a subresource is `resource/subresource`.
Not modelled: aggregated ClusterRoles, impersonation, `escalate`/`bind` checks on RBAC writes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

SA_PREFIX = "serviceaccount:"
RBAC = "rbac.authorization.k8s.io"


@dataclass(frozen=True)
class Identity:
    user: str
    groups: tuple[str, ...]

    @property
    def admin(self) -> bool:
        return "system:masters" in self.groups

    @classmethod
    def from_token(cls, token: str, impersonate: str = "") -> Identity:
        if token.startswith(SA_PREFIX):
            namespace, _, name = token.removeprefix(SA_PREFIX).partition(":")
            return cls.user_named(f"system:serviceaccount:{namespace}:{name}")
        if impersonate:
            return cls.user_named(impersonate)
        return cls("admin", ("system:masters", "system:authenticated"))

    @classmethod
    def user_named(cls, user: str) -> Identity:
        parts = user.split(":")
        if parts[:2] == ["system", "serviceaccount"] and len(parts) == 4:
            return cls(user, ("system:serviceaccounts", f"system:serviceaccounts:{parts[2]}",
                              "system:authenticated"))
        return cls(user, ("system:authenticated",))


@dataclass(frozen=True)
class Attributes:
    """What a request asks for, in RBAC's terms."""

    verb: str
    group: str
    resource: str  # plural, or plural/subresource
    namespace: str | None
    name: str | None

    def describe(self, user: str) -> str:
        kind = f'{self.resource.split("/")[0]}{"." + self.group if self.group else ""}'
        what = f'{kind} "{self.name}"' if self.name else kind
        where = f' in the namespace "{self.namespace}"' if self.namespace else " at the cluster scope"
        return (f'{what} is forbidden: User "{user}" cannot {self.verb} resource '
                f'"{self.resource}" in API group "{self.group}"{where}')


def verb(method: str, named: bool, watch: bool) -> str:
    if method == "GET":
        return "get" if named else ("watch" if watch else "list")
    if method == "DELETE":
        return "delete" if named else "deletecollection"
    return {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(method, method.lower())


def allowed(identity: Identity, attrs: Attributes,
            objects: Mapping[str, Iterable[Mapping[str, Any]]]) -> bool:
    """`objects`: the stored roles, clusterroles, rolebindings and clusterrolebindings."""
    if identity.admin:
        return True
    roles = {(r["metadata"].get("namespace"), r["metadata"]["name"]): r for r in objects["roles"]}
    cluster_roles = {r["metadata"]["name"]: r for r in objects["clusterroles"]}
    for binding in objects["clusterrolebindings"]:
        if _binds(binding, identity) and _grants(cluster_roles.get(binding["roleRef"]["name"]),
                                                 attrs):
            return True
    for binding in objects["rolebindings"]:
        namespace = binding["metadata"].get("namespace")
        if namespace != attrs.namespace or not _binds(binding, identity):
            continue
        ref = binding["roleRef"]
        role = (cluster_roles.get(ref["name"]) if ref["kind"] == "ClusterRole"
                else roles.get((namespace, ref["name"])))
        if _grants(role, attrs):
            return True
    return False


def _binds(binding: Mapping[str, Any], identity: Identity) -> bool:
    for subject in binding.get("subjects") or []:
        kind, name = subject.get("kind"), subject.get("name")
        if kind == "ServiceAccount" and identity.user == (
                f"system:serviceaccount:{subject.get('namespace')}:{name}"):
            return True
        if (kind == "User" and name == identity.user) or (
                kind == "Group" and name in identity.groups):
            return True
    return False


def _grants(role: Mapping[str, Any] | None, attrs: Attributes) -> bool:
    return role is not None and any(_matches(rule, attrs) for rule in role.get("rules") or [])


def _matches(rule: Mapping[str, Any], attrs: Attributes) -> bool:
    def has(field: str, value: str) -> bool:
        return value in (rule.get(field) or []) or "*" in (rule.get(field) or [])

    names = rule.get("resourceNames") or []
    return (has("verbs", attrs.verb) and has("apiGroups", attrs.group)
            and has("resources", attrs.resource)
            and (not names or attrs.name in names))
