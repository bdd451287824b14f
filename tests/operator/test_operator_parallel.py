"""`spec.<pool>.tensorParallelSize`: a TP=2 GPU pool as rendered (GPUs, `--tp`, /dev/shm, a KV
port per decode rank in the pod and its NetworkPolicy), the defaults, the canary's byte
checksums let through, and the operator's split rule held to the runtime's. The refusals, each
naming its field, are in test_operator_spec_status.py."""

from __future__ import annotations

import json
from typing import Any

import kubernetes_validate
import pytest
from baton_operator.builders import build_children, build_deployment
from baton_operator.builders.common import UCX_PORT_RANGE
from baton_operator.parallel import BUILTIN_SHAPES, NIXL_MAX_TP, split_problem
from baton_operator.spec import InferenceService, parse_service

TP2 = {"model": {"uri": "hf://org/name"}, "kvTransfer": {"backend": "tcp"},
       "prefill": {"gpu": {"count": 2}},                                 # tp from gpu.count
       "decode": {"tensorParallelSize": 2, "gpu": {"count": 2}}}


def service(**spec: Any) -> InferenceService:
    spec.setdefault("model", {"uri": "builtin:smollm2-135m"})
    return parse_service({"metadata": {"name": "llm", "namespace": "ml", "uid": "u"},
                          "spec": spec})


def pod(svc: InferenceService, role: str) -> dict[str, Any]:
    return build_deployment(svc, role)["spec"]["template"]["spec"]  # type: ignore[arg-type]


def test_a_tp2_gpu_pool_asks_for_two_gpus_and_runs_two_ranks() -> None:
    from runtime.server.args import build_parser

    svc = service(**TP2)
    for role in ("prefill", "decode"):
        spec = pod(svc, role)
        main = spec["containers"][0]
        argv = main["args"][1:]  # after `serve`
        assert argv[argv.index("--tp") + 1] == "2"
        parsed = build_parser().parse_args(argv)
        assert (parsed.tp, parsed.kv_transfer, parsed.device) == (2, "tcp", "cuda")
        assert main["resources"] == {"limits": {"nvidia.com/gpu": 2}}
        dshm = {v["name"]: v for v in spec["volumes"]}["dshm"]["emptyDir"]
        assert dshm == {"medium": "Memory", "sizeLimit": "9Gi"}  # 8Gi + 1Gi for rank 1
        assert {"name": "dshm", "mountPath": "/dev/shm"} in main["volumeMounts"]
    ports = {p["name"]: p["containerPort"] for p in pod(svc, "decode")["containers"][0]["ports"]}
    assert ports == {"http": 8000, "bootstrap": 8998, "kv": 8999, "kv-1": 9000}
    assert parsed.kv_port == 8999  # rank r listens on --kv-port + r
    for child in build_children(svc):
        kubernetes_validate.validate(child, "1.30", strict=True)


def test_the_decode_policy_admits_every_rank_s_kv_port() -> None:
    policies = {c["metadata"]["name"]: c["spec"]["ingress"] for c in build_children(service(**TP2))
                if c["kind"] == "NetworkPolicy"}
    kv = {"protocol": "TCP", "port": 8999, "endPort": 9000}
    prefills = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "baton",
                                                "app.kubernetes.io/instance": "llm",
                                                "baton.dev/role": "prefill"}}}
    assert {"from": [prefills], "ports": [kv]} in policies["llm-decode"]
    assert kv not in [p for rule in policies["llm-prefill"] for p in rule["ports"]]
    # a prefill's ranks only write: its policy is the one of a tp=1 prefill
    one = service(**{**TP2, "prefill": {"gpu": {"count": 1}}})
    prefill = next(c for c in build_children(one)
                   if c["kind"] == "NetworkPolicy" and c["metadata"]["name"] == "llm-prefill")
    assert prefill["spec"]["ingress"] == policies["llm-prefill"]


def test_tp_defaults_to_the_gpu_count_else_one_and_sizes_shm() -> None:
    svc = service()
    assert (svc.prefill.tensor_parallel_size, svc.decode.tensor_parallel_size) == (1, 1)
    assert "--tp" not in pod(svc, "decode")["containers"][0]["args"]  # tp 1: pods unchanged
    limit = service(kvTransfer={"backend": "tcp"}, model={"uri": "hf://o/n"},
                    decode={"resources": {"limits": {"nvidia.com/gpu": "4"}}})
    assert (limit.decode.tensor_parallel_size, limit.decode.shared_memory_size) == (4, "11Gi")
    cpu = service(kvTransfer={"backend": "tcp"}, prefill={"tensorParallelSize": 3})
    assert (cpu.prefill.tensor_parallel_size, cpu.prefill.shared_memory_size) == (3, "3Gi")
    assert pod(cpu, "prefill")["containers"][0].get("resources") is None  # no GPU asked for
    mine = service(kvTransfer={"backend": "tcp"}, prefill={"tensorParallelSize": 3,
                                                            "sharedMemorySize": "512Mi"})
    assert mine.prefill.shared_memory_size == "512Mi"


def test_a_tp_pool_moves_kv_over_nixl_too() -> None:
    """nixl is the default backend and a TP pool takes it: each rank's agent listens in the
    pod's UCX port range (two ports each), which holds NIXL_MAX_TP of them."""
    svc = service(model={"uri": "hf://o/n"}, prefill={"gpu": {"count": 2}},
                  decode={"tensorParallelSize": 3})
    for role, tp in (("prefill", "2"), ("decode", "3")):
        main = pod(svc, role)["containers"][0]
        argv = main["args"][1:]
        assert (argv[argv.index("--tp") + 1], argv[argv.index("--kv-transfer") + 1]) == (tp, "nixl")
        assert {"name": "UCX_TCP_PORT_RANGE", "value": "20000-20015"} in main["env"]
    assert UCX_PORT_RANGE[1] - UCX_PORT_RANGE[0] + 1 == 2 * NIXL_MAX_TP
    assert service(model={"uri": "hf://o/n"},
                   decode={"tensorParallelSize": NIXL_MAX_TP}).decode.tensor_parallel_size == 8
    for child in build_children(svc):
        kubernetes_validate.validate(child, "1.30", strict=True)


def test_a_tp_pool_keeps_the_canary_s_byte_checksums_in_its_args() -> None:
    """The byte checksums cover every rank's KV heads (runtime/canary/ranks.py): a TP pool
    may ask for them, and its pods run with them."""
    svc = service(kvTransfer={"backend": "tcp"},
                  decode={"tensorParallelSize": 3,
                          "args": ["--kv-canary", "raise", "--kv-canary-bytes", "partial"]})
    argv = pod(svc, "decode")["containers"][0]["args"]
    assert argv[argv.index("--tp") + 1] == "3"
    assert argv[argv.index("--kv-canary-bytes") + 1] == "partial"


@pytest.mark.parametrize("name", sorted(BUILTIN_SHAPES))
def test_the_split_rule_is_the_runtime_s(name: str) -> None:
    """The operator reads no checkpoint: its builtin shapes and its rule must say what the
    runtime's `TensorParallel.check` says, for every size a pod may have."""
    from runtime.model_config import ModelConfig
    from runtime.model_store import is_prepared, prepared_dir
    from runtime.models.parallel import TensorParallel, TPConfigError

    shape = BUILTIN_SHAPES[name]
    folder = prepared_dir(name)
    if is_prepared(folder):
        config = json.loads((folder / "config.json").read_text())
        assert (shape.heads, shape.kv_heads, shape.intermediate_size, shape.architecture) == (
            config["num_attention_heads"], config["num_key_value_heads"],
            config["intermediate_size"], config["architectures"][0])
    model = ModelConfig(
        architecture=shape.architecture, num_heads=shape.heads, num_kv_heads=shape.kv_heads,
        intermediate_size=shape.intermediate_size, vocab_size=32, hidden_size=shape.heads * 64,
        num_layers=1, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e4, rope_scaling=None,
        max_position_embeddings=64, tie_word_embeddings=True, attention_bias=False,
        eos_token_ids=(0,), bos_token_id=None)
    for tp in range(1, 17):
        try:
            TensorParallel(0, tp).check(model)
            runtime_says = None
        except TPConfigError as refusal:
            runtime_says = str(refusal).removeprefix(f"--tp {tp} does not divide ")
        assert split_problem(shape, tp) == runtime_says, tp
