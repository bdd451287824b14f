"""A pool whose worker refuses its model (exit code 2, the reason in the container's termination
message) is a status condition and a held pool, not a crash loop; a spec change brings it back.
kopf for real against the emulated API; the pods are written as kubelet reports them."""

from __future__ import annotations

import copy
import time
from typing import Any

import pytest
from baton_operator.builders.pods import CONTAINER
from baton_operator.refusal import NOT_SERVABLE, REASON, refused_message

from tests.kube.isvc_helpers import MERGE, Cluster, OperatorFactory, deployment_of, isvc, wait_for
from tests.kube.kubectl_tool import run_kubectl, table_cells

pytestmark = pytest.mark.timeout(90)
REFUSAL = ("unsupported architecture 'DeepseekV3ForCausalLM': baton runs Gemma3ForCausalLM, "
           "LlamaForCausalLM, MistralForCausalLM, MixtralForCausalLM, Qwen2ForCausalLM, "
           "Qwen3ForCausalLM, Qwen3MoeForCausalLM")


def terminated(code: int, message: str = "") -> dict[str, Any]:
    return {"terminated": {"exitCode": code, "reason": "Error", "message": message}}


def pod_status(last: dict[str, Any], ready: bool = False) -> dict[str, Any]:
    """A container in CrashLoopBackOff after `last` (kubelet's `lastState`), or running."""
    state = ({"running": {}} if ready else
             {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 10s"}})
    return {"phase": "Running", "containerStatuses": [
        {"name": CONTAINER, "ready": ready, "restartCount": 3, "image": "baton:0.1.0",
         "imageID": "", "state": state, "lastState": last}]}


def add_pod(cluster: Cluster, name: str, deployment: str, status: dict[str, Any],
            template: dict[str, Any] | None = None) -> dict[str, Any]:
    """A pod of `deployment`'s current template (or of `template`), as the ReplicaSet makes
    it, with `status` as kubelet reports it."""
    if template is None:
        dep = cluster.child("Deployment", deployment)
        assert dep is not None
        template = dep["spec"]["template"]
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "labels": dict(template["metadata"]["labels"])},
           "spec": copy.deepcopy(template["spec"])}
    cluster.core.create_namespaced_pod(cluster.namespace, pod)
    cluster.core.patch_namespaced_pod_status(name, cluster.namespace, {"status": status},
                                             _content_type=MERGE)
    return template


def refusal_events(cluster: Cluster) -> list[dict[str, Any]]:
    return [e for e in cluster.events() if e.get("reason") == REASON]


def touch(cluster: Cluster, name: str, value: str) -> None:
    """An update cause with no spec change: one more pass."""
    cluster.patch(name, {"metadata": {"annotations": {"touched": value}}})
    wait_for(lambda: value in ((cluster.get(name) or {})["metadata"]["annotations"].get(
        "baton.dev/last-handled-configuration", "")), 20, "the pass")


def test_a_refused_model_is_a_condition_and_a_held_pool_until_the_spec_changes(
        cluster: Cluster, operator: OperatorFactory) -> None:
    with operator():
        cluster.create(isvc("llm"))
        wait_for(lambda: cluster.pool("llm", "prefill"), 20, "the prefill pool")
        old = add_pod(cluster, "llm-prefill-a", cluster.pool_name("llm", "prefill"),
                      pod_status(terminated(2, REFUSAL)))

        # the condition, on the service and on the pool, with the worker's own words
        ready = wait_for(lambda: cluster.condition("llm", "Ready").get("reason") == REASON
                         and cluster.condition("llm", "Ready"), 20, "Ready=False/ModelNotServable")
        assert ready["status"] == "False"
        assert ready["message"] == f"prefill: {REFUSAL} (held at 0 replicas until the spec changes)"
        prefill = cluster.condition("llm", "PrefillReady")
        assert (prefill["status"], prefill["reason"], prefill["message"]) == (
            "False", REASON, ready["message"])
        assert cluster.condition("llm", "DecodeReady")["reason"] != REASON
        assert (cluster.get("llm") or {})["status"]["phase"] == "Failed"
        # the crash loop stops: the pool is held at 0, the refusal noted on its Deployment
        held = wait_for(lambda: (d := cluster.pool("llm", "prefill"))
                        and d["spec"]["replicas"] == 0 and d, 10, "prefill held at 0")
        assert REFUSAL in held["metadata"]["annotations"][NOT_SERVABLE]
        assert cluster.pool("llm", "decode")["spec"]["replicas"] == 1
        # `kubectl get bisvc` says why
        (row,) = table_cells(run_kubectl("get", "bisvc"))
        assert (row["READY"], row["REASON"], row["PHASE"]) == ("False", REASON, "Failed")

        # the pods are gone (scaled to 0): the hold and the condition stay, one Warning in all
        cluster.core.delete_namespaced_pod("llm-prefill-a", cluster.namespace)
        touch(cluster, "llm", "1")
        assert cluster.condition("llm", "Ready") == ready
        assert cluster.pool("llm", "prefill")["spec"]["replicas"] == 0
        wait_for(lambda: refusal_events(cluster), 10, "a ModelNotServable event")
        (event,) = refusal_events(cluster)
        assert (event["type"], event["message"]) == ("Warning", ready["message"])

        # a new model (a new revision, not gated: the old one does not serve): the pool comes
        # back; a refused pod of the old spec says nothing
        body = isvc("llm", model={"uri": "builtin:qwen2-0.5b"})
        cluster.patch("llm", {"spec": body["spec"]})
        prefill, decode = (deployment_of(body, role) for role in ("prefill", "decode"))
        add_pod(cluster, "llm-prefill-b", prefill, pod_status(terminated(2, REFUSAL)),
                template=old)
        wait_for(lambda: (cluster.child("Deployment", prefill) or {}).get("spec", {}).get(
            "replicas") == 1, 20, "prefill back to 1 replica")
        wait_for(lambda: cluster.condition("llm", "Ready").get("reason") == "Updating", 20,
                 "the refusal cleared")
        dep = cluster.child("Deployment", prefill) or {}
        assert NOT_SERVABLE not in (dep["metadata"].get("annotations") or {})
        assert cluster.condition("llm", "PrefillReady")["reason"] == "Updating"

        # a crash of the new spec that is not a refusal (exit 1): pods restart, as ever
        add_pod(cluster, "llm-prefill-c", prefill, pod_status(terminated(1, "OOM")))
        touch(cluster, "llm", "2")
        assert cluster.condition("llm", "Ready").get("reason") == "Updating"
        assert (cluster.child("Deployment", prefill) or {})["spec"]["replicas"] == 1
        # the new spec refused too (the decode pool here): held again, at this generation;
        # with nothing else happening, the pod's own event runs the pass
        time.sleep(1.0)
        add_pod(cluster, "llm-decode-a", decode, pod_status(terminated(2, "quantization "
                                                                         "'awq': no")))
        wait_for(lambda: cluster.condition("llm", "DecodeReady").get("reason") == REASON, 10,
                 "DecodeReady=False/ModelNotServable")
        wait_for(lambda: (cluster.child("Deployment", decode) or {})["spec"]["replicas"] == 0,
                 10, "decode held at 0")
        assert cluster.condition("llm", "Ready")["message"] == (
            "decode: quantization 'awq': no (held at 0 replicas until the spec changes)")
        assert (cluster.child("Deployment", prefill) or {})["spec"]["replicas"] == 1


def test_a_pool_that_still_serves_is_reported_not_scaled(cluster: Cluster,
                                                         operator: OperatorFactory) -> None:
    """An update whose new pods refuse while a pod of the previous spec still serves: the
    refusal is reported, the serving pod is not taken away; an autoscaled pool is left to
    its autoscaler."""
    with operator():
        cluster.create(isvc("llm", autoscaling={"decode": {"min": 1, "max": 2, "metric": "cpu"}}))
        wait_for(lambda: cluster.pool("llm", "decode"), 20, "the pools")
        cluster.set_deployment_status(cluster.pool_name("llm", "prefill"), ready=1, replicas=2,
                                      updatedReplicas=1)
        add_pod(cluster, "llm-prefill-new", cluster.pool_name("llm", "prefill"),
                pod_status(terminated(2, REFUSAL)))
        add_pod(cluster, "llm-decode-new", cluster.pool_name("llm", "decode"),
                pod_status(terminated(2, REFUSAL)))
        wait_for(lambda: cluster.condition("llm", "PrefillReady").get("reason") == REASON
                 and cluster.condition("llm", "DecodeReady").get("reason") == REASON, 20,
                 "both pools ModelNotServable")
        message = cluster.condition("llm", "Ready")["message"]
        assert message == (f"prefill: {REFUSAL} (its pods keep restarting); "
                           f"decode: {REFUSAL} (its pods keep restarting)")
        time.sleep(1.0)
        for role in ("prefill", "decode"):
            dep = cluster.pool("llm", role)
            assert dep["spec"].get("replicas") != 0 and NOT_SERVABLE not in (
                dep["metadata"].get("annotations") or {}), role  # (the HPA owns decode's)


def test_only_a_refusal_of_the_pods_current_command_counts() -> None:
    container = {"name": CONTAINER, "image": "baton:0.1.0", "args": ["serve", "--model", "m"],
                 "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {
                     "fieldPath": "status.podIP"}}}]}
    ran = copy.deepcopy(container)  # as the API server stores it: defaults added
    ran["env"][0]["valueFrom"]["fieldRef"]["apiVersion"] = "v1"
    ran["terminationMessagePath"] = "/dev/termination-log"

    def pod(spec: dict[str, Any], status: dict[str, Any]) -> dict[str, Any]:
        return {"spec": {"containers": [spec]}, "status": status}

    assert refused_message(pod(ran, pod_status(terminated(2, REFUSAL))), container) == REFUSAL
    now = {"containerStatuses": [{"name": CONTAINER, "state": terminated(2, f" {REFUSAL}\n")}]}
    assert refused_message(pod(ran, now), container) == REFUSAL
    assert refused_message(pod(ran, pod_status(terminated(1, REFUSAL))), container) is None
    assert refused_message(pod(ran, pod_status({})), container) is None
    silent = refused_message(pod(ran, pod_status(terminated(2))), container)
    assert silent is not None and "exited with code 2" in silent
    older = {**ran, "args": ["serve", "--model", "other"]}
    assert refused_message(pod(older, pod_status(terminated(2, REFUSAL))), container) is None
    tail = refused_message(pod(ran, pod_status(terminated(2, "x" * 5000 + "why"))), container)
    assert tail is not None and tail.endswith("why") and len(tail) < 1100


def test_the_gate_waits_for_a_router_and_fails_on_a_probe_pod_that_refuses(
        cluster: Cluster, operator: OperatorFactory) -> None:
    """A new revision while the old one serves (kopf, emulated API: no pod runs, the pods are
    written as kubelet reports them): the probe pair is made from the new templates; with both
    probe pods ready but no router pod, the gate is pending and says so; a probe pod that
    refuses the revision (exit code 2) fails the gate with its words, the old revision keeps
    its Deployments, and the probe Deployments go."""
    with operator():
        cluster.create(isvc("llm"))
        old = {role: cluster.pool_name("llm", role) for role in ("prefill", "decode")}
        for role in ("prefill", "decode", "router"):
            cluster.set_deployment_status(cluster.pool_name("llm", role))
        wait_for(lambda: cluster.condition("llm", "Ready").get("status") == "True", 20, "Ready")
        cluster.patch("llm", {"spec": {"model": {"uri": "builtin:qwen2-0.5b"}}})
        probes = {role: wait_for(lambda r=role: cluster.child("Deployment", f"llm-{r}-probe"),  # type: ignore[misc]
                                 20, f"the {role} probe") for role in ("prefill", "decode")}
        for role, probe in probes.items():
            template = probe["spec"]["template"]
            assert template["metadata"]["labels"]["app.kubernetes.io/name"] == "baton-probe"
            assert "token_oracle" in template["spec"]["containers"][0]["args"]
            running = {"phase": "Running", "podIP": f"10.0.0.{len(role)}", "conditions": [
                {"type": "Ready", "status": "True"}]}
            add_pod(cluster, f"llm-{role}-probe-a", "", running, template=template)
            cluster.set_deployment_status(f"llm-{role}-probe")  # as the controller would
        state = wait_for(lambda: (r := (cluster.get("llm") or {})["status"].get("rollout", {}))
                         .get("message", "").startswith("no router pod") and r, 20,
                         "the gate waiting for a router")
        assert (state["phase"], state["gate"]) == ("Probing", "pending"), state
        progressing = cluster.condition("llm", "Progressing")
        assert (progressing["status"], progressing["reason"]) == ("True", "Probing")

        add_pod(cluster, "llm-decode-probe-b", "", pod_status(terminated(2, REFUSAL)),
                template=probes["decode"]["spec"]["template"])
        failed = wait_for(lambda: cluster.condition("llm", "Progressing").get("reason")
                          == "ProbeFailed" and cluster.condition("llm", "Progressing"), 20,
                          "Progressing=False/ProbeFailed")
        assert failed["status"] == "False"
        assert "the decode probe pod refuses revision" in failed["message"]
        assert REFUSAL in failed["message"]
        wait_for(lambda: not cluster.child("Deployment", "llm-decode-probe")
                 and not cluster.child("Deployment", "llm-prefill-probe"), 20, "probes gone")
        deployments = {name for kind, name in cluster.children() if kind == "Deployment"}
        assert deployments == {*old.values(), "llm-router"}  # the new revision never started
        cluster.set_deployment_status("llm-router")  # (its tokenizer changed with the model)
        wait_for(lambda: cluster.condition("llm", "Ready").get("status") == "True", 20,
                 "Ready: the old revision serves")
        wait_for(lambda: any(e["reason"] == "ProbeFailed" and e["type"] == "Warning"
                             for e in cluster.events()), 10, "a ProbeFailed Warning")
