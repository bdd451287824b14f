"""Scheduler: CPU policy over small managers — the waiting queue and the prefill adder here, the
running decode batch (DecodeManager), a forward's results (ResultProcessor), the PD hand-offs
(Handoffs, the one thing a prefill or decode role calls besides add/validate/abort), and the
KV manager.

The loop reads in a breath — `step()`: schedule → launch the forward → process the previous
result. With overlap on, the forward of step N runs on a worker thread while step N+1 is
scheduled; step N+1's tokens come from N through FutureMap placeholders in `input_ids`.
The scheduler works on the host: it builds ForwardBatches there and hands them to the runner,
whose device work (and, in overlap mode, the FutureMap's) is queued on the forward thread.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from runtime.canary.monitor import CanaryMonitor
from runtime.config import CanaryConfig, SchedulerConfig
from runtime.figures import ServingFigures
from runtime.forward_batch import ForwardBatch, ForwardOutput
from runtime.messages import FinishReason, ReqOutput
from runtime.sampling_params import InvalidRequest
from runtime.scheduler.batch import ScheduleBatch
from runtime.scheduler.decode import DecodeManager
from runtime.scheduler.future import FutureMap
from runtime.scheduler.handoff import Handoffs
from runtime.scheduler.prefill import PrefillAdder
from runtime.scheduler.ranks import Ranks
from runtime.scheduler.req import Req
from runtime.scheduler.results import ResultProcessor
from runtime.scheduler.runner import ForwardCount, Launched, Runner, StopCheck, run_forward
from runtime.scheduler.streamer import OutputStreamer

log = logging.getLogger(__name__)

FORWARD_TIMEOUT_S = 600.0  # one forward pass taking longer than this is a hang, not work
DRAIN_CHUNK_TOKENS = 256  # prefill chunk while draining: a step stays short, aborts land soon


class Scheduler:
    """Every unfinished request it was given is in `waiting`, in the prefill in flight
    (`last_extend`; `chunked_req` while its prompt is unfinished, in `last_extend` too while its
    chunk runs), in the running decode batch (`decode.running`), or handed over and not taken
    yet (`handoffs`): `requests()` lists them once each. It makes no device calls itself.
    `figures` counts what it computed since start (runtime/figures.py)."""

    def __init__(
        self,
        config: SchedulerConfig,
        runner: Runner,
        decode_tail: Callable[[list[int]], str] | None = None,
        streamer: OutputStreamer | None = None,
        canary: CanaryConfig | None = None,
        ranks: Ranks | None = None,
    ) -> None:
        """`ranks`: under tensor parallelism, the follower ranks every forward goes to as it is
        launched (runtime/scheduler/ranks.py); `runner` is rank 0's."""
        self.config = config
        self.runner = runner
        self.ranks = ranks
        self.kv = runner.kv
        self.streamer = streamer or OutputStreamer(
            config.stream_interval, config.forced_stream_interval
        )
        self.waiting: deque[Req] = deque()
        self.chunked_req: Req | None = None
        self.last_extend: ScheduleBatch | None = None
        self.pending: Launched | None = None  # overlap: the step launched but not processed
        self.prefill_budget = config.chunked_prefill_size  # tokens per prefill step
        self.future_map = FutureMap(config.max_running_requests, runner.device)
        self.worker = (
            ThreadPoolExecutor(1, thread_name_prefix="forward")
            if config.overlaps(torch.device(runner.device).type) else None
        )
        self.forwards = ForwardCount()
        self.figures = ServingFigures()
        self._processed_at = 0.0  # time.monotonic() when the previous forward was processed
        self._aborted: list[Req] = []
        self.canary = (CanaryMonitor(canary, runner.context_len)
                       if canary is not None and canary.enabled else None)
        stop = StopCheck(runner, decode_tail, self.figures)
        self.decode = DecodeManager(self.kv, config.new_token_ratio, stop)
        self.handoffs = Handoffs(self.decode, self.forwards, self.has_work)
        self.results = ResultProcessor(self.kv, stop, self.handoffs, self.canary, self.figures)

    # ---- requests in and out ------------------------------------------------------------------
    def add_request(self, req: Req) -> None:
        self.validate(req)
        self.waiting.append(req)
        self.figures.received += 1

    def validate(self, req: Req) -> None:
        n = len(req.origin_input_ids)
        if n == 0:
            raise InvalidRequest("the prompt is empty", "prompt")
        if n >= self.runner.context_len:
            raise InvalidRequest(
                f"the prompt has {n} tokens; the model's context is {self.runner.context_len}",
                "prompt",
            )
        if min(req.origin_input_ids) < 0 or max(req.origin_input_ids) >= self.runner.vocab_size:
            raise InvalidRequest(f"token ids must be in [0, {self.runner.vocab_size})", "input_ids")
        bias = req.sampling_params.logit_bias
        if bias and bias[-1][0] >= self.runner.vocab_size:  # sorted: the last id is the largest
            raise InvalidRequest(f"logit_bias: token id {bias[-1][0]} is outside the vocabulary "
                                 f"[0, {self.runner.vocab_size})", "logit_bias")
        need = min(n + req.sampling_params.max_new_tokens, self.runner.context_len)
        capacity = self.kv.allocator.num_pages * self.kv.page_size
        if need > capacity:
            raise InvalidRequest(
                f"prompt + max_new_tokens needs {need} KV tokens; the pool holds {capacity} "
                "(lower max_new_tokens or raise --max-total-tokens)",
                "max_new_tokens",
            )

    def abort(self, rid: str, message: str = "aborted") -> bool:
        """Finish request `rid` with reason abort and free its KV. False if unknown."""
        req = next((r for r in self.requests() if r.rid == rid), None)
        if req is None:
            return False
        req.finished_reason = FinishReason("abort", message=message)
        if req in self.waiting:
            self.waiting.remove(req)
        self.handoffs.discard(req)  # not taken yet: still ours
        if req is self.chunked_req:
            self.chunked_req = None
        self.kv.release(req)
        self._aborted.append(req)
        return True

    def drain(self) -> None:
        """The server is shutting down: prefill in small chunks from now on, so each step is
        short and an abort waits for one small chunk at most, not a long prompt's."""
        self.prefill_budget = min(self.prefill_budget, DRAIN_CHUNK_TOKENS)

    def queued_prompt_tokens(self) -> int:
        """Prompt tokens of the waiting requests: the prefill work not yet started."""
        return sum(len(r.origin_input_ids) for r in self.waiting)

    def requests(self) -> list[Req]:
        """Every unfinished request this scheduler holds (waiting, prefilling, decoding)."""
        held = [*self.waiting, *self.decode.running.reqs, *self.handoffs.handed_off]
        if self.chunked_req is not None:
            held.append(self.chunked_req)
        if self.last_extend is not None:
            held.extend(self.last_extend.reqs)
        unique = {id(r): r for r in held if not r.finished}
        return list(unique.values())

    def num_running(self) -> int:
        """Requests it is computing: the decode batch and prompts being prefilled (counted
        without building lists: the loop asks every breath)."""
        extending = self.last_extend.reqs if self.last_extend is not None else []
        n = sum(1 for r in self.decode.running.reqs if not r.finished)  # finished ones leave at the
        n += sum(1 for r in extending if not r.finished)  # next fold, which may be a while
        if self.chunked_req is not None and self.chunked_req not in extending:
            n += 1
        return n

    def has_work(self) -> bool:
        return bool(self.waiting or self.decode.running.reqs or self.chunked_req or self.pending
                    or self.last_extend)

    # ---- the loop -----------------------------------------------------------------------------
    def step(self) -> list[ReqOutput]:
        """One iteration; returns the outputs due from it (the caller sends them)."""
        batch, fb = self.schedule()
        launched = self.launch(batch, fb) if batch is not None and fb is not None else None
        if self.worker is None:
            done = launched
        else:
            done, self.pending = self.pending, launched
        touched = self.process(done) if done is not None else []
        if self._aborted:
            touched = self._aborted + touched
            self._aborted = []
        return self.streamer.emit(touched)

    def schedule(self) -> tuple[ScheduleBatch | None, ForwardBatch | None]:
        """The next forward: a prefill when one fits, else the running batch's decode step."""
        extended, self.last_extend = self.last_extend, None
        self.decode.fold(extended)
        new = self._schedule_prefill()
        if new is not None:
            self.last_extend = new
            return new, self._canary(new, new.prepare_for_extend(self.kv, self.runner.needs_request_ids))
        running = self.decode.running
        if running.is_empty():
            return None, None
        self._make_decode_room()
        return running, self._canary(running, self.decode.prepare(self.runner.needs_request_ids))

    def _canary(self, batch: ScheduleBatch, fb: ForwardBatch) -> ForwardBatch:
        """The KV canary's checks for this forward (runtime/canary/monitor.py), when it is on."""
        if self.canary is not None:
            fb.canary = self.canary.inputs(batch.reqs, batch.mode == "extend")
        return fb

    def launch(self, batch: ScheduleBatch, fb: ForwardBatch) -> Launched:
        launched_at = time.monotonic()
        self.forwards.launched += 1
        future_indices = None
        if self.worker is None:
            if self.ranks is not None:
                self.ranks.send(fb, None)
            out = run_forward(self.runner, self.future_map, fb, None)
            batch.input_ids = out.on_host().next_token_ids  # the next step is built from it anyway
            result: Future[ForwardOutput] = Future()
            result.set_result(out)
        else:
            future_indices = self.future_map.alloc(fb.batch_size)
            if self.ranks is not None:
                self.ranks.send(fb, future_indices)
            result = self.worker.submit(run_forward, self.runner, self.future_map, fb, future_indices)
            # Placeholders: the next step's resolve_future swaps them for these tokens (or, if
            # the next step does not run them, process() does: FutureMap.settle).
            batch.input_ids = -future_indices
        return Launched(list(batch.reqs), batch.mode, list(batch.is_last_chunk), result,
                        future_indices, [r.kv.length for r in batch.reqs], sum(fb.extend_lens),
                        launched_at)

    def process(self, done: Launched) -> list[Req]:
        """Wait for `done`'s forward (the step's one wait) and apply its results; returns the
        requests whose outputs are due."""
        out = done.result.result(timeout=FORWARD_TIMEOUT_S).on_host()
        self.forwards.finished += 1
        self._time(done)
        # The running batch may still hold done's placeholders, unless the step launched after it
        # was a decode: that one took them all (and settling costs ~15 us a step).
        next_decoded = self.pending is not None and self.pending.mode == "decode"
        running = self.decode.running
        if done.future_indices is not None and not next_decoded and running.input_ids is not None:
            running.input_ids = FutureMap.settle(running.input_ids, done.future_indices,
                                                 out.next_token_ids)
        return self.results.process(done, out)

    def _time(self, done: Launched) -> None:
        """Count `done`'s forward in the figures, busy from its launch or, when it was launched
        while the previous one ran (overlap), from the moment that one was done."""
        now = time.monotonic()
        busy = now - max(done.launched_at, self._processed_at)
        self.figures.forwards[done.mode].add(done.tokens, busy)
        self._processed_at = now

    # ---- policy -------------------------------------------------------------------------------
    def _schedule_prefill(self) -> ScheduleBatch | None:
        """The next prefill: the chunked request's next chunk first (nobody overtakes it), then
        waiting requests in order while they fit. None when nothing fits."""
        if not self.waiting and self.chunked_req is None:
            return None
        running = self.decode.running.reqs
        adder = PrefillAdder(
            self.kv,
            token_budget=self.prefill_budget,
            max_new_reqs=self.config.max_running_requests - len(running),
            reserved_tokens=self.decode.reserve_tokens(),
            ratio=self.decode.new_token_ratio,
            nothing_running=not running,
        )
        chunked, self.chunked_req = self.chunked_req, None
        if chunked is not None and not adder.add(chunked) and adder.chunked is None:
            self.chunked_req = chunked  # no room for its next chunk yet: decode first
            return None  # and nobody overtakes it (one chunked request at a time)
        self._admit_waiting(adder)
        return None if adder.batch.is_empty() else adder.batch

    def _admit_waiting(self, adder: PrefillAdder) -> None:
        """Waiting requests join `adder` in order until one does not fit or one is left
        chunked (it becomes `chunked_req`). One that would compute what a prefill in flight
        computes too waits and keeps its place (PrefillAdder.should_wait)."""
        # prompts whose prefill is launched but not processed yet: not in the cache so far
        prefilling = [r for r in self.decode.running.reqs if r.kv.computed < len(r.origin_input_ids)
                      ] if self.kv.cache is not None else []
        deferred: list[Req] = []
        while self.waiting and adder.chunked is None:
            if adder.should_wait(self.waiting[0], prefilling):
                deferred.append(self.waiting.popleft())  # keeps its place for the next step
                continue
            if not adder.add(self.waiting[0]):
                break
            self.waiting.popleft()
        if adder.chunked is not None:
            self.chunked_req = adder.chunked
            if self.waiting and self.waiting[0] is adder.chunked:
                self.waiting.popleft()
        self.waiting.extendleft(reversed(deferred))

    def _make_decode_room(self) -> None:
        """Retract the newest requests until every running one has a slot for its next token
        (DecodeManager.make_room); the chunked request goes first. They wait at the front."""
        for victim in self.decode.make_room(self.chunked_req):
            if victim is self.chunked_req:
                self.chunked_req = None
            self.waiting.appendleft(victim)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown(wait=True, cancel_futures=True)
