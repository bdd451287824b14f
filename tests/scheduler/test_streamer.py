"""OutputStreamer alone: which requests emit when, and what each output carries."""

from __future__ import annotations

from runtime.messages import FinishReason, ReqOutput
from runtime.sampling_params import SamplingParams
from runtime.scheduler.req import Req
from runtime.scheduler.streamer import OutputStreamer


def _req(stream: bool = True, interval: int | None = None, logprobs: bool = False) -> Req:
    sp = SamplingParams(max_new_tokens=100, stream_interval=interval)
    return Req("r", [1, 2, 3], sp, stream=stream, return_logprob=logprobs, top_logprobs_num=2 if logprobs else 0)


def _step(req: Req, token: int) -> None:
    req.output_ids.append(token)
    req.log.logprobs.append(-float(token))
    req.log.top_logprobs.append([(token, -1.0), (token + 1, -2.0)])
    req.log.info.setdefault("mirror", []).append(token)
    req.log.info.setdefault("twice", []).append(2 * token)


def _run(streamer: OutputStreamer, req: Req, n: int, finish_at: int | None = None) -> list[tuple[int, ReqOutput]]:
    """Generate n tokens one step at a time; return (step, output) for each emission."""
    emitted = []
    for i in range(1, n + 1):
        _step(req, 100 + i)
        if finish_at == i:
            req.finished_reason = FinishReason("length")
        emitted += [(i, o) for o in streamer.emit([req])]
        if req.finished:
            break
    return emitted


def test_stream_interval_one_emits_every_token() -> None:
    out = _run(OutputStreamer(stream_interval=1), _req(), 5, finish_at=5)
    assert [step for step, _ in out] == [1, 2, 3, 4, 5]
    assert all(len(o.output_ids) == 1 for _, o in out)
    assert out[-1][1].finished and not out[0][1].finished


def test_stream_interval_emits_first_token_then_multiples_and_finish() -> None:
    out = _run(OutputStreamer(stream_interval=4), _req(), 10, finish_at=10)
    assert [step for step, _ in out] == [1, 4, 8, 10]
    assert [len(o.output_ids) for _, o in out] == [1, 3, 4, 2]


def test_request_stream_interval_overrides_server() -> None:
    out = _run(OutputStreamer(stream_interval=1), _req(interval=3), 7, finish_at=7)
    assert [step for step, _ in out] == [1, 3, 6, 7]


def test_non_streaming_emits_first_token_then_flushes_at_forced_interval() -> None:
    """The first token goes out at once either way: the HTTP side times it as the TTFT."""
    out = _run(OutputStreamer(stream_interval=1, forced_interval=4), _req(stream=False), 10, finish_at=10)
    assert [step for step, _ in out] == [1, 4, 8, 10]


def test_outputs_are_incremental_and_concatenate_to_the_whole() -> None:
    req = _req(logprobs=True)
    out = [o for _, o in _run(OutputStreamer(stream_interval=3), req, 8, finish_at=8)]
    whole = ReqOutput.concat(out)
    assert whole.output_ids == req.output_ids
    assert whole.output_logprobs == req.log.logprobs
    assert whole.output_top_logprobs == req.log.top_logprobs
    assert whole.customized_info == {"mirror": req.output_ids, "twice": [2 * t for t in req.output_ids]}
    assert whole.completion_tokens == 8 and whole.prompt_tokens == 3 and whole.finished
    for o in out:  # each key sliced alike
        assert o.customized_info is not None and o.customized_info["mirror"] == o.output_ids


def test_aborted_request_emits_its_rest_once() -> None:
    streamer = OutputStreamer(stream_interval=4)
    req = _req()
    _run(streamer, req, 2)  # emitted token 1; token 2 pending
    req.finished_reason = FinishReason("abort", message="bye")
    [out] = streamer.emit([req])
    assert out.output_ids == [102] and out.finished_reason == FinishReason("abort", message="bye")
    assert streamer.emit([]) == []


def test_no_emit_without_new_tokens_and_no_sender_needed() -> None:
    streamer = OutputStreamer(stream_interval=2)
    req = _req()
    _step(req, 5)
    assert len(streamer.emit([req])) == 1  # first token
    assert streamer.emit([req]) == []  # nothing new
    assert streamer.should_emit(req) is False
