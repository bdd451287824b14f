"""The chart with GPU values, end to end through the operator's builders: `helm template` with a
CUDA image and a sample whose pools ask for GPUs renders objects that validate, and the
InferenceService it renders becomes pods that validate, ask for a GPU node and run the CUDA image."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest
from baton_operator.builders import build_children
from baton_operator.capabilities import Capabilities
from baton_operator.config import OperatorConfig
from baton_operator.spec import parse_service
from chart_support import Render, only, operator_container, validate_builtin

pytestmark = pytest.mark.timeout(120)  # renders with the Helm engine

GPU_VALUES: dict[str, Any] = {
    "image": {"repository": "reg.example/baton", "tag": "2.0", "cuda": "reg.example/baton:2.0-gpu"},
    "sample": {"enabled": True, "name": "llm", "spec": {
        "model": {"uri": "hf://HuggingFaceTB/SmolLM2-1.7B-Instruct"},
        "kvTransfer": {"backend": "nixl"},
        "prefill": {"replicas": 1, "gpu": {"product": "NVIDIA-H100-80GB-HBM3",
                                           "runtimeClassName": "nvidia",
                                           "rdmaResource": "rdma/hca"}},
        "decode": {"replicas": 2, "resources": {"limits": {"nvidia.com/gpu": 1}}},
        "router": {"replicas": 1},
        "autoscaling": {"prefill": {"min": 1, "max": 4, "metric": "queue"},
                        "decode": {"min": 2, "max": 8, "metric": "kv"}},
    }},
}

CLUSTERS = {"bare": Capabilities(), "custom-metrics": Capabilities(custom_metrics=True),
            "keda": Capabilities(keda=True, pod_monitors=True,
                                 prometheus_url="http://prometheus.monitoring:9090")}


@pytest.mark.parametrize("cluster", list(CLUSTERS))
def test_gpu_values_render_valid_objects_and_valid_gpu_pods(
    render: Render, crd_schema: dict[str, Any], cluster: str
) -> None:
    objs = render(GPU_VALUES, name="demo", namespace="ml")
    for obj in objs:
        if obj["kind"] == "InferenceService":
            jsonschema.validate(obj, crd_schema)
        else:
            validate_builtin(obj)

    # the operator the chart deploys, reading its own env, turns the sample into children
    config = OperatorConfig.from_env(
        {e["name"]: e["value"] for e in operator_container(objs)["env"]})
    isvc = only(objs, "InferenceService")
    svc = parse_service({**isvc, "metadata": {**isvc["metadata"], "uid": "u-1"}}, config.images)
    children = build_children(svc, CLUSTERS[cluster])
    for child in children:
        if child["apiVersion"].split("/")[0] in ("keda.sh", "monitoring.coreos.com"):
            continue  # CRDs kubernetes-validate does not know (their builders have own tests)
        validate_builtin(child)

    pods = {d["metadata"]["labels"]["baton.dev/role"]: d["spec"]["template"]["spec"]
            for d in children if d["kind"] == "Deployment"}
    for role in ("prefill", "decode"):
        main = pods[role]["containers"][0]
        assert main["image"] == "reg.example/baton:2.0-gpu"
        assert main["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert main["args"][main["args"].index("--device") + 1] == "cuda"
        assert any(t["key"] == "nvidia.com/gpu" for t in pods[role]["tolerations"])
    assert pods["prefill"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert pods["prefill"]["containers"][0]["resources"]["limits"]["rdma/hca"] == 1
    router = pods["router"]
    assert router["containers"][0]["image"] == "reg.example/baton:2.0"
    assert "nvidia.com/gpu" not in str(router) and "tolerations" not in router


def test_the_gpu_sample_manifest_is_a_valid_gpu_service(crd_schema: dict[str, Any]) -> None:
    from chart_support import SAMPLE_FILE, load_docs

    (isvc,) = load_docs((SAMPLE_FILE.parent / "inferenceservice-gpu.yaml").read_text())
    jsonschema.validate(isvc, crd_schema)
    svc = parse_service({**isvc, "metadata": {**isvc["metadata"], "uid": "u-1"}})
    for child in build_children(svc, Capabilities(custom_metrics=True)):
        validate_builtin(child)
    assert svc.prefill.gpu is not None and svc.decode.gpu is not None
