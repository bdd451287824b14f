"""Decode graphs: the batch goes into fixed buffers padded to a captured size, and padding rows
write only the scratch page. On the CPU, EagerGraph re-runs the captured function over the same
buffers, so everything but the capture itself is checked here (the GPU run: tests/gpu/)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from runtime.attention.flashinfer_backend import FlashInferAttention
from runtime.attention.registry import _REGISTRY
from runtime.config import EngineConfig, SchedulerConfig
from runtime.engine.cuda_graph import EagerGraph, batch_sizes
from runtime.engine.model_runner import ModelRunner
from runtime.sampling_params import SamplingParams
from runtime.scheduler.req import Req
from runtime.scheduler.scheduler import Scheduler


def test_the_ladder_of_batch_sizes() -> None:
    assert batch_sizes(1) == [1]
    assert batch_sizes(6) == [1, 2, 4, 6]
    assert batch_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert batch_sizes(37) == [1, 2, 4, 8, 16, 24, 32, 37]


def generate(runner: ModelRunner, overlap: bool) -> list[list[int]]:
    """Eleven greedy requests of different lengths: the decode batch shrinks from 11 to 1. The
    first ones (lowest pages and table rows) live longest, so stray padding writes hit them."""
    sched = Scheduler(SchedulerConfig(max_running_requests=16, enable_overlap=overlap), runner)
    reqs = [Req(f"r{i}", list(range(200 + 13 * i, 230 + 17 * i)),
                SamplingParams(max_new_tokens=23 - 2 * i, temperature=0.0, ignore_eos=True))
            for i in range(11)]
    for req in reqs:
        sched.add_request(req)
    for _ in range(500):
        if not sched.has_work():
            break
        sched.step()
    sched.shutdown()
    assert runner.kv.is_all_free()
    return [r.output_ids for r in reqs]


class CountedGraph(EagerGraph):
    replays = 0

    def replay(self) -> None:
        self.replays += 1
        super().replay()


@pytest.fixture(params=["torch", "flashinfer"])
def attention(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """torch attention, or baton's flashinfer backend over a torch stand-in for flashinfer's
    wrappers (tests/attention/flashinfer_standin.py): its page tables and graph planning."""
    if request.param == "flashinfer":
        monkeypatch.setitem(_REGISTRY, "flashinfer", "tests.attention.flashinfer_standin:backend")
    return str(request.param)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_graph_replays_give_the_eager_tokens(tiny_path: Path, overlap: bool, attention: str) -> None:
    config = EngineConfig(model=str(tiny_path), attention_backend=attention, max_total_tokens=2048)
    plain = ModelRunner(config, max_running_requests=16)
    eager = generate(plain, overlap)

    runner = ModelRunner(config, max_running_requests=16)
    runner.graphs = graphs = runner.decode_graphs(8, CountedGraph)
    assert generate(runner, overlap) == eager
    # Every request's KV is what the eager run wrote (same pages: same schedule); padding wrote
    # only the scratch page, the last one.
    scratch = runner.kv.allocator.num_pages
    assert torch.allclose(runner.pool.buffer[:scratch], plain.pool.buffer[:scratch], atol=1e-5)
    assert runner.pool.buffer[scratch].abs().sum() > 0 and plain.pool.buffer[scratch].abs().sum() == 0
    # Batches of 9..11 ran eagerly; 5..8 padded to 8, 3..4 to 4, then 2 and 1.
    replayed = {size: g.replays for size, g in graphs.graphs.items()}  # type: ignore[attr-defined]
    assert set(replayed) == {1, 2, 4, 8} and all(replayed.values()), replayed
    assert graphs.replays == sum(replayed.values())
    if attention == "flashinfer":
        # One decode wrapper per captured size, planned before its capture and every replay.
        attn = runner.attn
        assert isinstance(attn, FlashInferAttention)
        plans = {size: w.plans for size, w in attn.graph_decode.items()}
        assert plans == {size: n + 1 for size, n in replayed.items()}
        torch_tokens = generate(ModelRunner(replace(config, attention_backend="torch"), 16), overlap)
        assert eager == torch_tokens
