"""The scheduler's PD seams with fake runners: a prefill scheduler hands `hand_off` requests over
with their first token (`handoffs.take_handed_off`), their KV is copied page for page into a
second pool, and a decode scheduler takes them through `handoffs.process_prebuilt`. The fake
runner's token hashes the whole cached sequence read back through the req->token table, so KV in
the wrong place changes every later token."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from runtime.config import SchedulerConfig
from runtime.sampling_params import SamplingParams
from runtime.scheduler.req import Req
from runtime.scheduler.scheduler import Scheduler
from tests.scheduler.fake_runner import FakeRunner, expected_outputs
from tests.scheduler.test_scheduler import make_req


class CopyHandoff:
    """Plays the prefill role and the KV transfer: takes what the prefill scheduler handed over
    and copies its pages into the decode pool, from outside the decode's forward thread, so it
    must respect the decode scheduler's KV fence."""

    def __init__(self, prefill: Scheduler, src: FakeRunner, dst: FakeRunner,
                 decode: Scheduler) -> None:
        self.prefill, self.src, self.dst, self.decode = prefill, src, dst, decode
        self.allocated: list[tuple[Req, Req, int]] = []  # pages taken, waiting for the fence
        self.delivered: dict[str, Req] = {}

    def pump(self) -> None:
        for req in self.prefill.handoffs.take_handed_off():
            assert len(req.output_ids) == 1  # handed over with its first token: KV complete
            sp = SamplingParams(max_new_tokens=req.extra_max_new, temperature=0.0)  # type: ignore[attr-defined]
            twin = Req(req.rid, list(req.origin_input_ids), sp)
            self.dst.kv.grow(twin, len(twin.origin_input_ids))
            self.allocated.append((req, twin, self.decode.handoffs.kv_fence()))
        for item in [a for a in self.allocated if self.decode.handoffs.fence_passed(a[2])]:
            self.allocated.remove(item)
            self.copy(*item[:2])

    def copy(self, req: Req, twin: Req) -> None:
        n = len(twin.origin_input_ids)
        assert twin.kv.row is not None and req.kv.row is not None
        dst_slots = self.dst.kv.req_to_token.table[twin.kv.row, :n]
        src_slots = self.src.kv.req_to_token.table[req.kv.row, :n]
        self.dst.slot_tokens[dst_slots] = self.src.slot_tokens[src_slots]
        twin.append_token(req.output_ids[0])
        self.src.kv.release(req)
        self.decode.handoffs.process_prebuilt([twin])
        self.delivered[twin.rid] = twin


@dataclass
class Pair:
    """A prefill scheduler, a decode scheduler and the hand-off between them, on fake runners."""

    prefill: Scheduler
    decode: Scheduler
    p_runner: FakeRunner
    d_runner: FakeRunner
    handoff: CopyHandoff
    reqs: list[Req]


def run_pd(n: int, overlap: bool) -> Pair:
    """n requests (prompts of 3, 10, 17, ... tokens: chunked; request i makes 5 + i tokens)
    through prefill -> hand-off -> decode until nothing is left."""
    p_runner, d_runner = FakeRunner(num_pages=64), FakeRunner(num_pages=48, page_size=4)
    cfg = SchedulerConfig(enable_overlap=overlap, chunked_prefill_size=16)
    decode = Scheduler(cfg, d_runner)
    prefill = Scheduler(cfg, p_runner)
    handoff = CopyHandoff(prefill, p_runner, d_runner, decode)
    reqs = [make_req(f"r{i}", 3 + 7 * i, 1, seed=i) for i in range(n)]
    for i, r in enumerate(reqs):
        r.extra_max_new = 5 + i  # type: ignore[attr-defined]
        r.hand_off_after_prompt()
        prefill.add_request(r)
    for _ in range(500):
        if not (prefill.has_work() or handoff.allocated or decode.has_work()):
            break
        if prefill.has_work():
            assert prefill.step() == []  # prefill emits nothing itself: the handoff owns them
        handoff.pump()
        if decode.has_work():
            decode.step()
    return Pair(prefill, decode, p_runner, d_runner, handoff, reqs)


@pytest.mark.parametrize("overlap", [True, False])
def test_prefill_handoff_then_prebuilt_decode_gives_colocated_tokens(overlap: bool) -> None:
    pair = run_pd(6, overlap)  # prompts 3..38: chunked
    prefill, decode, handoff, reqs = pair.prefill, pair.decode, pair.handoff, pair.reqs
    p_runner, d_runner = pair.p_runner, pair.d_runner
    assert set(handoff.delivered) == {r.rid for r in reqs}
    for r in reqs:
        got = handoff.delivered[r.rid]
        assert got.output_ids == expected_outputs(r.origin_input_ids, 5 + int(r.rid[1:]))
        assert got.finished_reason is not None and got.finished_reason.kind == "length"
    assert prefill.decode.running.is_empty(), "a prefill-role request joined the decode batch"
    assert p_runner.kv.is_all_free() and d_runner.kv.is_all_free()
    assert all(b.mode == "extend" for b in p_runner.batches)
    prefill.shutdown()
    decode.shutdown()


def test_prebuilt_request_finished_by_its_first_token_frees_kv_at_once() -> None:
    runner = FakeRunner()
    decode = Scheduler(SchedulerConfig(enable_overlap=False), runner)
    req = Req("one", [1, 2, 3], SamplingParams(max_new_tokens=1, temperature=0.0))
    runner.kv.grow(req, 3)
    req.append_token(42)
    assert decode.handoffs.process_prebuilt([req]) == [req]
    assert req.finished and runner.kv.is_all_free() and not decode.has_work()


def test_prebuilt_joins_a_running_batch_with_placeholders() -> None:
    """Overlap: the running batch's input_ids are -future placeholders while a forward is in
    flight; a prebuilt request's real first token is appended and survives resolve_future."""
    runner = FakeRunner()
    decode = Scheduler(SchedulerConfig(enable_overlap=True), runner)
    first = make_req("first", 4, 12)
    decode.add_request(first)
    for _ in range(3):
        decode.step()
    assert decode.decode.running.input_ids is not None and bool((decode.decode.running.input_ids < 0).all())
    late = Req("late", [5, 6, 7, 8, 9], SamplingParams(max_new_tokens=6, temperature=0.0))
    runner.kv.grow(late, 5)
    runner.slot_tokens[runner.kv.req_to_token.table[late.kv.row, :5]] = torch.tensor(
        late.origin_input_ids
    )
    late.append_token(expected_outputs(late.origin_input_ids, 1)[0])
    decode.handoffs.process_prebuilt([late])
    while decode.has_work():
        decode.step()
    assert late.output_ids == expected_outputs(late.origin_input_ids, 6)
    assert first.output_ids == expected_outputs(first.origin_input_ids, 12)
    assert runner.kv.is_all_free()
    decode.shutdown()
