"""The step loop on a GPU makes one copy each way per forward and never waits on the device
mid-step: checked on the CPU by running the real Scheduler and ModelRunner on torch's `meta`
device under DeviceAudit (tests/engine/device_audit.py), which records every host tensor that
meets a device tensor, every read of a device value, and every copy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.config import EngineConfig, SchedulerConfig
from runtime.engine.model_runner import ModelRunner
from runtime.sampling_params import SamplingParams
from runtime.scheduler.req import Req
from runtime.scheduler.scheduler import Scheduler
from tests.engine.device_audit import DeviceAudit
from tests.engine.test_cuda_graph import CountedGraph

SAMPLING = {
    "greedy": {},
    "sampled": {"temperature": 0.8, "top_k": 7, "top_p": 0.9, "min_p": 0.05},
    "top-k and plain rows": {"temperature": 0.8, "top_k": 3},  # mixed with greedy rows below
    "penalties": {"repetition_penalty": 1.3, "frequency_penalty": 0.2, "presence_penalty": 0.1},
    "logit_bias": {"logit_bias": ((11, 3.0), (42, -2.0))},
}


def meta_runner(tiny_path: Path, sampler: str = "torch") -> ModelRunner:
    config = EngineConfig(model=str(tiny_path), device="meta", attention_backend="torch",
                          linear_backend="torch", sampler_backend=sampler, max_total_tokens=2048)
    return ModelRunner(config, max_running_requests=16)


def requests(n_new: int = 5) -> list[Req]:
    reqs = []
    for i, params in enumerate([*SAMPLING.values(), {}]):
        sp = SamplingParams(max_new_tokens=n_new, ignore_eos=True, **params)  # type: ignore[arg-type]
        prompt = list(range(100 + i, 140 + 9 * i))  # 40..85 tokens: several prefill chunks
        reqs.append(Req(f"r{i}", prompt, sp, return_logprob=i == 0, top_logprobs_num=3 * (i == 0)))
    return reqs


def audited_run(runner: ModelRunner, overlap: bool, reqs: list[Req]) -> tuple[DeviceAudit, Scheduler]:
    config = SchedulerConfig(max_running_requests=16, chunked_prefill_size=64, enable_overlap=overlap)
    sched = Scheduler(config, runner)
    for req in reqs:
        sched.add_request(req)
    audit = DeviceAudit()
    leave = audit.on_thread(sched.worker) if sched.worker is not None else None
    try:
        with audit:
            for _ in range(200):
                if not sched.has_work():
                    break
                sched.step()
    finally:
        if leave is not None:
            leave()
        sched.shutdown()
    assert not sched.has_work(), "the requests did not finish"
    return audit, sched


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
@pytest.mark.parametrize(("sampler", "graphs"), [("torch", False), ("token_oracle", False),
                                                 ("torch", True)])
def test_one_copy_each_way_per_forward_and_no_wait(
    tiny_path: Path, overlap: bool, sampler: str, graphs: bool
) -> None:
    runner = meta_runner(tiny_path, sampler)
    if graphs:  # decode steps replay through the graph buffers (EagerGraph: the CPU stand-in)
        runner.graphs = runner.decode_graphs(8, CountedGraph)
    reqs = requests()
    audit, sched = audited_run(runner, overlap, reqs)
    assert audit.mixed == [], "host tensors met device tensors:\n" + "\n".join(audit.mixed)
    assert audit.syncs == [], "device values read mid-step:\n" + "\n".join(audit.syncs)
    forwards = sched.forwards.launched
    assert forwards > len(reqs)  # chunked prefill and several decode steps ran
    assert len(audit.h2d) == forwards, audit.h2d
    assert len(audit.d2h) == forwards, audit.d2h
    assert all(len(r.output_ids) == 5 for r in reqs)
    assert runner.kv.is_all_free()
    if graphs:
        assert runner.graphs is not None and runner.graphs.graphs[8].replays >= 4  # type: ignore[attr-defined]


def test_prebuilt_requests_and_their_table_rows_ride_the_next_forward(tiny_path: Path) -> None:
    """Decode role: a request whose prompt KV arrived by transfer has its req->token rows
    written by the next forward, in that forward's one copy."""
    runner = meta_runner(tiny_path)
    sched = Scheduler(SchedulerConfig(max_running_requests=16, enable_overlap=True), runner)
    req = Req("prebuilt", list(range(50, 90)), SamplingParams(max_new_tokens=4, ignore_eos=True,
                                                              repetition_penalty=1.2))
    runner.kv.grow(req, len(req.origin_input_ids))
    req.output_ids.append(7)  # the first token, from the prefill server's aux record
    assert runner.kv.req_to_token.deferred
    sched.handoffs.process_prebuilt([req])
    audit = DeviceAudit()
    leave = audit.on_thread(sched.worker)  # type: ignore[arg-type]
    try:
        with audit:
            while sched.has_work():
                sched.step()
    finally:
        leave()
        sched.shutdown()
    assert audit.mixed == [] and audit.syncs == [], audit.mixed + audit.syncs
    assert len(audit.h2d) == len(audit.d2h) == sched.forwards.launched >= 3
    assert req.finished and len(req.output_ids) == 4


def test_the_audit_catches_each_hazard() -> None:
    """The audit itself: each kind of hazard is recorded, with the line it came from."""
    dev = torch.zeros(4, 3, device="meta")
    with DeviceAudit() as audit:
        _ = dev + torch.ones(3)  # a host tensor in a device op
        _ = dev[torch.tensor([0, 2])]  # a host index
        _ = dev + torch.tensor(1.0)  # a 0-dim host tensor: a scalar, fine
        assert dev.sum().item() == 0  # a read: recorded, and answered with zero
        _ = dev[dev > 0]  # a boolean mask: its size is a read
        dev[torch.tensor([1], device="meta")] = 0.0  # a host value copied in: a wait on CUDA
        dev[1:3] = 0.0  # a slice takes the number as it is: fine
        _ = dev.to("cpu")
        _ = torch.arange(3).to("meta")
    assert [m.split(":")[0] for m in audit.mixed] == ["aten.add.Tensor", "aten.index.Tensor"]
    assert [m.split(":")[0] for m in audit.syncs] == [
        "aten._local_scalar_dense.default", "aten.index.Tensor (boolean mask)",
        "a Python number written through a tensor index"]
    assert len(audit.d2h) == len(audit.h2d) == 1
