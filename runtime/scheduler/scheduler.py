"""Scheduler: CPU policy over a waiting queue, one running decode batch, and the KV manager.

The loop reads in a breath — `step()`: schedule → launch the forward → process the previous
result. With overlap on, the forward of step N runs on a worker thread while step N+1 is
scheduled; step N+1's tokens come from N through FutureMap placeholders in `input_ids`.
The scheduler works on the host: it builds ForwardBatches there and hands them to the runner,
whose device work (and, in overlap mode, the FutureMap's) is queued on the forward thread.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from runtime.canary.monitor import CanaryMonitor
from runtime.config import CanaryConfig, SchedulerConfig
from runtime.forward_batch import ForwardBatch, ForwardOutput
from runtime.messages import FinishReason, ReqOutput
from runtime.sampling_params import InvalidRequest
from runtime.scheduler.batch import ScheduleBatch
from runtime.scheduler.future import FutureMap
from runtime.scheduler.prefill import PrefillAdder, decode_reserve_tokens
from runtime.scheduler.req import Req
from runtime.scheduler.runner import Launched, Runner
from runtime.scheduler.streamer import OutputStreamer

log = logging.getLogger(__name__)

FORWARD_TIMEOUT_S = 600.0  # one forward pass taking longer than this is a hang, not work
DRAIN_CHUNK_TOKENS = 256  # prefill chunk while draining: a step stays short, aborts land soon


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        runner: Runner,
        decode_tail: Callable[[list[int]], str] | None = None,
        streamer: OutputStreamer | None = None,
        canary: CanaryConfig | None = None,
    ) -> None:
        self.config = config
        self.runner = runner
        self.kv = runner.kv
        self.decode_tail = decode_tail
        self.streamer = streamer or OutputStreamer(
            config.stream_interval, config.forced_stream_interval
        )
        self.waiting: deque[Req] = deque()
        self.running = ScheduleBatch()
        self.chunked_req: Req | None = None
        self.last_extend: ScheduleBatch | None = None
        self.pending: Launched | None = None  # overlap: the step launched but not processed
        self.new_token_ratio = config.new_token_ratio
        self.prefill_budget = config.chunked_prefill_size  # tokens per prefill step
        self.future_map = FutureMap(config.max_running_requests, runner.device)
        self.worker = (
            ThreadPoolExecutor(1, thread_name_prefix="forward")
            if config.overlaps(torch.device(runner.device).type) else None
        )
        self.launched_forwards = 0
        self.finished_forwards = 0
        self.num_retractions = 0
        self.peak_running = 0
        self._aborted: list[Req] = []
        self._handed_off: list[Req] = []  # `hand_off` requests with their first token
        self.canary = (CanaryMonitor(canary, runner.context_len)
                       if canary is not None and canary.enabled else None)

    # ---- requests in and out ------------------------------------------------------------------
    def add_request(self, req: Req) -> None:
        self.validate(req)
        self.waiting.append(req)

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

    def can_reserve(self, req: Req, incoming: Sequence[Req] = ()) -> bool:
        """Decode role: is there room for `req`'s prompt KV (arriving by transfer) and a request
        slot, keeping the decode reserve of the running requests, of `incoming` (prompt pages
        taken already, KV on its way) and of `req`? Alone, it only needs to fit."""
        alloc, available = self.kv.allocator, self.kv.available_pages
        if self.kv.req_to_token.available == 0:
            return False
        prompt = alloc.pages_for(len(req.origin_input_ids))
        if not self.has_work() and not incoming:
            return prompt <= available
        reserve = decode_reserve_tokens([*self.running.reqs, *incoming, req], self.new_token_ratio)
        return prompt + alloc.pages_for(reserve) <= available

    def abort(self, rid: str, message: str = "aborted") -> bool:
        """Finish request `rid` with reason abort and free its KV. False if unknown."""
        req = next((r for r in self.requests() if r.rid == rid), None)
        if req is None:
            return False
        req.finished_reason = FinishReason("abort", message=message)
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self._handed_off:  # not taken yet: still ours
            self._handed_off.remove(req)
        if req is self.chunked_req:
            self.chunked_req = None
        self.kv.release(req)
        self._aborted.append(req)
        return True

    def drain(self) -> None:
        """The server is shutting down: prefill in small chunks from now on, so each step is
        short and an abort waits for one small chunk at most, not a long prompt's."""
        self.prefill_budget = min(self.prefill_budget, DRAIN_CHUNK_TOKENS)

    def kv_fence(self) -> int:
        """A fence for KV written from outside the forward thread (decode role: a transfer
        writes pages just allocated). `fence_passed(kv_fence())` turns True once every forward
        launched so far has finished.

        NOTE: in overlap mode a request that finishes (or is aborted or retracted) has its pages
        freed while the next forward, launched before we knew, still writes its slot. Forwards
        run one at a time, so a later forward's writes land after that stale one and the page
        is safe to reuse for them; a writer on another thread is not ordered with forwards and
        must wait for the fence taken when its pages were allocated."""
        return self.launched_forwards

    def fence_passed(self, fence: int) -> bool:
        return self.finished_forwards >= fence

    def hand_off_running(self, pick: Callable[[Req], bool]) -> None:
        """Decode role, draining: the decoding requests `pick` chooses are handed over with
        their next token (`take_handed_off`) instead of going on here, unless it ends them."""
        for req in self.running.reqs:
            if not req.finished and not req.hand_off and pick(req):
                req.hand_off = True

    def take_handed_off(self) -> list[Req]:
        """The `hand_off` requests whose KV is written and newest token sampled since the
        last call (prefill role: the prompt's and the first token); from now on the caller owns
        them and their KV."""
        out, self._handed_off = self._handed_off, []
        return out

    def queued_prompt_tokens(self) -> int:
        """Prompt tokens of the waiting requests: the prefill work not yet started."""
        return sum(len(r.origin_input_ids) for r in self.waiting)

    def requests(self) -> list[Req]:
        """Every unfinished request this scheduler holds (waiting, prefilling, decoding)."""
        held = [*self.waiting, *self.running.reqs, *self._handed_off]
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
        n = sum(1 for r in self.running.reqs if not r.finished)  # finished ones leave at the
        n += sum(1 for r in extending if not r.finished)  # next fold, which may be a while
        if self.chunked_req is not None and self.chunked_req not in extending:
            n += 1
        return n

    def has_work(self) -> bool:
        return bool(
            self.waiting or self.running.reqs or self.chunked_req or self.pending or self.last_extend
        )

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
        self._fold_last_extend()
        new = self._schedule_prefill()
        if new is not None:
            self.last_extend = new
            return new, self._canary(new, new.prepare_for_extend(self.kv, self.runner.needs_request_ids))
        if self.running.is_empty():
            return None, None
        self._make_decode_room()
        self.peak_running = max(self.peak_running, len(self.running))
        self.new_token_ratio = max(self.config.new_token_ratio, self.new_token_ratio - 0.002)
        fb = self.running.prepare_for_decode(self.kv, self.runner.needs_request_ids)
        return self.running, self._canary(self.running, fb)

    def _canary(self, batch: ScheduleBatch, fb: ForwardBatch) -> ForwardBatch:
        """The KV canary's checks for this forward (runtime/canary/monitor.py), when it is on."""
        if self.canary is not None:
            fb.canary = self.canary.inputs(batch.reqs, batch.mode == "extend")
        return fb

    def launch(self, batch: ScheduleBatch, fb: ForwardBatch) -> Launched:
        self.launched_forwards += 1
        future_indices = None
        if self.worker is None:
            out = self.runner.forward_batch(fb)
            batch.input_ids = out.on_host().next_token_ids  # the next step is built from it anyway
            result: Future[ForwardOutput] = Future()
            result.set_result(out)
        else:
            future_indices = self.future_map.alloc(fb.batch_size)
            result = self.worker.submit(self._forward_in_worker, fb, future_indices)
            # Placeholders: the next step's resolve_future swaps them for these tokens (or, if
            # the next step does not run them, process() does: FutureMap.settle).
            batch.input_ids = -future_indices
        return Launched(list(batch.reqs), batch.mode, list(batch.is_last_chunk), result,
                        future_indices, [r.kv_len for r in batch.reqs])

    def _forward_in_worker(self, fb: ForwardBatch, future_indices: torch.Tensor) -> ForwardOutput:
        """Runs on the forward thread, strictly after the previous step's forward."""
        fb = fb.to(self.runner.device)
        fb.input_ids = self.future_map.resolve_future(fb.input_ids)
        out = self.runner.forward_batch(fb)
        self.future_map.store(future_indices, out.next_token_ids)
        return out

    def process(self, done: Launched) -> list[Req]:
        out = done.result.result(timeout=FORWARD_TIMEOUT_S).on_host()  # the step's one wait
        self.finished_forwards += 1
        # The running batch may still hold done's placeholders, unless the step launched after it
        # was a decode: that one took them all (and settling costs ~15 us a step).
        next_decoded = self.pending is not None and self.pending.mode == "decode"
        if done.future_indices is not None and not next_decoded and self.running.input_ids is not None:
            self.running.input_ids = FutureMap.settle(self.running.input_ids, done.future_indices,
                                                      out.next_token_ids)
        ids = out.next_token_ids.tolist()
        logprobs = out.logprobs.tolist() if out.logprobs is not None else None
        top = [t.tolist() for t in out.top_logprobs] if out.top_logprobs is not None else None
        info = out.customized_info or {}
        caught = {}
        if self.canary is not None:
            live = [not (r.finished or r.is_retracted) for r in done.reqs]
            caught = self.canary.verdicts(done.reqs, out, live)
        touched = []
        for i, req in enumerate(done.reqs):
            # Dropped: finished or aborted meanwhile, evicted, or a prompt chunk that samples nothing.
            if req.finished or req.is_retracted:
                continue
            if i in caught:  # its KV is not its own: it ends here, and its KV goes to nobody
                req.finish("abort", caught[i])
                self.kv.discard(req)
                touched.append(req)
                continue
            req.computed_len = max(req.computed_len, done.kv_lens[i])  # its KV is written now
            if done.mode == "extend":  # its prompt's pages are reusable from now on
                self.kv.cache_progress(req)
                if not done.is_last_chunk[i]:
                    continue
            k = req.top_logprobs_num
            req.append_token(
                ids[i],
                logprobs[i] if logprobs is not None else None,
                list(zip(top[1][i][:k], top[0][i][:k], strict=True)) if top and k else None,
                {key: values[i] for key, values in info.items()},
            )
            if req.hand_off and done.mode == "extend":  # prefill role: KV and first token
                self._handed_off.append(req)  # are here, the request is the role's now
                continue
            req.check_finished(self.runner.eos_token_ids, self.runner.context_len, self.decode_tail)
            if req.finished:
                self.kv.release(req)
            elif req.hand_off:  # a draining decode moves it, with this token (`hand_off_running`)
                self._handed_off.append(req)
                continue
            touched.append(req)
        return touched

    def process_prebuilt(self, reqs: list[Req]) -> list[Req]:
        """Decode role: requests whose prompt KV and first token came from a prefill server.

        Each holds KV for its whole prompt (kv_len = prompt length) and its first output token
        (from the transfer's aux record). That token becomes its `input_ids` (the one
        cross-iteration bridge, seed 003) and the requests join the running decode batch; in
        overlap mode the batch may still hold placeholders of the forward in flight, which
        `resolve_future` swaps later and leaves these real ids alone. Returns `reqs`: their first
        token is due to be emitted (a request may already be finished by it)."""
        live = []
        for req in reqs:
            req.check_finished(self.runner.eos_token_ids, self.runner.context_len, self.decode_tail)
            if req.finished:
                self.kv.release(req)
                continue
            req.needs_penalty_reset = req.sampling_params.uses_penalties
            live.append(req)
        if live:
            first = torch.tensor([r.output_ids[-1] for r in live], dtype=torch.int64)
            self.running.merge_batch(ScheduleBatch(reqs=live, input_ids=first))
        return reqs

    # ---- policy -------------------------------------------------------------------------------
    def _fold_last_extend(self) -> None:
        """Requests whose prompt is now fully cached join the running decode batch (`hand_off`
        ones never do: `process` hands them over with their first token)."""
        b, self.last_extend = self.last_extend, None
        if b is not None:
            b.filter_batch([i for i, r in enumerate(b.reqs)
                            if b.is_last_chunk[i] and not r.finished and not r.hand_off])
            self.running.merge_batch(b)
        self.running.filter_batch([i for i, r in enumerate(self.running.reqs) if not r.finished])

    def _schedule_prefill(self) -> ScheduleBatch | None:
        if not self.waiting and self.chunked_req is None:
            return None
        running = self.running.reqs
        adder = PrefillAdder(
            self.kv,
            token_budget=self.prefill_budget,
            max_new_reqs=self.config.max_running_requests - len(running),
            reserved_tokens=decode_reserve_tokens(running, self.new_token_ratio),
            ratio=self.new_token_ratio,
            nothing_running=not running,
        )
        chunked, self.chunked_req = self.chunked_req, None
        if chunked is not None and not adder.add(chunked) and adder.chunked is None:
            self.chunked_req = chunked  # no room for its next chunk yet: decode first
            return None  # and nobody overtakes it (one chunked request at a time)
        # prompts whose prefill is launched but not processed yet: not in the cache so far
        prefilling = [r for r in running if r.computed_len < len(r.origin_input_ids)
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
        return None if adder.batch.is_empty() else adder.batch

    def _make_decode_room(self) -> None:
        """Retract the newest requests until every running one has a slot for its next token.

        A partially prefilled (chunked) request is the newest of all, so it goes first."""
        while True:
            reqs = self.running.reqs
            need = sum(1 for r in reqs if r.kv_len // self.kv.page_size >= len(r.kv_pages))
            if need <= self.kv.available_pages:  # cached pages nobody reads go first
                return
            if self.chunked_req is not None:
                victim, self.chunked_req = self.chunked_req, None
            elif len(reqs) > 1:
                victim = reqs[-1]
                self.running.filter_batch(list(range(len(reqs) - 1)))
            else:
                raise RuntimeError("KV pool too small for a single request (admission bug)")
            self._retract(victim)

    def _retract(self, req: Req) -> None:
        self.kv.release(req)
        req.reset_for_retract()
        self.waiting.appendleft(req)
        self.num_retractions += 1
        self.new_token_ratio = min(1.0, self.new_token_ratio + 0.1)
        log.info("retracted %s to free KV (%d retractions)", req.rid, self.num_retractions)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown(wait=True, cancel_futures=True)
