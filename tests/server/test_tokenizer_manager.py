"""TokenizerManager without processes: outputs queued before the reader wakes are coalesced."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from runtime.config import ServerArgs
from runtime.handover import Handover, KVOffer
from runtime.messages import (
    BatchOutput,
    FinishReason,
    GenerateRequest,
    ReqOutput,
    RequestError,
    SchedulerStats,
)
from runtime.sampling_params import InvalidRequest
from runtime.server.generation import Generation, HandedOver, finish, start
from runtime.server.metrics import Metrics
from runtime.server.tokenizer_manager import SHUTTING_DOWN, TokenizerManager


def _tm(tokenizer: Any, tmp_path: Path) -> TokenizerManager:
    tm = TokenizerManager(ServerArgs(), tokenizer, str(tmp_path), Metrics())
    tm.bind()
    tm.unavailable = None
    import zmq

    sink = zmq.Context.instance().socket(zmq.PULL)  # stands in for the scheduler
    sink.connect(tm.to_scheduler)
    tm.test_sink = sink  # type: ignore[attr-defined]  # keep it alive
    time.sleep(0.05)
    return tm


def _out(ids: list[int], total: int, done: bool = False) -> ReqOutput:
    reason = FinishReason("length") if done else None
    return ReqOutput("r", ids, 2, total, finished_reason=reason, customized_info={"m": list(ids)})


async def test_queued_outputs_coalesce_into_one_chunk(tokenizer: Any, tmp_path: Path) -> None:
    tm = _tm(tokenizer, tmp_path)
    ids = tokenizer.encode("Hi 😀 there")
    gen = Generation(tm, GenerateRequest("r", [1, 2], {}, stream=True), 0, timeout=5)
    tm._dispatch(BatchOutput([_out(ids[:1], 1)], SchedulerStats(num_running=1)))
    first = await gen.next()
    assert first.output_ids == ids[:1] and tm.stats.num_running == 1
    for i in range(1, len(ids)):  # a slow reader: three outputs queue up
        tm._dispatch(BatchOutput([_out([ids[i]], i + 1, done=i == len(ids) - 1)]))
    rest = await gen.next()
    assert rest.output_ids == ids[1:] and rest.customized_info == {"m": ids[1:]}
    assert first.text + rest.text == tokenizer.decode(ids)
    assert gen.finished and "r" not in tm.states
    tm.close()


async def test_refusal_raises_invalid_request(tokenizer: Any, tmp_path: Path) -> None:
    tm = _tm(tokenizer, tmp_path)
    task = asyncio.ensure_future(start(tm, [GenerateRequest("r", [1], {})], timeout=5))
    await asyncio.sleep(0)
    tm._dispatch(RequestError("r", "the prompt is too long", "prompt"))
    with pytest.raises(InvalidRequest, match="too long"):
        await task
    tm.close()


async def test_non_streaming_result_is_the_concatenation(tokenizer: Any, tmp_path: Path) -> None:
    tm = _tm(tokenizer, tmp_path)
    ids = tokenizer.encode("你好，世界")  # noqa: RUF001
    task = asyncio.ensure_future(start(tm, [GenerateRequest("r", [1, 2], {})], timeout=5))
    await asyncio.sleep(0)
    tm._dispatch(BatchOutput([_out(ids[:2], 2)]))
    gens, firsts = await task
    tm._dispatch(BatchOutput([_out(ids[2:], len(ids), done=True)]))
    [total] = await finish(gens, firsts)
    assert total.text == tokenizer.decode(ids) and total.output_ids == ids
    assert total.customized_info == {"m": ids} and total.completion_tokens == len(ids)
    tm.close()


async def test_timeout_without_output_aborts(
    tokenizer: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tm = _tm(tokenizer, tmp_path)
    import runtime.server.generation as generation

    monkeypatch.setattr(generation, "ABORT_ACK_TIMEOUT_S", 0.05)
    gen = Generation(tm, GenerateRequest("r", [1], {}), 0, timeout=0.05)
    delta = await gen.next()
    assert delta.finish_reason is not None and delta.finish_reason.kind == "abort"
    assert "timed out" in (delta.finish_reason.message or "") and gen.finished
    tm.close()


async def test_a_moved_request_hands_over_after_its_last_tokens(tokenizer: Any,
                                                                 tmp_path: Path) -> None:
    """A "moved" finish is no finish of the stream: its tokens go out, then HandedOver names
    where the KV waits (the stream's hand-over event, runtime/handover.py)."""
    tm = _tm(tokenizer, tmp_path)
    offer = KVOffer("10.0.0.7", 8999, 42, "decode-0")
    gen = Generation(tm, GenerateRequest("r", [1, 2], {}, stream=True), 0, timeout=5)
    tm._dispatch(BatchOutput([ReqOutput("r", [5, 6], 2, 2, FinishReason("moved", offer=offer))]))
    delta = await gen.next()
    assert delta.output_ids == [5, 6] and delta.finish_reason is None and not gen.finished
    with pytest.raises(HandedOver) as e:
        await gen.next()
    assert e.value.handover == Handover("moved", offer) and gen.finished
    tm.close()


@pytest.mark.parametrize("drained", [True, False])
async def test_only_what_a_drain_aborts_comes_back_drained(tokenizer: Any, tmp_path: Path,
                                                           drained: bool) -> None:
    """`drain_all` marks what it aborts: its abort finish reads as "drained", a hand-over; any
    other abort, whatever its message says, stays the abort finish."""
    tm = _tm(tokenizer, tmp_path)
    gen = Generation(tm, GenerateRequest("r", [1, 2], {}, stream=True), 0, timeout=5)
    if drained:
        tm.drain_all()
    reason = FinishReason("abort", message=SHUTTING_DOWN)
    tm._dispatch(BatchOutput([ReqOutput("r", [5], 2, 1, finished_reason=reason)]))
    delta = await gen.next()
    assert delta.output_ids == [5]  # its tokens first, either way
    if drained:
        assert delta.finish_reason is None
        with pytest.raises(HandedOver) as e:
            await gen.next()
        assert e.value.handover == Handover("drained")
    else:
        assert delta.finish_reason == reason
    assert gen.finished
    tm.close()
