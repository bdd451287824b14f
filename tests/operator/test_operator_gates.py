"""Retries: a failed event's pass runs again later, once per service however many ask."""

from __future__ import annotations

import contextvars
import threading

from baton_operator.gates import Retries

WHO: contextvars.ContextVar[str] = contextvars.ContextVar("who", default="nobody")


def test_one_pending_pass_per_service_in_the_callers_context() -> None:
    retries, ran, done = Retries(), [], threading.Event()

    def run() -> None:
        ran.append(WHO.get())
        done.set()

    WHO.set("handler")
    retries.later(("ns", "a"), 0.05, run)
    retries.later(("ns", "a"), 0.05, run)  # already pending: covered by the first
    assert retries.pending() == [("ns", "a")]
    assert done.wait(5)
    threading.Event().wait(0.2)
    assert ran == ["handler"]  # once, with kopf's context variables of the caller
    assert retries.pending() == []
    retries.later(("ns", "a"), 0.05, run)  # once fired, a new failure schedules again
    assert retries.pending() == [("ns", "a")]
    retries.cancel()
    threading.Event().wait(0.2)
    assert ran == ["handler"] and retries.pending() == []
