"""What the Scheduler needs around it: a runner for forwards, an optional handoff for requests
whose prompt is prefilled (prefill role), and the record of a forward in flight."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

import torch

from runtime.forward_batch import ForwardBatch, ForwardMode, ForwardOutput
from runtime.kvcache.manager import KVCacheManager
from runtime.scheduler.req import Req


class Runner(Protocol):
    device: torch.device  # where forwards run; ForwardBatch.to(device) stages a batch there
    kv: KVCacheManager
    context_len: int
    eos_token_ids: tuple[int, ...]
    needs_request_ids: bool  # the sampler keys on rid / bootstrap room (seed 002)

    @property
    def vocab_size(self) -> int: ...

    def forward_batch(self, batch: ForwardBatch) -> ForwardOutput: ...


class Handoff(Protocol):
    """Where requests go once their prompt is fully prefilled, instead of the decode batch.

    The prefill role's in-flight transfer queue: it receives each request as soon as its last
    prompt chunk is launched (in overlap mode possibly before that forward finished; the
    request's first output token appears when it has) and from then on owns it and its KV."""

    def take(self, req: Req) -> None: ...


@dataclass
class Launched:
    """A forward in flight and what processing its result needs (a snapshot, not the batch)."""

    reqs: list[Req]
    mode: ForwardMode
    is_last_chunk: list[bool]
    result: Future[ForwardOutput]
    future_indices: torch.Tensor | None = None  # overlap: the FutureMap slots it fills
