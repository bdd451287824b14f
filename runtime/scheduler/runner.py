"""What the Scheduler needs around it: a runner for forwards, the record of a forward in flight,
the count of forwards, and what ends a request (counted in the figures when it finishes here)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

import torch

from runtime.figures import ServingFigures
from runtime.forward_batch import ForwardBatch, ForwardMode, ForwardOutput
from runtime.kvcache.manager import KVCacheManager
from runtime.scheduler.future import FutureMap
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


def run_forward(runner: Runner, future_map: FutureMap, batch: ForwardBatch,
                future_indices: torch.Tensor | None) -> ForwardOutput:
    """One forward as the forward thread runs it (every TP rank alike): staged on the device,
    its placeholder ids resolved from the future map and its sampled tokens stored back there
    (overlap: `future_indices`, the slots it fills; None: its ids are all real)."""
    batch = batch.to(runner.device)
    if future_indices is None:
        return runner.forward_batch(batch)
    batch.input_ids = future_map.resolve_future(batch.input_ids)
    out = runner.forward_batch(batch)
    future_map.store(future_indices, out.next_token_ids)
    return out


@dataclass
class Launched:
    """A forward in flight and what processing its result needs (a snapshot, not the batch)."""

    reqs: list[Req]
    mode: ForwardMode
    is_last_chunk: list[bool]
    result: Future[ForwardOutput]
    future_indices: torch.Tensor | None = None  # overlap: the FutureMap slots it fills
    kv_lens: list[int] = field(default_factory=list)  # each request's kv_len once it wrote
    tokens: int = 0  # its input tokens (a decode step: one a request)
    launched_at: float = 0.0  # time.monotonic() when it was launched


@dataclass
class ForwardCount:
    """Forwards launched and processed so far (`finished <= launched`): the KV fence counts
    in them (Handoffs.kv_fence)."""

    launched: int = 0
    finished: int = 0


@dataclass(frozen=True)
class StopCheck:
    """Ends a request after its newest token when that token ends it (`Req.check_finished`):
    by the runner's EOS ids and context length, and stop strings through `decode_tail`. A
    request it ends finished here: its completion tokens go into `figures.outputs`."""

    runner: Runner
    decode_tail: Callable[[list[int]], str] | None = None
    figures: ServingFigures = field(default_factory=ServingFigures)

    def __call__(self, req: Req) -> None:
        if req.finished:
            return
        req.check_finished(self.runner.eos_token_ids, self.runner.context_len, self.decode_tail)
        if req.finished:
            self.figures.outputs.add(len(req.output_ids))
