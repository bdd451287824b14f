"""Create-or-restore of a child, without an API server: what the live object must hold, the
patch that restores it, and whose objects we refuse to write."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from baton_operator.apply import (
    ATOMIC,
    LAST_APPLIED,
    TEMPLATE,
    NameConflict,
    check_controller,
    covers,
    removal_patch,
    restore_patch,
)
from baton_operator.builders import build_deployment, build_router_service
from baton_operator.policy import PodPolicy, breaks_policy
from baton_operator.spec import parse_service

UID = "uid-1"


def service(**spec: Any) -> Any:
    spec.setdefault("model", {"uri": "builtin:smollm2-135m"})
    return parse_service({"metadata": {"name": "llm", "namespace": "ml", "uid": UID},
                          "spec": spec})


def live_copy(desired: dict[str, Any]) -> dict[str, Any]:
    """`desired` as the API server returns it: defaults and bookkeeping added."""
    live = copy.deepcopy(desired)
    live["metadata"].update(uid="child", resourceVersion="7", generation=3,
                            annotations={"deployment.kubernetes.io/revision": "2"})
    if live["kind"] == "Deployment":
        pod = live["spec"]["template"]["spec"]
        pod.update(dnsPolicy="ClusterFirst", restartPolicy="Always", schedulerName="default")
        for container in pod["containers"]:
            container.update(terminationMessagePath="/dev/termination-log")
            container["readinessProbe"].update(successThreshold=1)
        live["status"] = {"replicas": 1}
    else:
        live["spec"].update(clusterIP="10.0.0.7", sessionAffinity="None")
    return live


def test_server_defaults_and_others_fields_are_no_drift() -> None:
    for desired in (build_deployment(service(), "decode"), build_router_service(service())):
        live = live_copy(desired)
        live["metadata"]["labels"]["team"] = "ml"  # a label someone added: theirs
        live["metadata"]["ownerReferences"].append({"kind": "X", "uid": "other"})
        assert restore_patch(live, desired) == {}


def test_hand_edits_of_our_fields_are_restored() -> None:
    desired = build_deployment(service(decode={"replicas": 2}), "decode")
    live = live_copy(desired)
    live["spec"]["replicas"] = 5
    live["spec"]["template"]["spec"]["containers"][0]["image"] = "evil:1"
    live["spec"]["template"]["spec"]["containers"].append({"name": "miner", "image": "m"})
    patch = restore_patch(live, desired)
    assert patch["spec"]["replicas"] == 2
    assert patch["spec"]["template"]["spec"]["containers"] == desired["spec"]["template"][
        "spec"]["containers"], "a list we render is restored whole"
    assert set(patch["spec"]) == {"replicas", "template"}


def test_selectors_are_atomic() -> None:
    desired = build_router_service(service())
    live = live_copy(desired)
    live["spec"]["selector"]["app"] = "hijack"  # one more key selects no router pod
    assert restore_patch(live, desired) == {"spec": {"selector": {"app": None}}}
    live["spec"]["selector"] = {"app": "hijack"}
    patch = restore_patch(live, desired)["spec"]["selector"]
    assert patch == {"app": None, **desired["spec"]["selector"]}


def test_a_pod_template_made_unsafe_by_hand_is_restored_whole() -> None:
    """A field we never render is someone else's, unless it breaks the pod policy: then the
    whole template goes back to what we render (the server defaults itself again)."""
    desired = build_deployment(service(), "decode")
    live = live_copy(desired)
    live["spec"]["template"]["spec"]["priorityClassName"] = "high"
    assert restore_patch(live, desired) == {} and not breaks_policy(live, PodPolicy())
    live["spec"]["template"]["spec"]["hostNetwork"] = True
    assert restore_patch(live, desired) == {}, "merely someone else's field..."
    assert breaks_policy(live, PodPolicy()), "...but one the policy refuses"
    patch = restore_patch(live, desired, (*ATOMIC, TEMPLATE))["spec"]["template"]["spec"]
    assert patch["hostNetwork"] is None and patch["priorityClassName"] is None
    assert patch["dnsPolicy"] is None and "containers" in patch


def test_booleans_are_not_numbers() -> None:
    assert covers({"a": 1, "b": [1, {"c": True}]}, {"a": 1, "b": [1, {"c": True}]})
    assert not covers(1, True) and not covers(True, 1) and not covers([1], [1, 2])


def test_fields_we_stopped_rendering_are_removed_but_replicas_are_handed_to_the_hpa() -> None:
    before = build_deployment(service(prefill={"nodeSelector": {"gpu": "a"}}), "prefill")
    after = build_deployment(service(autoscaling={"prefill": {"min": 1, "max": 3, "metric": "cpu"}}), "prefill")
    live = live_copy(before)
    live["spec"]["replicas"] = 3  # the HPA scaled it
    patch = removal_patch(before, after, live)
    assert patch == {"spec": {"template": {"spec": {"nodeSelector": None}}}}
    assert restore_patch(live, after).get("spec", {}).get("replicas") is None


def test_a_map_we_stopped_rendering_loses_only_our_keys() -> None:
    """Our annotation goes; the keys others wrote into the same map (the Deployment
    controller's revision, our own last-applied record) stay."""
    last = {"metadata": {"annotations": {"baton.dev/not-servable": "{}"}, "labels": {"a": "b"}}}
    live = {"metadata": {"annotations": {"baton.dev/not-servable": "{}", LAST_APPLIED: "{}",
                                         "deployment.kubernetes.io/revision": "2"},
                         "labels": {"a": "b"}}}
    assert removal_patch(last, {"metadata": {}}, live) == {
        "metadata": {"annotations": {"baton.dev/not-servable": None}, "labels": None}}


def test_only_objects_we_control_are_ours() -> None:
    desired = build_deployment(service(), "decode")
    ours = live_copy(desired)
    check_controller(ours, desired, UID)
    hand_made = {**ours, "metadata": {**ours["metadata"], "ownerReferences": []}}
    foreign = {**ours, "metadata": {**ours["metadata"], "ownerReferences": [
        {"kind": "Deployment", "name": "other", "uid": "o", "controller": True}]}}
    stale = {**ours, "metadata": {**ours["metadata"], "ownerReferences": [
        {**desired["metadata"]["ownerReferences"][0], "uid": "old"}]}}
    for obj, why in ((hand_made, "has no controller"), (foreign, "controlled by Deployment other"),
                     (stale, "belongs to a deleted InferenceService llm")):
        with pytest.raises(NameConflict, match=why) as err:
            check_controller(obj, desired, UID)
        assert f"Deployment {desired['metadata']['name']} already exists" in str(err.value)
