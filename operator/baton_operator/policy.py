"""The pod policy: what a pool's `template` (and the model source) may put into a pod.

Whoever may create an InferenceService gets pods made by the operator's ServiceAccount, so the
operator refuses what would give them more than a restricted pod: privileged containers
(privileged, allowPrivilegeEscalation, added capabilities, an Unconfined seccomp profile),
host namespaces (hostNetwork, hostPID, hostIPC, hostPort), hostPath volumes (a `file://`
model is one), a container that may run as root, and a ServiceAccount other than the
namespace's default. Each is allowed by one setting of the operator (a chart value, passed as
an environment variable); the InvalidSpec message names the field and the setting.
The rendered pods are checked after the template is merged, so nothing slips in between.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from baton_operator.builders.pods import MODEL_VOLUME, build_worker_pod
from baton_operator.checks import InvalidSpec
from baton_operator.spec import WORKER_ROLES, InferenceService

Rule = Literal["privileged", "hostNamespaces", "hostPath", "root", "serviceAccount"]
# rule -> (chart value, operator environment variable) that allows it
SETTINGS: dict[Rule, tuple[str, str]] = {
    "privileged": ("podPolicy.allowPrivileged=true", "BATON_POLICY_ALLOW_PRIVILEGED=true"),
    "hostNamespaces": ("podPolicy.allowHostNamespaces=true",
                       "BATON_POLICY_ALLOW_HOST_NAMESPACES=true"),
    "hostPath": ("podPolicy.allowHostPath=true", "BATON_POLICY_ALLOW_HOST_PATH=true"),
    "root": ("podPolicy.allowRoot=true", "BATON_POLICY_ALLOW_ROOT=true"),
    "serviceAccount": ("podPolicy.serviceAccounts=[NAME]", "BATON_POLICY_SERVICE_ACCOUNTS=NAME"),
}
SAFE_CAPABILITIES = {"NET_BIND_SERVICE"}  # the one Pod Security "restricted" lets a pod add


@dataclass(frozen=True)
class Violation:
    rule: Rule
    field: str  # where in the pod spec, e.g. spec.hostNetwork
    value: Any


@dataclass(frozen=True)
class PodPolicy:
    allow_privileged: bool = False
    allow_host_namespaces: bool = False
    allow_host_path: bool = False
    allow_root: bool = False
    service_accounts: frozenset[str] = frozenset()

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> PodPolicy:
        accounts = env.get("BATON_POLICY_SERVICE_ACCOUNTS", "")
        return cls(
            allow_privileged=_flag(env, "BATON_POLICY_ALLOW_PRIVILEGED"),
            allow_host_namespaces=_flag(env, "BATON_POLICY_ALLOW_HOST_NAMESPACES"),
            allow_host_path=_flag(env, "BATON_POLICY_ALLOW_HOST_PATH"),
            allow_root=_flag(env, "BATON_POLICY_ALLOW_ROOT"),
            service_accounts=frozenset(a.strip() for a in accounts.split(",") if a.strip()),
        )

    def allows(self, violation: Violation) -> bool:
        if violation.rule == "serviceAccount":
            return violation.value in self.service_accounts
        return {"privileged": self.allow_privileged, "hostNamespaces": self.allow_host_namespaces,
                "hostPath": self.allow_host_path, "root": self.allow_root}[violation.rule]


def check_policy(svc: InferenceService, policy: PodPolicy) -> None:
    """Raise InvalidSpec for the first thing in a worker pod the policy refuses."""
    for role in WORKER_ROLES:
        pod = build_worker_pod(svc, role)
        for violation in violations(pod["spec"]):
            if not policy.allows(violation):
                raise InvalidSpec(_message(svc, role, violation))


def breaks_policy(deployment: Mapping[str, Any], policy: PodPolicy) -> bool:
    """Whether a live Deployment's pod template has what the policy refuses (someone edited
    it by hand: the operator then restores the template whole)."""
    pod = ((deployment.get("spec") or {}).get("template") or {}).get("spec") or {}
    return any(not policy.allows(v) for v in violations(pod))


def violations(pod: Mapping[str, Any]) -> Iterator[Violation]:
    """Everything in a pod spec that a restricted pod may not have."""
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(key):
            yield Violation("hostNamespaces", f"spec.{key}", pod[key])
    for i, volume in enumerate(pod.get("volumes") or []):
        if "hostPath" in volume:
            yield Violation("hostPath", f"spec.volumes[{volume.get('name', i)}].hostPath",
                            volume["hostPath"].get("path"))
    account = pod.get("serviceAccountName") or pod.get("serviceAccount")
    if account and account != "default":
        yield Violation("serviceAccount", "spec.serviceAccountName", account)
    pod_sc = pod.get("securityContext") or {}
    yield from _seccomp(pod_sc, "spec.securityContext")
    for key in ("containers", "initContainers", "ephemeralContainers"):
        for container in pod.get(key) or []:
            yield from _container(container, pod_sc, f"spec.{key}[{container.get('name')}]")


def _container(container: Mapping[str, Any], pod_sc: Mapping[str, Any],
               where: str) -> Iterator[Violation]:
    sc = container.get("securityContext") or {}
    for key in ("privileged", "allowPrivilegeEscalation"):
        if sc.get(key):
            yield Violation("privileged", f"{where}.securityContext.{key}", sc[key])
    added = set((sc.get("capabilities") or {}).get("add") or []) - SAFE_CAPABILITIES
    if added:
        yield Violation("privileged", f"{where}.securityContext.capabilities.add", sorted(added))
    yield from _seccomp(sc, f"{where}.securityContext")
    for port in container.get("ports") or []:
        if port.get("hostPort"):
            yield Violation("hostNamespaces", f"{where}.ports[{port.get('name')}].hostPort",
                            port["hostPort"])
    user = sc.get("runAsUser", pod_sc.get("runAsUser"))
    non_root = sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot"))
    if user == 0:
        yield Violation("root", f"{where}.securityContext.runAsUser", 0)
    elif user is None and non_root is not True:
        yield Violation("root", f"{where}.securityContext.runAsNonRoot", non_root)


def _seccomp(sc: Mapping[str, Any], where: str) -> Iterator[Violation]:
    kind = (sc.get("seccompProfile") or {}).get("type")
    if kind == "Unconfined":
        yield Violation("privileged", f"{where}.seccompProfile.type", kind)


def _message(svc: InferenceService, role: str, violation: Violation) -> str:
    chart, env = SETTINGS[violation.rule]
    if violation.field == f"spec.volumes[{MODEL_VOLUME}].hostPath" and svc.model.kind == "file":
        field, value = "spec.model.uri", svc.model.uri  # the model source made this hostPath
    else:
        field, value = f"spec.{role}.template.{violation.field}", violation.value
    return (f"{field} {value!r}: refused by the operator's pod policy ({violation.rule}); "
            f"the chart value {chart} (operator env {env}) allows it")


def _flag(env: Mapping[str, str], name: str) -> bool:
    value = env.get(name, "").strip().lower()
    if value in ("", "0", "false", "no"):
        return False
    if value in ("1", "true", "yes"):
        return True
    raise ValueError(f"{name}={value!r}: expected true or false")
