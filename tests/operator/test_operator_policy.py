"""The pod policy and the template merge rule, without an API server: what a pool's template
may put into a pod, the message that says which setting allows it, and how items merge."""

from __future__ import annotations

from typing import Any

import pytest
from baton_operator.builders import build_deployment
from baton_operator.config import OperatorConfig
from baton_operator.policy import PodPolicy, check_policy
from baton_operator.spec import InvalidSpec, parse_service

STRICT = PodPolicy()


def service(**spec: Any) -> Any:
    spec.setdefault("model", {"uri": "builtin:smollm2-135m"})
    return parse_service({"metadata": {"name": "llm", "namespace": "ml", "uid": "u"},
                          "spec": spec})


def template(**pod: Any) -> dict[str, Any]:
    return {"decode": {"template": {"spec": pod}}}


def main(**fields: Any) -> dict[str, Any]:
    return {"containers": [{"name": "main", **fields}]}


REFUSED = [  # (spec, field named in the message, the setting that allows it)
    (template(**main(securityContext={"privileged": True})),
     "spec.decode.template.spec.containers[main].securityContext.privileged True",
     "podPolicy.allowPrivileged=true"),
    (template(**main(securityContext={"allowPrivilegeEscalation": True})),
     "containers[main].securityContext.allowPrivilegeEscalation", "allowPrivileged"),
    (template(**main(securityContext={"capabilities": {"add": ["SYS_ADMIN"]}})),
     "capabilities.add ['SYS_ADMIN']", "allowPrivileged"),
    (template(securityContext={"seccompProfile": {"type": "Unconfined"}}),
     "spec.decode.template.spec.securityContext.seccompProfile.type", "allowPrivileged"),
    (template(hostNetwork=True), "spec.decode.template.spec.hostNetwork True",
     "podPolicy.allowHostNamespaces=true"),
    (template(hostPID=True), "spec.hostPID", "allowHostNamespaces"),
    (template(hostIPC=True), "spec.hostIPC", "allowHostNamespaces"),
    (template(containers=[{"name": "side", "image": "s", "ports": [
        {"name": "p", "containerPort": 80, "hostPort": 80}]}]),
     "containers[side].ports[p].hostPort", "allowHostNamespaces"),
    (template(volumes=[{"name": "etc", "hostPath": {"path": "/etc"}}]),
     "spec.decode.template.spec.volumes[etc].hostPath '/etc'", "podPolicy.allowHostPath=true"),
    ({"model": {"uri": "file:///etc"}}, "spec.model.uri 'file:///etc'",
     "podPolicy.allowHostPath=true (operator env BATON_POLICY_ALLOW_HOST_PATH=true)"),
    (template(**main(securityContext={"runAsUser": 0})),
     "containers[main].securityContext.runAsUser 0", "podPolicy.allowRoot=true"),
    (template(securityContext={"runAsUser": None},
              **main(securityContext={"runAsNonRoot": False})),
     "containers[main].securityContext.runAsNonRoot False", "allowRoot"),
    (template(initContainers=[{"name": "setup", "image": "busybox",
                               "securityContext": {"runAsUser": 0}}]),
     "initContainers[setup].securityContext.runAsUser 0", "allowRoot"),
    (template(serviceAccountName="cluster-admin-sa"),
     "spec.serviceAccountName 'cluster-admin-sa'", "podPolicy.serviceAccounts=[NAME]"),
]


@pytest.mark.parametrize(("spec", "field", "setting"), REFUSED,
                         ids=[r[1].split(" ")[0].rsplit(".", 1)[-1] for r in REFUSED])
def test_what_the_policy_refuses_and_which_setting_allows_it(spec: dict[str, Any], field: str,
                                                             setting: str) -> None:
    with pytest.raises(InvalidSpec) as err:
        check_policy(service(**spec), STRICT)
    assert field in str(err.value) and setting in str(err.value)
    assert "refused by the operator's pod policy" in str(err.value)


def test_each_setting_allows_its_kind_only() -> None:
    env = {"BATON_POLICY_ALLOW_PRIVILEGED": "true", "BATON_POLICY_ALLOW_HOST_NAMESPACES": "1",
           "BATON_POLICY_ALLOW_HOST_PATH": "yes", "BATON_POLICY_ALLOW_ROOT": "true",
           "BATON_POLICY_SERVICE_ACCOUNTS": "cluster-admin-sa, other"}
    lenient = OperatorConfig.from_env(env).policy
    assert lenient == PodPolicy(True, True, True, True, frozenset({"cluster-admin-sa", "other"}))
    for spec, _, _ in REFUSED:
        check_policy(service(**spec), lenient)
    only_host_path = PodPolicy(allow_host_path=True)
    check_policy(service(model={"uri": "file:///srv/models"}), only_host_path)
    with pytest.raises(InvalidSpec, match="hostNetwork"):
        check_policy(service(**template(hostNetwork=True)), only_host_path)
    with pytest.raises(ValueError, match="BATON_POLICY_ALLOW_ROOT='maybe'"):
        PodPolicy.from_env({"BATON_POLICY_ALLOW_ROOT": "maybe"})


def test_what_a_restricted_pod_may_have_passes() -> None:
    check_policy(service(), STRICT)  # the pods the operator renders itself
    check_policy(service(model={"uri": "hf://org/name"}, prefill={"template": {"spec": {
        "priorityClassName": "inference", "serviceAccountName": "default",
        "securityContext": {"runAsNonRoot": False},  # runAsUser 10001 still applies
        "containers": [{"name": "exporter", "image": "e:1", "ports": [{"containerPort": 9}]},
                       {"name": "main", "securityContext": {
                           "capabilities": {"add": ["NET_BIND_SERVICE"]}}}]}}}), STRICT)


def pod(spec: dict[str, Any], role: str = "decode") -> dict[str, Any]:
    return dict(build_deployment(service(**spec), role)["spec"]["template"]["spec"])  # type: ignore[arg-type]


def test_template_volumes_env_and_mounts_replace_the_item_of_the_same_key() -> None:
    spec = template(volumes=[{"name": "tmp", "emptyDir": {"medium": "Memory"}}],
                    containers=[{"name": "main",
                                 "env": [{"name": "HF_HOME", "valueFrom": {"secretKeyRef": {
                                     "name": "s", "key": "k"}}}],
                                 "volumeMounts": [{"name": "scratch", "mountPath": "/tmp"}]}])
    rendered = pod(spec)
    tmp = next(v for v in rendered["volumes"] if v["name"] == "tmp")
    assert tmp == {"name": "tmp", "emptyDir": {"medium": "Memory"}}, "replaced, not merged"
    main_container = rendered["containers"][0]
    hf_home = next(e for e in main_container["env"] if e["name"] == "HF_HOME")
    assert hf_home == {"name": "HF_HOME", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}
    mounts = {m["mountPath"]: m["name"] for m in main_container["volumeMounts"]}
    assert mounts["/tmp"] == "scratch" and mounts["/cache"] == "cache"
    assert len(main_container["volumeMounts"]) == len({m["mountPath"] for m in
                                                       main_container["volumeMounts"]})


def test_a_template_that_replaces_only_the_command_is_refused() -> None:
    with pytest.raises(InvalidSpec, match=r"spec\.decode\.template\.spec\.containers\[main\]"
                                          r"\.command: .*set args as well"):
        service(**template(**main(command=["python", "-m", "mine"])))
    both = pod(template(**main(command=["python", "-m", "mine"], args=[])))["containers"][0]
    assert (both["command"], both["args"]) == (["python", "-m", "mine"], [])
    args_only = pod(template(**main(args=["serve", "--x"])))["containers"][0]
    assert args_only["command"] + args_only["args"] == ["baton", "serve", "--x"]
