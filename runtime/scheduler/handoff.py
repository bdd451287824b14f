"""Handoffs: where a Scheduler meets a prefill or decode role (runtime/disagg), both ways.

Out: a `hand_off` request leaves once its newest token is sampled and its KV written (a
prefill's prompt and first token; a draining decode's stream, `hand_off_running`). Until the
role takes it (`take_handed_off`) it is still the scheduler's, and an abort finds it here;
from then on the role owns it and its KV.
In: a decode role asks whether a request fits (`can_reserve`) before it takes its pages, and
hands it over with its prompt's KV and first token (`process_prebuilt`).
Fence: KV written from outside the forward thread waits for `fence_passed(kv_fence())`.
The flow runs one way: the role calls these; nothing here calls a role.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from runtime.scheduler.decode import DecodeManager
from runtime.scheduler.req import Req
from runtime.scheduler.runner import ForwardCount


class Handoffs:
    """`add`/`discard` are the scheduler's; the rest is the role's (disagg's HandoffPort)."""

    def __init__(self, decode: DecodeManager, forwards: ForwardCount,
                 busy: Callable[[], bool]) -> None:
        self.decode = decode
        self.forwards = forwards
        self.busy = busy  # does the scheduler hold any work (Scheduler.has_work)?
        self.handed_off: list[Req] = []  # sampled and written, not taken yet

    def add(self, req: Req) -> None:
        """`req`'s newest token is sampled and its KV written: the role may take it."""
        self.handed_off.append(req)

    def discard(self, req: Req) -> None:
        """`req` was aborted before the role took it."""
        if req in self.handed_off:
            self.handed_off.remove(req)

    def take_handed_off(self) -> list[Req]:
        """The `hand_off` requests whose KV is written and newest token sampled since the
        last call (prefill role: the prompt's and the first token); from now on the caller owns
        them and their KV."""
        out, self.handed_off = self.handed_off, []
        return out

    def hand_off_running(self, pick: Callable[[Req], bool]) -> None:
        """Decode role, draining: the decoding requests `pick` chooses are handed over with
        their next token (`take_handed_off`) instead of going on here, unless it ends them."""
        for req in self.decode.running.reqs:
            if not req.finished and not req.hand_off and pick(req):
                req.hand_off = True

    def can_reserve(self, req: Req, incoming: Sequence[Req] = ()) -> bool:
        """Decode role: is there room for `req`'s prompt KV (arriving by transfer) and a request
        slot, keeping the decode reserve of the running requests, of `incoming` (prompt pages
        taken already, KV on its way) and of `req`? Alone, it only needs to fit."""
        return self.decode.can_reserve(req, incoming, alone=not incoming and not self.busy())

    def process_prebuilt(self, reqs: list[Req]) -> list[Req]:
        """Decode role: requests whose prompt KV and first token came from a prefill server.

        Each holds KV for its whole prompt (kv_len = prompt length) and its first output token
        (from the transfer's aux record). That token becomes its `input_ids` (the one
        cross-iteration bridge, seed 003) and the requests join the running decode batch; in
        overlap mode the batch may still hold placeholders of the forward in flight, which
        `resolve_future` swaps later and leaves these real ids alone. Returns `reqs`: their first
        token is due to be emitted (a request may already be finished by it)."""
        return self.decode.add_prebuilt(reqs)

    def kv_fence(self) -> int:
        """A fence for KV written from outside the forward thread (decode role: a transfer
        writes pages just allocated). `fence_passed(kv_fence())` turns True once every forward
        launched so far has finished.

        NOTE: in overlap mode a request that finishes (or is aborted or retracted) has its pages
        freed while the next forward, launched before we knew, still writes its slot. Forwards
        run one at a time, so a later forward's writes land after that stale one and the page
        is safe to reuse for them; a writer on another thread is not ordered with forwards and
        must wait for the fence taken when its pages were allocated."""
        return self.forwards.launched

    def fence_passed(self, fence: int) -> bool:
        return self.forwards.finished >= fence
