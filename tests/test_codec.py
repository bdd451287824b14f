"""The msgpack codec round-trips every message type; ReqOutput.concat coalesces."""

from __future__ import annotations

import msgpack
import pytest

from runtime.codec import CodecError, decode, encode
from runtime.figures import Moments, ServingFigures
from runtime.handover import Bootstrap, KVOffer
from runtime.messages import (
    AbortRequest,
    BatchOutput,
    FinishReason,
    GenerateRequest,
    ReqOutput,
    RequestError,
    SchedulerReady,
    SchedulerStats,
    ShutdownRequest,
)

OUT = ReqOutput(
    "r1", [5, 6], prompt_tokens=3, completion_tokens=2,
    finished_reason=FinishReason("stop", matched=2),  # travels as itself
    output_logprobs=[-0.5, -1.0], output_top_logprobs=[[[5, -0.5]], [[6, -1.0]]],
    customized_info={"mirror": [5, 6], "meta": [{"a": 1}, None]},
)
MESSAGES = [
    GenerateRequest("r1", [1, 2, 3], {"max_new_tokens": 4, "stop": ["\n"]}, stream=True,
                    return_logprob=True, top_logprobs_num=2,
                    bootstrap=Bootstrap(2**62, "10.0.0.1", 8998, "ticket")),
    AbortRequest("r1", "bye"),
    ShutdownRequest(),
    SchedulerReady(context_len=8192, vocab_size=49152, kv_capacity_tokens=4096, max_running_requests=8),
    SchedulerStats(1, 2, 3, 4, 16, False),
    RequestError("r1", "too long", "prompt"),
    OUT,
    BatchOutput([OUT, ReqOutput("r2", [], 1, 0)], SchedulerStats()),
    # a moved request's finish names where its KV waits (runtime/handover.py)
    ReqOutput("r3", [7], 3, 1, FinishReason("moved", offer=KVOffer("10.0.0.7", 8999, 2**62, "d1"))),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: object) -> None:
    assert decode(encode(msg)) == msg  # type: ignore[arg-type]


def test_figures_ride_along_with_the_stats() -> None:
    """Not compared (they change every step), so checked here: they arrive as they left."""
    figures = ServingFigures(3, Moments(2, 30, 500), Moments(1, 8, 64))
    figures.forwards["decode"].add(4, 0.25)
    back = decode(encode(SchedulerStats(figures=figures)))
    assert isinstance(back, SchedulerStats) and back.figures == figures


def test_tuples_travel_as_lists() -> None:
    out = ReqOutput("r", [1], 1, 1, output_top_logprobs=[[(1, -0.1), (2, -0.2)]])
    back = decode(encode(out))
    assert isinstance(back, ReqOutput) and back.output_top_logprobs == [[[1, -0.1], [2, -0.2]]]


def test_rejects_non_messages_and_garbage() -> None:
    with pytest.raises(CodecError):
        encode(object())  # type: ignore[arg-type]
    with pytest.raises(CodecError):
        decode(msgpack.packb({"__msg__": "Nope"}))
    with pytest.raises(CodecError):
        decode(msgpack.packb([1, 2]))
    with pytest.raises(CodecError):
        decode(b"\xc1")


def test_concat_joins_every_incremental_key() -> None:
    a = ReqOutput("r", [1, 2], 4, 2, output_logprobs=[-1.0, -2.0], customized_info={"k": [1, 2]})
    b = ReqOutput("r", [], 4, 2)
    c = ReqOutput("r", [3], 4, 3, output_logprobs=[-3.0], customized_info={"k": [3], "j": ["x"]},
                  finished_reason=FinishReason("length"))
    m = ReqOutput.concat([a, b, c])
    assert m.output_ids == [1, 2, 3] and m.output_logprobs == [-1.0, -2.0, -3.0]
    assert m.customized_info == {"k": [1, 2, 3], "j": ["x"]}
    assert m.completion_tokens == 3 and m.finished and m.output_top_logprobs is None
    assert ReqOutput.concat([a]) is a
    with pytest.raises(ValueError):
        ReqOutput.concat([])
