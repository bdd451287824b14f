"""ServingFigures: what one server computed since it started, for the P:D planner.

The scheduler counts them (runtime/scheduler/); they ride along with its stats to the HTTP
process, whose `/ready` shows them (with the KV pool's tokens) and whose `/metrics` counts them;
the router reads every worker's from its `/ready` and takes differences over a window
(runtime/router/figures.py, `GET /debug/planner`). Every number is a total since start, so
none goes down while the server lives: one that does belongs to a restarted server.

- `received`: requests given to the scheduler to prefill (a decode's, whose prompt a prefill
  computed, arrive prebuilt and are not).
- `prompts`: the prompt tokens each prefill computed (its cached prefix not counted), once per
  request, when its prompt's last chunk is done.
- `outputs`: the completion tokens of each request that finished here, by a stop or its length
  (not one handed over, moved or aborted).
- `forwards`, by mode ("extend", "decode"): how many, their input tokens (a decode step: one a
  request) and the seconds the device was busy with them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

MODES = ("extend", "decode")


@dataclass
class Moments:
    """Lengths by their count, sum and sum of squares: a mean and a second moment that add up."""

    n: int = 0
    sum: int = 0
    sumsq: int = 0

    def add(self, length: int) -> None:
        self.n += 1
        self.sum += length
        self.sumsq += length * length

    def since(self, before: Moments) -> Moments:
        return Moments(self.n - before.n, self.sum - before.sum, self.sumsq - before.sumsq)

    @classmethod
    def from_dict(cls, d: Any) -> Moments:
        return cls(_count(d["n"]), _count(d["sum"]), _count(d["sumsq"]))


@dataclass
class ForwardTotals:
    """Forwards of one mode: how many, their input tokens, the device's busy seconds."""

    count: int = 0
    tokens: int = 0
    seconds: float = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self.count += 1
        self.tokens += tokens
        self.seconds += seconds

    def since(self, before: ForwardTotals) -> ForwardTotals:
        return ForwardTotals(self.count - before.count, self.tokens - before.tokens,
                             self.seconds - before.seconds)

    @classmethod
    def from_dict(cls, d: Any) -> ForwardTotals:
        return cls(_count(d["count"]), _count(d["tokens"]), _seconds(d["seconds"]))


def _forwards() -> dict[str, ForwardTotals]:
    return {mode: ForwardTotals() for mode in MODES}


@dataclass
class ServingFigures:
    """A server's figures since start (the module's docstring says what each counts)."""

    received: int = 0
    prompts: Moments = field(default_factory=Moments)
    outputs: Moments = field(default_factory=Moments)
    forwards: dict[str, ForwardTotals] = field(default_factory=_forwards)  # by mode, both always

    def since(self, before: ServingFigures) -> ServingFigures:
        """What happened between `before` and these: each number's difference."""
        return ServingFigures(
            self.received - before.received, self.prompts.since(before.prompts),
            self.outputs.since(before.outputs),
            {m: self.forwards[m].since(before.forwards[m]) for m in MODES})

    def went_down(self) -> bool:
        """As a difference: is any number negative (the later figures are a new server's)?"""
        numbers = [self.received, *vars(self.prompts).values(), *vars(self.outputs).values(),
                   *(x for m in MODES for x in vars(self.forwards[m]).values())]
        return min(numbers) < 0

    @classmethod
    def from_dict(cls, d: Any) -> ServingFigures:
        """From their JSON (a worker's `/ready`); ValueError if a number is missing, negative
        or not a number of its kind."""
        try:
            return cls(_count(d["received"]), Moments.from_dict(d["prompts"]),
                       Moments.from_dict(d["outputs"]),
                       {m: ForwardTotals.from_dict(d["forwards"][m]) for m in MODES})
        except (KeyError, TypeError) as e:
            raise ValueError(f"figures: {type(e).__name__}: {e}") from e


def _count(x: Any) -> int:
    if type(x) is not int or x < 0:
        raise ValueError(f"figures: {x!r} is not a count")
    return x


def _seconds(x: Any) -> float:
    if type(x) not in (int, float) or not math.isfinite(x) or x < 0:
        raise ValueError(f"figures: {x!r} is not a number of seconds")
    return float(x)
