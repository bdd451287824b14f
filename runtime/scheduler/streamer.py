"""OutputStreamer: decides which requests emit this step and builds their incremental outputs.

It holds exactly what it needs — the intervals and an optional sender — and no scheduler; the
scheduler holds it and calls `emit` after each processed step (seed 004).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from runtime.messages import ReqOutput
from runtime.scheduler.req import Req

Sender = Callable[[list[ReqOutput]], None]


@dataclass
class OutputStreamer:
    stream_interval: int = 1
    # Non-streaming requests still flush this often, so no process holds nothing for minutes.
    forced_interval: int = 64
    sender: Sender | None = None

    def interval(self, req: Req) -> int:
        if not req.stream:
            return self.forced_interval
        return req.sampling_params.stream_interval or self.stream_interval

    def should_emit(self, req: Req) -> bool:
        n = len(req.output_ids)
        if req.finished:
            return True
        return n > req.sent_len and n % self.interval(req) == 0

    def emit(self, reqs: list[Req]) -> list[ReqOutput]:
        outputs = [self.build(r) for r in reqs if self.should_emit(r)]
        if outputs and self.sender is not None:
            self.sender(outputs)
        return outputs

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
            finished_reason=req.finished_reason.to_dict() if req.finished_reason else None,
        )
        if req.return_logprob:
            out.output_logprobs = req.output_logprobs[lo:hi]
            if req.top_logprobs_num:
                out.output_top_logprobs = req.output_top_logprobs[lo:hi]
        if req.customized_info:
            out.customized_info = {k: v[lo:hi] for k, v in req.customized_info.items()}
        return out
