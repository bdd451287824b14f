"""Draining on SIGTERM: stop taking work, give what is in flight a grace period, then end it
with the documented abort finish, so every client gets a finish reason and `[DONE]` (never a
cut stream or a 500) within grace + ABORT_WAIT_S, however long one forward takes. A decode ends
it as "drained" instead, a hand-over its router continues elsewhere (runtime/handover.py).

The HTTP listener stays open meanwhile: new requests and `/ready` answer 503 (a load balancer
sees the server leave) rather than connections being refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from runtime.messages import DrainRequest
from runtime.server.tokenizer_manager import SHUTTING_DOWN, SchedulerUnavailable, TokenizerManager

log = logging.getLogger("baton.server")

ABORT_WAIT_S = 2.0  # how long the scheduler may take to end the aborted requests
POLL_S = 0.05


def begin_drain(tm: TokenizerManager, grace_s: float, then: Callable[[], None]) -> bool:
    """Start `drain` on the server's event loop and call `then` when it is over. Safe in a
    signal handler. False if the loop is not running (nothing can be in flight: stop now)."""
    loop = tm.loop
    if loop is None or loop.is_closed():
        return False
    tm.unavailable = SHUTTING_DOWN

    async def drain_then() -> None:
        try:
            await drain(tm, grace_s)
        finally:
            then()

    loop.call_soon_threadsafe(lambda: loop.create_task(drain_then()))
    return True


async def drain(tm: TokenizerManager, grace_s: float) -> None:
    """New requests get 503 while in-flight ones get `grace_s` to finish; then they are
    aborted. The scheduler ends them at its next step (it prefills in small chunks once told we
    drain); those it has not ended ABORT_WAIT_S later (one long forward still running) are ended
    here with the same abort finish."""
    tm.unavailable = SHUTTING_DOWN
    tm.end_streams()  # a follower of /kv_events reconnects elsewhere, or to our successor
    with contextlib.suppress(SchedulerUnavailable):
        tm.send(DrainRequest())
    if await _idle_within(tm, grace_s):
        return
    log.info("grace period over: aborting %d request(s)", len(tm.states))
    if tm.args.role == "decode":
        tm.drain_all()  # its router continues each stream elsewhere: a hand-over
    else:
        tm.abort_all(SHUTTING_DOWN)
    if not await _idle_within(tm, ABORT_WAIT_S):
        log.warning("the scheduler has not ended %d aborted request(s) in %.0f s; ending them "
                    "here", len(tm.states), ABORT_WAIT_S)
        tm.end_all(SHUTTING_DOWN)


async def _idle_within(tm: TokenizerManager, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while tm.states and time.monotonic() < deadline:
        await asyncio.sleep(POLL_S)
    return not tm.states
