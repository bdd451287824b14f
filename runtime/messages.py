"""Messages between the HTTP process and the scheduler process (and the offline Engine).

Plain dataclasses; one msgpack codec (runtime.server.codec) carries them over ZMQ.
Outputs are incremental: each ReqOutput carries only what is new since the request's last one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class GenerateRequest:
    rid: str
    input_ids: list[int]
    sampling_params: dict[str, Any]
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None


@dataclass
class AbortRequest:
    rid: str
    message: str = "aborted by client"


@dataclass
class ReqOutput:
    rid: str
    output_ids: list[int]  # new tokens since the last ReqOutput for this rid
    prompt_tokens: int
    completion_tokens: int  # total so far
    finished_reason: dict[str, Any] | None = None  # FinishReason.to_dict() once finished
    output_logprobs: list[float] | None = None
    output_top_logprobs: list[list[tuple[int, float]]] | None = None
    customized_info: dict[str, list[Any]] | None = None

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None


@dataclass
class BatchOutput:
    outputs: list[ReqOutput] = field(default_factory=list)
