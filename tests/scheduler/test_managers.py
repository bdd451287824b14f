"""The Scheduler's managers on their own, with a real KV manager and no forwards: the decode side
(retraction order, reserve), the PD hand-offs (fence, reserve when alone) and the results."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch

from runtime.figures import ServingFigures
from runtime.forward_batch import ForwardMode, ForwardOutput
from runtime.scheduler.batch import ScheduleBatch
from runtime.scheduler.decode import RATIO_BUMP, DecodeManager
from runtime.scheduler.handoff import Handoffs
from runtime.scheduler.req import Req
from runtime.scheduler.results import ResultProcessor
from runtime.scheduler.runner import ForwardCount, Launched, StopCheck
from tests.scheduler.fake_runner import FakeRunner
from tests.scheduler.test_scheduler import make_req


def decoding(runner: FakeRunner, reqs: list[Req], tokens: int) -> DecodeManager:
    """A DecodeManager whose running batch is `reqs`, each holding KV for `tokens` positions."""
    decode = DecodeManager(runner.kv, 0.5, StopCheck(runner))
    for req in reqs:
        runner.kv.grow(req, tokens)
    decode.running.merge_batch(ScheduleBatch(list(reqs), input_ids=torch.zeros(len(reqs),
                                                                              dtype=torch.int64)))
    return decode


def test_make_room_retracts_the_chunked_request_first_then_the_newest() -> None:
    runner = FakeRunner(num_pages=3, page_size=4)
    a, b, chunked = make_req("a", 4, 8), make_req("b", 4, 8, seed=1), make_req("c", 8, 8, seed=2)
    decode = decoding(runner, [a, b], 4)  # a page each, full: both need a new one
    runner.kv.grow(chunked, 4)  # the last page
    assert runner.kv.available_pages == 0
    victims = decode.make_room(chunked)
    assert victims == [chunked, b], "the chunked one is newest, then the batch's last"
    assert decode.running.reqs == [a] and len(decode.running.input_ids) == 1  # type: ignore[arg-type]
    assert all(v.is_retracted and v.kv.length == 0 and not v.kv.pages for v in victims)
    assert decode.num_retractions == 2 and decode.new_token_ratio == pytest.approx(0.5 + 2 * RATIO_BUMP)


def test_make_room_with_room_retracts_nobody() -> None:
    runner = FakeRunner()
    decode = decoding(runner, [make_req("a", 4, 8)], 4)
    assert decode.make_room(None) == [] and decode.num_retractions == 0


def test_handoffs_fence_and_reserve() -> None:
    runner = FakeRunner(num_pages=8, page_size=4)
    decode = DecodeManager(runner.kv, 1.0, StopCheck(runner))
    forwards, busy = ForwardCount(), [False]
    handoffs = Handoffs(decode, forwards, lambda: busy[0])
    forwards.launched = 3
    fence = handoffs.kv_fence()
    forwards.finished = 2
    assert not handoffs.fence_passed(fence)
    forwards.finished = 3
    assert handoffs.fence_passed(fence)
    big = make_req("big", 24, 64)  # 6 pages of prompt; with its decode reserve, more than 8
    assert handoffs.can_reserve(big), "alone, it only needs to fit"
    busy[0] = True
    assert not handoffs.can_reserve(big), "with other work, its decode reserve counts"
    busy[0] = False
    assert not handoffs.can_reserve(big, [make_req("other", 4, 4)])


def test_handoffs_discard_and_take() -> None:
    runner = FakeRunner()
    handoffs = Handoffs(DecodeManager(runner.kv, 1.0, StopCheck(runner)), ForwardCount(),
                        lambda: False)
    a, b = make_req("a", 4, 4), make_req("b", 4, 4)
    handoffs.add(a)
    handoffs.add(b)
    handoffs.discard(a)
    handoffs.discard(a)  # not there any more: nothing happens
    assert handoffs.take_handed_off() == [b] and handoffs.take_handed_off() == []


def launched(reqs: list[Req], mode: ForwardMode, last: list[bool], tokens: list[int]) -> Launched:
    result: Future[ForwardOutput] = Future()
    result.set_result(ForwardOutput(torch.tensor(tokens, dtype=torch.int64)))
    return Launched(list(reqs), mode, last, result, None, [r.kv.length for r in reqs])


def test_results_hand_off_chunk_and_drop() -> None:
    runner = FakeRunner()
    handoffs = Handoffs(DecodeManager(runner.kv, 1.0, StopCheck(runner)), ForwardCount(),
                        lambda: False)
    results = ResultProcessor(runner.kv, StopCheck(runner), handoffs, None, ServingFigures())
    plain, hand, chunk, gone = (make_req(f"r{i}", 8, 4, seed=i) for i in range(4))
    hand.hand_off_after_prompt()
    for req in (plain, hand, gone):
        runner.kv.grow(req, 8)
    runner.kv.grow(chunk, 4)
    gone.is_retracted = True
    done = launched([plain, hand, chunk, gone], "extend", [True, True, False, True], [5, 6, 7, 8])
    touched = results.process(done, done.result.result())
    assert touched == [plain] and plain.output_ids == [5] and plain.kv.computed == 8
    assert handoffs.take_handed_off() == [hand] and hand.output_ids == [6]
    assert chunk.output_ids == [] and chunk.kv.computed == 4, "a prompt's earlier chunk samples nothing"
    assert gone.output_ids == [] and gone.kv.computed == 0, "a retracted request's result is dropped"


def test_results_finish_frees_kv() -> None:
    runner = FakeRunner()
    handoffs = Handoffs(DecodeManager(runner.kv, 1.0, StopCheck(runner)), ForwardCount(),
                        lambda: False)
    results = ResultProcessor(runner.kv, StopCheck(runner), handoffs, None, ServingFigures())
    req = make_req("one", 4, 1)
    runner.kv.grow(req, 4)
    done = launched([req], "extend", [True], [3])
    assert results.process(done, done.result.result()) == [req]
    assert req.finished_reason is not None and req.finished_reason.kind == "length"
    assert runner.kv.is_all_free()
