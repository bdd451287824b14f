"""DecodeManager: the running decode batch, the KV it reserves, retraction, prebuilt requests.

Invariants:
- `running` holds the requests that decode at the next decode step, each with the KV of its
  whole prompt; one that finishes stays until the next `fold` drops it.
- `new_token_ratio`, between the configured ratio and 1, scales the KV reserved for what the
  running requests may still generate: each decode step lowers it by RATIO_DECAY, each
  retraction raises it by RATIO_BUMP (the estimate was too low).
- A retracted request holds no KV and has `is_retracted` set; results of forwards already in
  flight for it are dropped, and the caller queues it to prefill again (prompt + outputs).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from runtime.forward_batch import ForwardBatch
from runtime.kvcache.manager import KVCacheManager
from runtime.scheduler.batch import ScheduleBatch
from runtime.scheduler.prefill import decode_reserve_tokens
from runtime.scheduler.req import Req
from runtime.scheduler.runner import StopCheck

log = logging.getLogger(__name__)

RATIO_DECAY = 0.002  # per decode step
RATIO_BUMP = 0.1  # per retraction


class DecodeManager:
    def __init__(self, kv: KVCacheManager, base_ratio: float, stop: StopCheck) -> None:
        self.kv = kv
        self.base_ratio = base_ratio
        self.new_token_ratio = base_ratio
        self.stop = stop
        self.running = ScheduleBatch()
        self.num_retractions = 0
        self.peak_running = 0

    def reserve_tokens(self) -> int:
        """KV tokens kept for the running requests to go on decoding (prefill admission)."""
        return decode_reserve_tokens(self.running.reqs, self.new_token_ratio)

    def can_reserve(self, req: Req, incoming: Sequence[Req], alone: bool) -> bool:
        """Is there room for `req`'s prompt KV (arriving by transfer) and a request slot,
        keeping the decode reserve of the running requests, of `incoming` (prompt pages taken
        already, KV on its way) and of `req`? `alone` (nothing else in the scheduler or on
        its way): it only needs to fit."""
        alloc, available = self.kv.allocator, self.kv.available_pages
        if self.kv.req_to_token.available == 0:
            return False
        prompt = alloc.pages_for(len(req.origin_input_ids))
        if alone:
            return prompt <= available
        reserve = decode_reserve_tokens([*self.running.reqs, *incoming, req], self.new_token_ratio)
        return prompt + alloc.pages_for(reserve) <= available

    def fold(self, extended: ScheduleBatch | None) -> None:
        """Requests of `extended` whose prompt is now fully cached join the running batch
        (`hand_off` ones never do: they leave with their first token); finished ones leave."""
        if extended is not None:
            extended.filter_batch([i for i, r in enumerate(extended.reqs)
                                   if extended.is_last_chunk[i] and not r.finished and not r.hand_off])
            self.running.merge_batch(extended)
        self.running.filter_batch([i for i, r in enumerate(self.running.reqs) if not r.finished])

    def make_room(self, chunked: Req | None) -> list[Req]:
        """Retract the newest requests until every running one has a slot for its next token.

        `chunked` (a partially prefilled request, the newest of all) goes first. Returns the
        retracted requests in the order retracted; the caller queues each at the front."""
        victims: list[Req] = []
        while True:
            reqs = self.running.reqs
            need = sum(1 for r in reqs if r.kv.length // self.kv.page_size >= len(r.kv.pages))
            if need <= self.kv.available_pages:  # cached pages nobody reads go first
                return victims
            if chunked is not None:
                victim, chunked = chunked, None
            elif len(reqs) > 1:
                victim = reqs[-1]
                self.running.filter_batch(list(range(len(reqs) - 1)))
            else:
                raise RuntimeError("KV pool too small for a single request (admission bug)")
            self._retract(victim)
            victims.append(victim)

    def prepare(self, with_ids: bool) -> ForwardBatch:
        """The running batch's next decode step (one token each); the reserve ratio decays."""
        self.peak_running = max(self.peak_running, len(self.running))
        self.new_token_ratio = max(self.base_ratio, self.new_token_ratio - RATIO_DECAY)
        return self.running.prepare_for_decode(self.kv, with_ids)

    def add_prebuilt(self, reqs: list[Req]) -> list[Req]:
        """Requests whose prompt KV and first token came from elsewhere (see
        Handoffs.process_prebuilt) join the running batch, unless that token ends them."""
        live = []
        for req in reqs:
            self.stop(req)
            if req.finished:
                self.kv.release(req)
                continue
            req.needs_penalty_reset = req.sampling_params.uses_penalties
            live.append(req)
        if live:
            first = torch.tensor([r.output_ids[-1] for r in live], dtype=torch.int64)
            self.running.merge_batch(ScheduleBatch(reqs=live, input_ids=first))
        return reqs

    def _retract(self, req: Req) -> None:
        self.kv.release(req)
        req.reset_for_retract()
        self.num_retractions += 1
        self.new_token_ratio = min(1.0, self.new_token_ratio + RATIO_BUMP)
        log.info("retracted %s to free KV (%d retractions)", req.rid, self.num_retractions)
