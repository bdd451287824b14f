"""OutputStreamer: decides which requests emit this step and builds their incremental outputs.

It holds exactly what it needs — the intervals — and no scheduler; the scheduler holds it and
calls `emit` with the requests a step touched (seed 004); whoever runs the loop sends what it
returns.

When a request emits:
- it finished (any reason), always;
- its first token, at once, streaming or not: the HTTP process times the first token (TTFT)
  when it arrives;
- streaming: whenever `len(output_ids)` is a multiple of its stream interval (the request's
  `stream_interval`, else the server's);
- non-streaming: whenever `len(output_ids)` is a multiple of `forced_interval`, so the HTTP
  process never holds nothing for a long generation.
Each output carries only what is new since the request's previous one (`Req.sent_len`).
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.messages import ReqOutput
from runtime.scheduler.req import Req


@dataclass
class OutputStreamer:
    stream_interval: int = 1
    # Non-streaming requests still flush this often, so no process holds nothing for minutes.
    forced_interval: int = 64

    def __post_init__(self) -> None:
        if self.stream_interval < 1 or self.forced_interval < 1:
            raise ValueError("stream_interval and forced_interval must be >= 1")

    def interval(self, req: Req) -> int:
        if not req.stream:
            return self.forced_interval
        return req.sampling_params.stream_interval or self.stream_interval

    def should_emit(self, req: Req) -> bool:
        if req.finished:
            return True
        n = len(req.output_ids)
        if n <= req.sent_len:
            return False
        if req.sent_len == 0:
            return True  # the first token goes out at once (its arrival is the TTFT)
        return n % self.interval(req) == 0

    def emit(self, reqs: list[Req]) -> list[ReqOutput]:
        """The outputs of the requests that are due this step."""
        return [self.build(r) for r in reqs if self.should_emit(r)]

    @staticmethod
    def build(req: Req) -> ReqOutput:
        """Everything new since the last emit; advances the request's cursor."""
        lo, hi = req.sent_len, len(req.output_ids)
        req.sent_len = hi
        out = ReqOutput(
            rid=req.rid,
            output_ids=req.output_ids[lo:hi],
            prompt_tokens=len(req.origin_input_ids),
            completion_tokens=hi,
            finished_reason=req.finished_reason,
            cached_tokens=req.cached_tokens,
        )
        if req.return_logprob:
            out.output_logprobs = req.log.logprobs[lo:hi]
            if req.top_logprobs_num:
                out.output_top_logprobs = req.log.top_logprobs[lo:hi]
        if req.log.info:
            out.customized_info = {k: v[lo:hi] for k, v in req.log.info.items()}
        return out
