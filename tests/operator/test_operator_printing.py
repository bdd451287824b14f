"""`kubectl get bisvc` says why: READY, REASON and PHASE, per-pool counts with the live desired
replicas (an HPA's choice included), ROUTER, and model / KV backend / policy with -o wide;
`kubectl get bisvc -w` shows Pending -> Progressing -> Ready. Real kubectl, kopf for real, the
emulated API printing the CRD's columns as kube-apiserver does."""

from __future__ import annotations

import re
import subprocess
import threading

import pytest

from tests.kube.isvc_helpers import (
    NAMESPACE,
    Cluster,
    OperatorFactory,
    deployment_of,
    isvc,
    wait_for,
)
from tests.kube.kubectl_tool import kubectl, run_kubectl, table_cells

pytestmark = pytest.mark.timeout(90)
PHASES = ("Pending", "Progressing", "Ready", "Degraded", "Failed")


def phase(cluster: Cluster, name: str) -> str:
    return str(((cluster.get(name) or {}).get("status") or {}).get("phase", ""))


def test_watch_shows_the_phases_and_progress_is_normal(cluster: Cluster,
                                                      operator: OperatorFactory) -> None:
    with operator():
        watch = subprocess.Popen([str(kubectl()), "-n", NAMESPACE, "get", "bisvc", "-w"],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines: list[str] = []  # read as they come: a slow kubectl start must not lose a phase
        reader = threading.Thread(target=lambda: lines.extend(watch.stdout or ()), daemon=True)
        reader.start()

        def watched(name: str) -> bool:
            return any(name in line.split() for line in list(lines))

        try:
            cluster.create(isvc("llm"))
            wait_for(lambda: phase(cluster, "llm") == "Pending", 20, "Pending")
            wait_for(lambda: watched("Pending"), 30, lambda: f"the watch to print Pending: {lines}")
            cluster.set_deployment_status(cluster.pool_name("llm", "prefill"))
            wait_for(lambda: watched("Progressing"), 30, lambda: f"Progressing: {lines}")
            for role in ("decode", "router"):
                cluster.set_deployment_status(cluster.pool_name("llm", role))
            wait_for(lambda: watched("Ready"), 30, lambda: f"Ready: {lines}")
        finally:
            watch.terminate()
        watch.wait(timeout=10)
        reader.join(timeout=10)
        output = "".join(lines)
        wait_for(lambda: {"Updating", "Ready"} <= {e["reason"] for e in cluster.events()}, 10,
                 "the Updating and Ready events")
        events = sorted((e["type"], e["reason"]) for e in cluster.events()
                        if e["reason"] in ("Updating", "Ready"))
        assert events == [("Normal", "Ready"), ("Normal", "Updating")]
        assert not [e for e in cluster.events() if e["type"] != "Normal"]
        seen = [tok for line in output.splitlines()[1:] for tok in line.split() if tok in PHASES]
        assert [p for i, p in enumerate(seen) if i == 0 or seen[i - 1] != p] == [
            "Pending", "Progressing", "Ready"], output


def test_get_shows_why_for_ready_invalid_and_conflicting_services(
        cluster: Cluster, operator: OperatorFactory) -> None:
    taken = isvc("taken", router={"policy": "least_load"})
    cluster.apps.create_namespaced_deployment(NAMESPACE, {
        "metadata": {"name": deployment_of(taken, "decode")}, "spec": {
            "selector": {"matchLabels": {"app": "x"}},
            "template": {"metadata": {"labels": {"app": "x"}}, "spec": {"containers": []}}}})
    with operator():
        cluster.create(isvc("smollm2", decode={"replicas": 1, "tensorParallelSize": 3},
                            kvTransfer={"backend": "tcp"},
                            autoscaling={"decode": {"min": 2, "max": 6, "metric": "cpu"}}))
        cluster.create(isvc("invalid", kvTransfer={"backend": "tcp"}, prefill={
            "template": {"spec": {"hostNetwork": True}}}))
        cluster.create(taken)
        wait_for(lambda: all(phase(cluster, n) for n in ("smollm2", "invalid", "taken")), 20,
                 "three statuses")
        run_kubectl("scale", f"deployment/{cluster.pool_name('smollm2', 'decode')}",
                    "--replicas=4")  # as the HPA would
        for role in ("prefill", "decode", "router"):
            cluster.set_deployment_status(cluster.pool_name("smollm2", role))
        wait_for(lambda: phase(cluster, "smollm2") == "Ready", 10, "smollm2 Ready")
        table = run_kubectl("get", "bisvc")
        wide = run_kubectl("get", "bisvc", "-o", "wide")
    print(f"$ kubectl get bisvc\n{table}\n$ kubectl get bisvc -o wide\n{wide}")
    rows = {row["NAME"]: row for row in table_cells(wide)}
    assert {k: rows["smollm2"][k] for k in ("READY", "REASON", "PHASE", "PREFILL",
                                            "PREFILL-DESIRED", "DECODE", "DECODE-DESIRED",
                                            "ROUTER", "URL", "MODEL", "KV", "POLICY",
                                            "PREFILL-TP", "DECODE-TP")} == {
        "READY": "True", "REASON": "AllPoolsReady", "PHASE": "Ready", "PREFILL": "1",
        "PREFILL-DESIRED": "1", "DECODE": "4", "DECODE-DESIRED": "4", "ROUTER": "1",
        "URL": "http://smollm2.serving.svc.cluster.local:8000",
        "MODEL": "builtin:smollm2-135m", "KV": "tcp", "POLICY": "cache_aware",
        "PREFILL-TP": "1", "DECODE-TP": "3"}
    assert (rows["invalid"]["READY"], rows["invalid"]["REASON"], rows["invalid"]["PHASE"],
            rows["invalid"]["KV"]) == ("False", "InvalidSpec", "Failed", "tcp")
    assert (rows["taken"]["READY"], rows["taken"]["REASON"], rows["taken"]["PHASE"],
            rows["taken"]["POLICY"]) == ("False", "NameConflict", "Failed", "least_load")
    # the rollout's columns: a service whose only revision serves is Stable, all pods new
    assert (rows["smollm2"]["ROLLOUT"], rows["smollm2"]["PREFILL-ROLLOUT"],
            rows["smollm2"]["DECODE-ROLLOUT"]) == ("Stable", "1/1 new", "4/4 new")
    assert re.fullmatch(r"[0-9a-f]{12}", rows["smollm2"]["REVISION"]), rows["smollm2"]
    assert [r["NAME"] for r in table_cells(table)] == ["invalid", "smollm2", "taken"]
    assert "MODEL" not in table.splitlines()[0], "priority-1 columns only with -o wide"
