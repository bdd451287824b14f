"""Unit tests of the pure build_*() functions: spec in, manifests out, no API server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from baton_operator.builders import (
    build_children,
    build_deployment,
    build_headless_service,
    build_hpa,
    build_ingress,
    build_pdb,
    build_router_service,
)
from baton_operator.builders.pods import spec_revision
from baton_operator.builders.workloads import build_probe_deployment
from baton_operator.capabilities import Capabilities
from baton_operator.spec import InferenceService, parse_service

UID = "6a1f0c7e-0000-4000-8000-000000000001"
LABELS = {
    "app.kubernetes.io/name": "baton",
    "app.kubernetes.io/instance": "llm",
    "app.kubernetes.io/component": None,  # filled per role
    "app.kubernetes.io/managed-by": "baton-operator",
    "app.kubernetes.io/part-of": "baton",
    "baton.dev/role": None,
}


def service(**spec: Any) -> InferenceService:
    spec.setdefault("model", {"uri": "builtin:smollm2-135m"})
    return parse_service({"metadata": {"name": "llm", "namespace": "ml", "uid": UID,
                                       "generation": 3}, "spec": spec})


def main_container(deployment: dict[str, Any]) -> dict[str, Any]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == "main")


def command(deployment: dict[str, Any]) -> list[str]:
    container = main_container(deployment)
    return container["command"] + container["args"]


def cli(line: str) -> list[str]:
    """A command line as written in docs/architecture.md "CLI contract", split into argv."""
    return line.split()


def by_name(items: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {item["name"]: item for item in items}


# -- CLI contract ------------------------------------------------------------------------------

def test_default_service_renders_the_cli_contract_exactly() -> None:
    svc = service()
    assert command(build_deployment(svc, "prefill")) == cli(
        "baton serve --model builtin:smollm2-135m --role prefill --host 0.0.0.0 --port 8000 "
        "--bootstrap-port 8998 --kv-transfer nixl --served-model-name smollm2-135m")
    assert command(build_deployment(svc, "decode")) == cli(
        "baton serve --model builtin:smollm2-135m --role decode --host 0.0.0.0 --port 8000 "
        "--kv-port 8999 --move-kv-on-drain --bootstrap-port 8998 --kv-transfer nixl --served-model-name smollm2-135m")
    assert command(build_deployment(svc, "router")) == cli(
        "baton router --host 0.0.0.0 --port 8000 --discovery kubernetes --namespace ml "
        "--prefill-selector app.kubernetes.io/name=baton,app.kubernetes.io/instance=llm,"
        "baton.dev/role=prefill "
        "--decode-selector app.kubernetes.io/name=baton,app.kubernetes.io/instance=llm,"
        "baton.dev/role=decode --policy cache_aware --fallback fail --tokenizer "
        "builtin:smollm2-135m")
    dns = service(router={"discovery": "dns"})
    assert command(build_deployment(dns, "router")) == cli(
        "baton router --host 0.0.0.0 --port 8000 "
        "--prefill-dns llm-prefill.ml.svc.cluster.local:8000:8998 "
        "--decode-dns llm-decode.ml.svc.cluster.local:8000 --policy cache_aware "
        "--fallback fail --tokenizer builtin:smollm2-135m")
    hf = service(model={"uri": "hf://org/name"})  # not in the router's image: the workers'
    assert command(build_deployment(hf, "router"))[-2:] == ["--tokenizer", "workers"]


@pytest.mark.parametrize("backend", ["nixl", "tcp"])
def test_every_kv_plane_port_is_declared_and_the_cluster_key_mounted(backend: str) -> None:
    """The KV plane's ports are named in the pod spec (the NetworkPolicy issue fences them):
    bootstrap on prefill and decode (where a draining decode offers KV), the KV receiver on
    decode, UCX's listeners confined to a range with
    nixl; every pod of the service reads the one cluster-key Secret, read-only."""
    svc = service(kvTransfer={"backend": backend})
    for role, ports in (("prefill", {"http": 8000, "bootstrap": 8998}),
                        ("decode", {"http": 8000, "bootstrap": 8998, "kv": 8999}),
                        ("router", {"http": 8000})):
        pod = build_deployment(svc, role)["spec"]["template"]["spec"]
        main = main_container(build_deployment(svc, role))
        assert {p["name"]: p["containerPort"] for p in main["ports"]} == ports
        env = {e["name"]: e.get("value") for e in main["env"]}
        assert env["BATON_CLUSTER_KEY_FILE"] == "/etc/baton/cluster-key/key"
        assert by_name(main["volumeMounts"])["cluster-key"] == {
            "name": "cluster-key", "mountPath": "/etc/baton/cluster-key", "readOnly": True}
        assert by_name(pod["volumes"])["cluster-key"]["secret"] == {
            "secretName": "llm-cluster-key", "defaultMode": 0o440}
        ucx = env.get("UCX_TCP_PORT_RANGE")
        assert ucx == ("20000-20015" if backend == "nixl" and role != "router" else None)


@pytest.mark.parametrize("discovery", ["kubernetes", "dns"])
def test_the_router_command_parses_as_baton_router(discovery: str) -> None:
    from runtime.router.args import parse_router_args

    argv = command(build_deployment(service(router={"discovery": discovery}), "router"))
    config = parse_router_args(argv[2:])
    assert (config.host, config.port, config.discovery) == (
        "0.0.0.0", 8000, "kubernetes" if discovery == "kubernetes" else "flags")
    if discovery == "kubernetes":
        assert config.namespace == "ml"
        assert config.decode_selector.endswith("baton.dev/role=decode")


def test_fallback_colocated_lets_the_decodes_prefill_locally() -> None:
    """spec.router.fallback: the router's --fallback, and --allow-local-prefill on the decodes
    only; both parse as the runtime's own flags."""
    from runtime.router.args import parse_router_args
    from runtime.server.args import parse_server_args

    svc = service(router={"fallback": "colocated"})
    router = parse_router_args(command(build_deployment(svc, "router"))[2:])
    assert router.fallback == "colocated"
    decode = command(build_deployment(svc, "decode"))
    assert parse_server_args(decode[2:]).disagg.allow_local_prefill is True
    assert "--allow-local-prefill" not in command(build_deployment(svc, "prefill"))
    assert "--allow-local-prefill" not in command(build_deployment(service(), "decode"))


def test_the_router_reads_its_api_keys_from_the_secret_as_a_live_file(tmp_path: Path) -> None:
    """apiKeySecretRef: the key is mounted as a file (a whole-volume mount, never subPath, so a
    rotated Secret reaches the running router) and passed as --api-key-file, never as env."""
    from runtime.router.args import parse_router_args

    svc = service(router={"auth": {"apiKeySecretRef": {"name": "llm-keys", "key": "k"}}})
    deployment = build_deployment(svc, "router")
    argv = command(deployment)
    assert argv[argv.index("--api-key-file") + 1] == "/etc/baton/api-keys/keys"
    keys = tmp_path / "keys"  # the runtime reads the file while parsing: stand in for the mount
    keys.write_text("sk-test\n")
    argv[argv.index("--api-key-file") + 1] = str(keys)
    assert parse_router_args(argv[2:]).api_key_file == str(keys)
    pod = deployment["spec"]["template"]["spec"]
    assert by_name(pod["volumes"])["api-keys"]["secret"] == {
        "secretName": "llm-keys", "items": [{"key": "k", "path": "keys"}], "defaultMode": 0o440}
    mount = by_name(main_container(deployment)["volumeMounts"])["api-keys"]
    assert mount == {"name": "api-keys", "mountPath": "/etc/baton/api-keys", "readOnly": True}
    assert "BATON_API_KEY" not in {e["name"] for e in main_container(deployment)["env"]}
    for role in ("prefill", "decode"):  # workers are fenced by policy and room tickets
        assert "api-keys" not in by_name(build_deployment(svc, role)["spec"]["template"]["spec"]
                                         ["volumes"])
    assert "--api-key-file" not in command(build_deployment(service(), "router"))


def test_the_router_may_only_read_pods_in_its_namespace() -> None:
    """discovery kubernetes: its own ServiceAccount, a Role of get/list/watch on pods, bound;
    dns: none of them, and no token in the pod."""
    children = {(c["kind"], c["metadata"]["name"]): c for c in build_children(service())}
    role = children["Role", "llm-router"]
    assert role["metadata"]["namespace"] == "ml"
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"],
                              "verbs": ["get", "list", "watch"]}]
    binding = children["RoleBinding", "llm-router"]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": "llm-router"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "llm-router",
                                    "namespace": "ml"}]
    assert ("ServiceAccount", "llm-router") in children
    pod = children["Deployment", "llm-router"]["spec"]["template"]["spec"]
    assert (pod["serviceAccountName"], pod["automountServiceAccountToken"]) == ("llm-router", True)
    dns = build_children(service(router={"discovery": "dns"}))
    assert not {c["kind"] for c in dns} & {"ServiceAccount", "Role", "RoleBinding"}
    pod = next(c for c in dns if c["metadata"]["name"] == "llm-router")["spec"]["template"]["spec"]
    assert "serviceAccountName" not in pod and pod["automountServiceAccountToken"] is False


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_workers_know_their_pod_ip(role: str) -> None:
    """The decode advertises $POD_IP as its KV receiver's address (downward API)."""
    env = by_name(main_container(build_deployment(service(), role))["env"])  # type: ignore[arg-type]
    assert env["POD_IP"] == {"name": "POD_IP",
                             "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}


def test_both_worker_pools_carry_the_spec_revision() -> None:
    """runtime/revision.py: one revision for both pools of a spec, as the pod label
    baton.dev/revision and $BATON_REVISION (which `baton serve` reads); a change to what
    either pool computes with makes a new one for both, replicas and resources do not."""

    def revisions(**spec: Any) -> tuple[str, str]:
        found = []
        for role in ("prefill", "decode"):
            deployment = build_deployment(service(**spec), role)  # type: ignore[arg-type]
            label = deployment["spec"]["template"]["metadata"]["labels"]["baton.dev/revision"]
            assert by_name(main_container(deployment)["env"])["BATON_REVISION"]["value"] == label
            found.append(label)
        return found[0], found[1]

    base, same = revisions()
    assert base == same and len(base) == 12
    # the spec cannot set its own: one BATON_REVISION, the operator's
    env = main_container(build_deployment(service(decode={"env": [
        {"name": "BATON_REVISION", "value": "mine"}]}), "decode"))["env"]
    assert [e for e in env if e["name"] == "BATON_REVISION"] == [
        {"name": "BATON_REVISION", "value": revisions(decode={"env": [
            {"name": "BATON_REVISION", "value": "mine"}]})[1]}]
    assert "baton.dev/revision" not in build_deployment(service(), "router")["spec"]["template"][
        "metadata"]["labels"]
    unchanged = [{"decode": {"replicas": 4}},
                 {"prefill": {"resources": {"limits": {"cpu": "3"}}}}]
    for spec in unchanged:
        assert revisions(**spec) == (base, base), spec
    changed = [{"decode": {"args": ["--quantization", "int4"]}},
               {"prefill": {"args": ["--dtype", "bfloat16"]}},
               {"decode": {"tensorParallelSize": 3}, "kvTransfer": {"backend": "tcp"}},
               {"image": "registry.example/baton:other"},
               {"model": {"uri": "hf://Qwen/Qwen3-0.6B"}}]
    seen = {base}
    for spec in changed:
        p, d = revisions(**spec)
        assert p == d and p not in seen, spec
        seen.add(p)


def test_backend_policy_served_name_and_extra_args_follow_the_spec() -> None:
    svc = service(model={"uri": "builtin:smollm2-135m", "servedName": "smol"},
                  kvTransfer={"backend": "tcp"},
                  decode={"args": ["--max-running-requests", "8"]},
                  router={"policy": "least_load", "args": ["--log-level", "debug"]})
    assert command(build_deployment(svc, "decode")) == cli(
        "baton serve --model builtin:smollm2-135m --role decode --host 0.0.0.0 --port 8000 "
        "--kv-port 8999 --move-kv-on-drain --bootstrap-port 8998 --kv-transfer tcp --served-model-name smol --max-running-requests 8")
    assert command(build_deployment(svc, "router"))[-8:] == [
        "--policy", "least_load", "--fallback", "fail", "--tokenizer", "builtin:smollm2-135m",
        "--log-level", "debug"]


MODEL_SOURCES = [  # spec.model.uri -> (--model in the pod, derived --served-model-name)
    ("builtin:smollm2-135m", "builtin:smollm2-135m", "smollm2-135m"),
    ("pvc://weights/llama/3b", "/models/llama/3b", "3b"),
    ("pvc://weights", "/models", "weights"),
    ("file:///srv/models/qwen", "/models", "qwen"),
    ("hf://HuggingFaceTB/SmolLM2-135M-Instruct", "/models/HuggingFaceTB/SmolLM2-135M-Instruct",
     "smollm2-135m-instruct"),
]


@pytest.mark.parametrize(("uri", "model", "served"), MODEL_SOURCES,
                         ids=[uri.split(":")[0] for uri, _, _ in MODEL_SOURCES])
def test_every_model_source_renders_the_cli_contract_exactly(uri: str, model: str,
                                                             served: str) -> None:
    svc = service(model={"uri": uri}, kvTransfer={"backend": "tcp"})
    assert command(build_deployment(svc, "prefill")) == cli(
        f"baton serve --model {model} --role prefill --host 0.0.0.0 --port 8000 "
        f"--bootstrap-port 8998 --kv-transfer tcp --served-model-name {served}")
    assert command(build_deployment(svc, "decode")) == cli(
        f"baton serve --model {model} --role decode --host 0.0.0.0 --port 8000 "
        f"--kv-port 8999 --move-kv-on-drain --bootstrap-port 8998 --kv-transfer tcp --served-model-name {served}")


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_the_runtime_parser_accepts_the_rendered_serve_args(role: str) -> None:
    """The other side of the contract: `baton serve`'s own argument parser (torch-free)."""
    from runtime.server.args import build_parser

    svc = service(model={"uri": "hf://org/name", "servedName": "smol"},
                  **{role: {"args": ["--max-running-requests", "8"]}})
    argv = command(build_deployment(svc, role))  # type: ignore[arg-type]
    assert argv[:2] == ["baton", "serve"]
    parsed = build_parser().parse_args(argv[2:])
    assert (parsed.model, parsed.role, parsed.host, parsed.port) == (
        "/models/org/name", role, "0.0.0.0", 8000)
    assert (parsed.bootstrap_port, parsed.kv_transfer, parsed.served_model_name) == (
        8998, "nixl", "smol")
    assert parsed.max_running_requests == 8


def test_default_children_set() -> None:
    kinds = sorted((c["kind"], c["metadata"]["name"]) for c in build_children(service()))
    revision = spec_revision(service())
    assert kinds == [("Deployment", f"llm-decode-{revision}"),
                     ("Deployment", f"llm-prefill-{revision}"),
                     ("Deployment", "llm-router"), ("NetworkPolicy", "llm-decode"),
                     ("NetworkPolicy", "llm-prefill"), ("NetworkPolicy", "llm-probe"),
                     ("NetworkPolicy", "llm-router"),
                     ("Role", "llm-router"),
                     ("RoleBinding", "llm-router"), ("Service", "llm"),
                     ("Service", "llm-decode"), ("Service", "llm-prefill"),
                     ("ServiceAccount", "llm-router")]


# -- pods ----------------------------------------------------------------------------------

@pytest.mark.parametrize("role", ["prefill", "decode", "router"])
def test_pods_are_hardened(role: str) -> None:
    dep = build_deployment(service(), role)  # type: ignore[arg-type]
    pod = dep["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is (role == "router"), "only the router reads"
    for container in pod["containers"] + pod.get("initContainers", []):
        sc = container["securityContext"]
        assert sc["runAsNonRoot"] is True
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"] == {"drop": ["ALL"]}
    mounts = {m["mountPath"]: m["name"] for m in main_container(dep)["volumeMounts"]}
    volumes = by_name(pod["volumes"])
    for path in ("/tmp", "/cache"):
        assert volumes[mounts[path]] == {"name": mounts[path], "emptyDir": {}}
    env = {e["name"]: e.get("value") for e in main_container(dep)["env"]}
    assert env["XDG_CACHE_HOME"] == "/cache"
    assert "BATON_CACHE" not in env, "an override would hide the model baked into the image"
    assert pod["securityContext"]["runAsUser"] == 10001, "the image's user (Dockerfile)"
    assert env["HOME"] == "/tmp", "a writable home on a read-only root filesystem"


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_workers_get_shared_memory_of_the_requested_size(role: str) -> None:
    dep = build_deployment(service(**{role: {"sharedMemorySize": "8Gi"}}), role)  # type: ignore[arg-type]
    mounts = {m["mountPath"]: m["name"] for m in main_container(dep)["volumeMounts"]}
    shm = by_name(dep["spec"]["template"]["spec"]["volumes"])[mounts["/dev/shm"]]
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    other = "decode" if role == "prefill" else "prefill"
    other_dep = build_deployment(service(**{role: {"sharedMemorySize": "8Gi"}}), other)  # type: ignore[arg-type]
    assert by_name(other_dep["spec"]["template"]["spec"]["volumes"])["dshm"]["emptyDir"][
        "sizeLimit"] == "1Gi"


def test_named_ports_and_probes() -> None:
    svc = service()
    prefill = main_container(build_deployment(svc, "prefill"))
    decode = main_container(build_deployment(svc, "decode"))
    router = main_container(build_deployment(svc, "router"))
    assert [(p["name"], p["containerPort"]) for p in prefill["ports"]] == [
        ("http", 8000), ("bootstrap", 8998)]
    assert [(p["name"], p["containerPort"]) for p in decode["ports"]] == [
        ("http", 8000), ("bootstrap", 8998), ("kv", 8999)]
    assert [(p["name"], p["containerPort"]) for p in router["ports"]] == [("http", 8000)]
    for container in (prefill, decode, router):
        assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
        assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
        assert container["startupProbe"]["httpGet"]["port"] == "http"
    budget = prefill["startupProbe"]["periodSeconds"] * prefill["startupProbe"]["failureThreshold"]
    assert budget >= 600, "workers need minutes to load a model before liveness kicks in"


def test_builtin_model_needs_no_volume_or_init_container() -> None:
    pod = build_deployment(service(), "decode")["spec"]["template"]["spec"]
    assert "initContainers" not in pod
    assert "models" not in by_name(pod["volumes"])


def test_pvc_model_mounts_the_claim_read_only() -> None:
    svc = service(model={"uri": "pvc://weights/llama/3b"})
    dep = build_deployment(svc, "prefill")
    pod = dep["spec"]["template"]["spec"]
    assert by_name(pod["volumes"])["models"]["persistentVolumeClaim"] == {
        "claimName": "weights", "readOnly": True}
    assert by_name(main_container(dep)["volumeMounts"])["models"] == {
        "name": "models", "mountPath": "/models", "readOnly": True}
    assert command(dep)[2:4] == ["--model", "/models/llama/3b"]
    assert svc.model.served_name == "3b"
    assert command(build_deployment(service(model={"uri": "pvc://weights"}), "decode"))[3] == "/models"


def test_file_model_mounts_a_host_path() -> None:
    dep = build_deployment(service(model={"uri": "file:///srv/models/qwen"}), "decode")
    pod = dep["spec"]["template"]["spec"]
    assert by_name(pod["volumes"])["models"]["hostPath"] == {"path": "/srv/models/qwen",
                                                          "type": "Directory"}
    assert command(dep)[2:4] == ["--model", "/models"]
    assert command(dep)[-1] == "qwen"


def test_hf_model_is_pulled_by_an_init_container_with_the_token_secret() -> None:
    svc = service(model={"uri": "hf://HuggingFaceTB/SmolLM2-135M-Instruct",
                         "tokenSecretRef": {"name": "hf-token"}})
    dep = build_deployment(svc, "prefill")
    pod = dep["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["name"] == "model-pull"
    assert init["command"] + init["args"] == [
        "baton", "model", "pull", "hf://HuggingFaceTB/SmolLM2-135M-Instruct",
        "--dest", "/models/HuggingFaceTB/SmolLM2-135M-Instruct"]
    assert by_name(init["env"])["HF_TOKEN"]["valueFrom"] == {
        "secretKeyRef": {"name": "hf-token", "key": "token"}}
    assert by_name(init["volumeMounts"])["models"] == {"name": "models", "mountPath": "/models"}
    assert by_name(pod["volumes"])["models"] == {"name": "models", "emptyDir": {}}
    assert by_name(main_container(dep)["volumeMounts"])["models"]["readOnly"] is True
    assert command(dep)[2:4] == ["--model", "/models/HuggingFaceTB/SmolLM2-135M-Instruct"]
    assert command(dep)[command(dep).index("--served-model-name") + 1] == "smollm2-135m-instruct"
    assert "initContainers" not in build_deployment(svc, "router")["spec"]["template"]["spec"]


def test_hf_model_without_token_has_no_secret() -> None:
    dep = build_deployment(service(model={"uri": "hf://org/name"}), "decode")
    (init,) = dep["spec"]["template"]["spec"]["initContainers"]
    assert "HF_TOKEN" not in by_name(init["env"])


def test_template_merges_into_the_pod_and_its_main_container() -> None:
    template = {
        "metadata": {"annotations": {"team": "ml"},
                     "labels": {"extra": "yes", "baton.dev/role": "hijacked"}},
        "spec": {
            "priorityClassName": "inference",
            "containers": [
                {"name": "main", "resources": {"limits": {"nvidia.com/gpu": 1}},
                 "env": [{"name": "HF_HOME", "value": "/data/hf"}, {"name": "NEW", "value": "1"}]},
                {"name": "exporter", "image": "exporter:1"},
            ],
            "volumes": [{"name": "extra", "configMap": {"name": "cfg"}}],
        },
    }
    svc = service(prefill={"template": template, "env": [{"name": "POOL", "value": "p"}],
                           "resources": {"requests": {"cpu": "2"}},
                           "nodeSelector": {"gpu": "h100"},
                           "tolerations": [{"key": "gpu", "operator": "Exists"}]})
    dep = build_deployment(svc, "prefill")
    tpl = dep["spec"]["template"]
    pod = tpl["spec"]
    assert [c["name"] for c in pod["containers"]] == ["main", "exporter"]
    main = main_container(dep)
    assert main["resources"] == {"requests": {"cpu": "2"}, "limits": {"nvidia.com/gpu": 1}}
    env = {e["name"]: e.get("value") for e in main["env"]}
    assert env["HF_HOME"] == "/data/hf" and env["NEW"] == "1" and env["POOL"] == "p"
    assert env["XDG_CACHE_HOME"] == "/cache"
    assert main["args"][:2] == ["serve", "--model"], "merging must not drop the rendered args"
    assert main["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["priorityClassName"] == "inference"
    assert "extra" in by_name(pod["volumes"]) and "dshm" in by_name(pod["volumes"])
    assert pod["nodeSelector"] == {"gpu": "h100"}
    assert pod["tolerations"] == [{"key": "gpu", "operator": "Exists"}]
    assert tpl["metadata"]["annotations"]["team"] == "ml"
    assert tpl["metadata"]["labels"]["extra"] == "yes"
    assert tpl["metadata"]["labels"]["baton.dev/role"] == "prefill", "selector must keep matching"
    decode = build_deployment(svc, "decode")
    assert [c["name"] for c in decode["spec"]["template"]["spec"]["containers"]] == ["main"]


def test_rollout_strategy_and_replicas() -> None:
    svc = service(decode={"replicas": 3, "rolloutStrategy": {"maxSurge": 1,
                                                             "maxUnavailable": "10%"}})
    dep = build_deployment(svc, "decode")
    assert dep["spec"]["replicas"] == 3
    assert dep["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {
        "maxSurge": 1, "maxUnavailable": "10%"}}
    assert build_deployment(svc, "prefill")["spec"]["strategy"]["rollingUpdate"] == {
        "maxSurge": "25%", "maxUnavailable": 0}


# -- ownership and labels ------------------------------------------------------------------

def test_every_child_is_owned_and_labelled() -> None:
    svc = service(ingress={"host": "llm.example.com"},
                  autoscaling={"prefill": {"min": 1, "max": 4, "metric": "cpu"},
                               "decode": {"min": 2, "max": 8, "metric": "memory"}},
                  router={"replicas": 2})
    children = build_children(svc)
    assert len(children) == 6 + 3 + 1 + 2 + 3 + 4
    for child in children:
        meta = child["metadata"]
        assert meta["namespace"] == "ml"
        assert meta["ownerReferences"] == [{
            "apiVersion": "baton.dev/v1alpha1", "kind": "InferenceService", "name": "llm",
            "uid": UID, "controller": True, "blockOwnerDeletion": True}]
        role = meta["labels"]["baton.dev/role"]
        assert role in ("prefill", "decode", "router")
        component = "probe" if meta["name"] == "llm-probe" else role
        # a worker Deployment is its revision's
        revision = ({"baton.dev/revision": spec_revision(svc)} if child["kind"] == "Deployment"
                    and role != "router" else {})
        assert meta["labels"] == {**LABELS, "app.kubernetes.io/component": component,
                                  "baton.dev/role": role, **revision}


@pytest.mark.parametrize("role", ["prefill", "decode", "router"])
def test_selectors_match_pod_labels_and_use_only_stable_keys(role: str) -> None:
    """The Services, policies and the router's discovery select a pool by the first three;
    a worker Deployment selects its revision's pods only (one Deployment per revision)."""
    dep = build_deployment(service(), role)  # type: ignore[arg-type]
    selector = dep["spec"]["selector"]["matchLabels"]
    revision = {} if role == "router" else {"baton.dev/revision": spec_revision(service())}
    assert selector == {"app.kubernetes.io/name": "baton", "app.kubernetes.io/instance": "llm",
                        "baton.dev/role": role, **revision}
    assert selector.items() <= dep["spec"]["template"]["metadata"]["labels"].items()


# -- services and ingress ------------------------------------------------------------------

def test_services() -> None:
    svc = service()
    prefill = build_headless_service(svc, "prefill")
    assert prefill["spec"]["clusterIP"] == "None"
    assert [(p["name"], p["port"], p["targetPort"]) for p in prefill["spec"]["ports"]] == [
        ("http", 8000, "http"), ("bootstrap", 8998, "bootstrap")]
    decode = build_headless_service(svc, "decode")
    assert decode["metadata"]["name"] == "llm-decode" and decode["spec"]["clusterIP"] == "None"
    assert [p["name"] for p in decode["spec"]["ports"]] == ["http"]
    assert decode["spec"]["selector"]["baton.dev/role"] == "decode"
    router = build_router_service(svc)
    assert router["metadata"]["name"] == "llm"
    assert router["spec"]["type"] == "ClusterIP"
    assert router["spec"]["selector"]["baton.dev/role"] == "router"
    assert [(p["name"], p["port"]) for p in router["spec"]["ports"]] == [("http", 8000)]
    assert svc.url == "http://llm.ml.svc.cluster.local:8000"
    assert build_ingress(svc) is None


def test_ingress_with_tls() -> None:
    svc = service(ingress={"host": "llm.example.com", "className": "nginx",
                           "tls": {"secretName": "llm-tls"}})
    ingress = build_ingress(svc)
    assert ingress is not None
    assert ingress["apiVersion"] == "networking.k8s.io/v1"
    assert ingress["spec"]["ingressClassName"] == "nginx"
    assert ingress["spec"]["tls"] == [{"hosts": ["llm.example.com"], "secretName": "llm-tls"}]
    (rule,) = ingress["spec"]["rules"]
    assert rule["host"] == "llm.example.com"
    assert rule["http"]["paths"] == [{"path": "/", "pathType": "Prefix", "backend": {
        "service": {"name": "llm", "port": {"name": "http"}}}}]
    assert svc.url == "https://llm.example.com"


def test_ingress_without_tls_or_class() -> None:
    svc = service(ingress={"host": "llm.local"})
    ingress = build_ingress(svc)
    assert ingress is not None
    assert "tls" not in ingress["spec"] and "ingressClassName" not in ingress["spec"]
    assert svc.url == "http://llm.local"


# -- autoscaling and disruption budgets -----------------------------------------------------

def test_autoscaling_hands_replicas_to_the_hpa() -> None:
    svc = service(autoscaling={"decode": {"min": 2, "max": 6, "metric": "memory", "target": 70}})
    hpa = build_hpa(svc, "decode", Capabilities())
    assert hpa is not None
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"] == {
        "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment",
                           "name": f"llm-decode-{spec_revision(svc)}"},
        "minReplicas": 2, "maxReplicas": 6,
        "metrics": [{"type": "Resource", "resource": {
            "name": "memory", "target": {"type": "Utilization", "averageUtilization": 70}}}]}
    assert "replicas" not in build_deployment(svc, "decode")["spec"]
    assert build_deployment(svc, "prefill")["spec"]["replicas"] == 1
    assert build_hpa(svc, "prefill", Capabilities()) is None


def test_disruption_budgets_only_for_pools_that_can_have_two_pods() -> None:
    svc = service(prefill={"replicas": 2}, autoscaling={"decode": {"min": 1, "max": 3}})
    prefill = build_pdb(svc, "prefill")
    assert prefill is not None and prefill["apiVersion"] == "policy/v1"
    assert prefill["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": {
        "app.kubernetes.io/name": "baton", "app.kubernetes.io/instance": "llm",
        "baton.dev/role": "prefill"}}}
    assert build_pdb(svc, "decode") is not None
    assert build_pdb(svc, "router") is None


# -- schema validity -----------------------------------------------------------------------

@pytest.mark.parametrize("spec", [
    {},
    {"model": {"uri": "hf://org/name", "tokenSecretRef": {"name": "tok", "key": "k"}},
     "ingress": {"host": "a.example.com", "className": "nginx", "tls": {"secretName": "t"}},
     "autoscaling": {"prefill": {"min": 1, "max": 3}, "decode": {"min": 2, "max": 5}},
     "prefill": {"template": {"spec": {"containers": [{"name": "main", "resources": {
         "limits": {"nvidia.com/gpu": 1}}}]}}}},
    {"model": {"uri": "pvc://claim/dir"}, "decode": {"replicas": 4}},
    {"model": {"uri": "file:///srv/m"}, "router": {"replicas": 3}},
    {"kvTransfer": {"backend": "tcp"}, "router": {"auth": {"apiKeySecretRef": {"name": "k"}}},
     "networkPolicy": {"routerFrom": [{"namespaceSelector": {"matchLabels": {"a": "b"}},
                                       "podSelector": {"matchExpressions": [
                                           {"key": "c", "operator": "Exists"}]}}],
                       "metricsFrom": [{"ipBlock": {"cidr": "10.0.0.0/8",
                                                    "except": ["10.1.0.0/16"]}}]}},
], ids=["defaults", "hf-ingress-autoscaling", "pvc", "file", "tcp-auth-fenced"])
@pytest.mark.parametrize("caps", [Capabilities(), Capabilities(custom_metrics=True)],
                         ids=["bare-cluster", "custom-metrics"])
def test_children_validate_against_kubernetes_schemas(spec: dict[str, Any],
                                                      caps: Capabilities) -> None:
    svc = service(**spec)
    probes = [build_probe_deployment(svc, role) for role in ("prefill", "decode")]  # the gate's
    for child in [*build_children(svc, caps), *probes]:
        kubernetes_validate.validate(child, "1.30", strict=True)


# -- GPU pools -----------------------------------------------------------------------------

GPU_SPEC = {"kvTransfer": {"backend": "nixl"},
            "prefill": {"gpu": {"product": "NVIDIA-H100-80GB-HBM3", "runtimeClassName": "nvidia",
                                "memFractionStatic": 0.8, "rdmaResource": "rdma/hca"},
                        "resources": {"limits": {"memory": "32Gi"}}},
            "decode": {"resources": {"limits": {"nvidia.com/gpu": 1}},
                       "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}]}}


def test_a_gpu_pool_asks_for_a_gpu_node_and_runs_on_cuda() -> None:
    from runtime.server.args import build_parser

    svc = service(**GPU_SPEC)
    prefill = build_deployment(svc, "prefill")
    pod, main = prefill["spec"]["template"]["spec"], main_container(prefill)
    assert command(prefill)[-6:] == ["--device", "cuda", "--mem-fraction-static", "0.8",
                                     "--attention-backend", "auto"]
    parsed = build_parser().parse_args(command(prefill)[2:])
    assert (parsed.device, parsed.mem_fraction_static, parsed.attention_backend) == (
        "cuda", 0.8, "auto")
    assert main["resources"]["limits"] == {"memory": "32Gi", "nvidia.com/gpu": 1, "rdma/hca": 1}
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists",
                                   "effect": "NoSchedule"}]
    assert pod["runtimeClassName"] == "nvidia"
    assert by_name(pod["volumes"])["dshm"]["emptyDir"]["sizeLimit"] == "8Gi"
    env = {e["name"]: e.get("value") for e in main["env"]}
    assert env["UCX_TLS"] == "rc,cuda_ipc,cuda_copy,tcp"
    assert env["UCX_TCP_PORT_RANGE"] == "20000-20015"


def test_a_gpu_limit_in_resources_makes_a_gpu_pool_too() -> None:
    svc = service(**GPU_SPEC)
    decode = build_deployment(svc, "decode")
    pod, main = decode["spec"]["template"]["spec"], main_container(decode)
    assert "--device" in command(decode) and "0.85" in command(decode)
    assert main["resources"]["limits"] == {"nvidia.com/gpu": 1}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists"}]  # theirs
    assert "nodeSelector" not in pod and "runtimeClassName" not in pod
    assert {e["name"]: e.get("value") for e in main["env"]}["UCX_TLS"] == "cuda_ipc,cuda_copy,tcp"
    assert svc.decode.gpu is not None and svc.decode.shared_memory_size == "8Gi"


def test_the_router_and_cpu_pools_never_ask_for_a_gpu() -> None:
    svc = service(**GPU_SPEC)
    router = build_deployment(svc, "router")["spec"]["template"]["spec"]
    assert "nvidia.com/gpu" not in str(router) and "tolerations" not in router
    cpu = build_deployment(service(), "prefill")
    assert "--device" not in command(cpu)
    assert "UCX_TLS" not in {e["name"] for e in main_container(cpu)["env"]}
    assert by_name(cpu["spec"]["template"]["spec"]["volumes"])["dshm"]["emptyDir"][
        "sizeLimit"] == "1Gi"
    explicit = service(prefill={"gpu": {}, "sharedMemorySize": "2Gi"})
    assert explicit.prefill.shared_memory_size == "2Gi"


def test_gpu_pools_validate_against_kubernetes_schemas() -> None:
    for child in build_children(service(**GPU_SPEC)):
        kubernetes_validate.validate(child, "1.30", strict=True)


def test_gpu_pools_run_the_cuda_image_unless_the_spec_names_one() -> None:
    from baton_operator.spec import Images

    images = Images(cpu="reg/baton:1", cuda="reg/baton:1-cuda")
    body = {"metadata": {"name": "llm", "namespace": "ml", "uid": UID},
            "spec": {"model": {"uri": "hf://org/name"}, "prefill": {"gpu": {}}}}
    svc = parse_service(body, images)

    def images_of(role: str) -> set[str]:
        pod = build_deployment(svc, role)["spec"]["template"]["spec"]  # type: ignore[arg-type]
        return {c["image"] for c in [*pod["containers"], *pod.get("initContainers", [])]}

    assert images_of("prefill") == {"reg/baton:1-cuda"}  # the model pull too
    assert images_of("decode") == images_of("router") == {"reg/baton:1"}
    named = parse_service({**body, "spec": {**body["spec"], "image": "mine:2"}}, images)
    assert {named.image_for(role) for role in ("prefill", "decode", "router")} == {"mine:2"}
    assert service(prefill={"gpu": {}}).image_for("prefill") == "baton:0.1.0-cuda"  # defaults
