"""The P:D planner's figures, live (`GET /debug/planner`): what the workers computed over the
last `window_s` seconds, from the figures each worker's `/ready` shows (runtime/figures.py).

Every health poll answered 200 adds a snapshot (the poll's time, the worker's totals, its KV
pool's tokens) to that worker's history; snapshots older than the window go. A worker whose
numbers went down (or whose role changed) started again: its history starts over from that
snapshot. A worker that leaves discovery leaves the figures (`forget`); a body without
figures, or with malformed ones, adds nothing. Over what each worker's history covers:

- `rate`: the sum over workers of the requests each received to prefill / the seconds its
  history covers (requests per second arriving);
- `prompt_tokens`, `output_tokens`: `{mean, second, count}` from the summed moments;
- `prefill_tokens_per_s`: a pod's prefill speed, extend tokens / extend busy seconds of the
  prefill workers (the decodes' extends count only where no prefill worker shows figures);
- `decode_steps`: `[mean batch, seconds per step]` of a decode worker between two polls with
  decode steps in between, the newest MAX_STEPS of them;
- `decode_kv_tokens`: the smallest KV pool among the decode workers;
- `ready`: ready workers by role; `window_s`: the longest span a history covers.
A window in which no prompt was prefilled or no request finished keeps the last lengths seen
(`stale` says how many seconds old): what a workload's requests look like outlives a window in
which none finished. A figure without data is null, and `missing` says why. The keys are those
`baton_operator.planner.figures_from` reads; the operator adds its targets and bounds.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

from runtime.figures import ForwardTotals, Moments, ServingFigures
from runtime.router.config import Role

MAX_STEPS = 64  # decode step points served, the newest


@dataclass(frozen=True)
class Snapshot:
    at: float  # time.monotonic() of the poll
    figures: ServingFigures
    kv_tokens: int | None  # the worker's KV pool


def parse(body: Any, at: float) -> Snapshot | None:
    """The figures of a worker's `/ready` body; None where it shows none or malformed ones."""
    shown = body.get("figures") if isinstance(body, dict) else None
    if not isinstance(shown, dict):
        return None
    try:
        figures = ServingFigures.from_dict(shown)
    except ValueError:
        return None
    kv = shown.get("kv_tokens")
    return Snapshot(at, figures, kv if type(kv) is int and kv > 0 else None)


@dataclass
class History:
    """One worker's snapshots, oldest first; its numbers never go down along it."""

    role: Role
    snapshots: deque[Snapshot] = field(default_factory=deque)

    def prune(self, since: float) -> None:
        while self.snapshots and self.snapshots[0].at < since:
            self.snapshots.popleft()

    def span(self) -> float:
        return self.snapshots[-1].at - self.snapshots[0].at if self.snapshots else 0.0

    def change(self) -> ServingFigures:
        """What it computed over the span (zeros for fewer than two snapshots)."""
        if not self.snapshots:
            return ServingFigures()
        return self.snapshots[-1].figures.since(self.snapshots[0].figures)


class PlannerFigures:
    def __init__(self, window_s: float = 60.0) -> None:
        self.window_s = window_s
        self.histories: dict[str, History] = {}  # by worker URL
        # the last window's prompt and output lengths that had any, and when (see `view`)
        self.lengths: dict[str, tuple[float, dict[str, float]]] = {}

    def observe(self, role: Role, url: str, body: Any, at: float) -> None:
        """A 200 from `url`'s `/ready` at `at` (monotonic seconds), with `body`."""
        snapshot = parse(body, at)
        if snapshot is None:
            return
        history = self.histories.get(url)
        if (history is None or history.role != role or not history.snapshots
                or snapshot.figures.since(history.snapshots[-1].figures).went_down()):
            history = self.histories[url] = History(role)
        history.snapshots.append(snapshot)
        history.prune(at - self.window_s)

    def forget(self, url: str) -> None:
        self.histories.pop(url, None)

    def view(self, ready: dict[Role, int], now: float) -> dict[str, Any]:
        """The figures over the window ending `now`, with the ready workers by role."""
        for history in self.histories.values():
            history.prune(now - self.window_s)
        live = [h for h in self.histories.values() if h.snapshots]
        decodes = [h for h in live if h.role == "decode"]
        prefills = [h for h in live if h.role == "prefill"] or decodes
        changes = [h.change() for h in live]
        kv = [h.snapshots[-1].kv_tokens for h in decodes if h.snapshots[-1].kv_tokens is not None]
        out: dict[str, Any] = {
            "rate": _rate(live),
            "prompt_tokens": _lengths([c.prompts for c in changes]),
            "output_tokens": _lengths([c.outputs for c in changes]),
            "prefill_tokens_per_s": _speed([h.change().forwards["extend"] for h in prefills]),
            "decode_steps": _steps(decodes) or None,
            "decode_kv_tokens": min(kv) if kv else None,
            "window_s": max((h.span() for h in live), default=0.0),
            "ready": ready,
        }
        out["stale"] = self._remembered(out, now)
        out["missing"] = [f"{key}: {why}" for key, why in self._why().items() if out[key] is None]
        return out

    def _remembered(self, out: dict[str, Any], now: float) -> dict[str, float]:
        """A length distribution is the workload's, not the moment's: a window in which no
        request finished (every stream longer than the window, as under a decode backlog) keeps
        the last window's that had one. Returns how old each carried one is, in seconds."""
        stale: dict[str, float] = {}
        for key in ("prompt_tokens", "output_tokens"):
            if out[key] is not None:
                self.lengths[key] = (now, out[key])
            elif key in self.lengths:
                at, out[key] = self.lengths[key]
                stale[key] = now - at
        return stale

    def _why(self) -> dict[str, str]:
        window = f"in the last {self.window_s:g} s"
        return {
            "rate": f"no worker answered two polls with figures {window}",
            "prompt_tokens": f"no prompt was prefilled {window}",
            "output_tokens": f"no request finished by a stop or its length {window}",
            "prefill_tokens_per_s": f"no prefill forward ran {window}",
            "decode_steps": f"no decode worker ran a decode step {window}",
            "decode_kv_tokens": f"no decode worker showed its KV pool {window}",
        }


def _rate(histories: list[History]) -> float | None:
    """Requests per second received to prefill, summed over the workers with a span."""
    spanned = [h for h in histories if h.span() > 0]
    if not spanned:
        return None
    return sum(h.change().received / h.span() for h in spanned)


def _lengths(moments: list[Moments]) -> dict[str, float] | None:
    n = sum(m.n for m in moments)
    if n == 0:
        return None
    return {"mean": sum(m.sum for m in moments) / n, "second": sum(m.sumsq for m in moments) / n,
            "count": n}


def _speed(extends: list[ForwardTotals]) -> float | None:
    seconds = sum(e.seconds for e in extends)
    return sum(e.tokens for e in extends) / seconds if seconds > 0 else None


def _steps(decodes: list[History]) -> list[list[float]]:
    """[mean batch, seconds per step] between each two consecutive polls with decode steps in
    between, the newest MAX_STEPS of them."""
    points = []
    for history in decodes:
        for a, b in pairwise(history.snapshots):
            step = b.figures.forwards["decode"].since(a.figures.forwards["decode"])
            if step.count > 0:
                points.append((b.at, [step.tokens / step.count, step.seconds / step.count]))
    points.sort(key=lambda p: p[0])
    return [p for _, p in points[-MAX_STEPS:]]
