"""The P:D planner: how many prefill and decode pods meet a TTFT and an ITL target at a load.

From what the pools measure (a prefill pod's prompt tokens per second of prefill; a decode
pod's time per output token at the batches it ran) and what arrives (requests per second, the
prompt and output lengths), a queueing model gives each role's replica count:

Prefill, M/G/1 per pod. The router spreads the arrivals (rate `lam`) over n pods, each a
single server that prefills one prompt of L tokens in S = L / mu seconds (mu: the pod's
measured prompt tokens per second). With rho = (lam / n) E[S] < 1, Pollaczek-Khinchine gives
the mean wait W = (lam / n) E[S^2] / (2 (1 - rho)), and the mean TTFT is W + E[S] (the KV
hand-off and the decode's first step are left out: they do not depend on n). The plan is the
smallest n whose TTFT is within the target; E[S^2] comes from the prompt lengths' second
moment, so long prompts among short ones count for what they cost.

Decode, Little's law with a step time that grows with the batch. A stream holds its pod for
E[out] steps of ITL seconds each, so N = lam E[out] ITL streams are in flight, b = N / n on each
of n pods, and a step of b streams takes ITL(b) = base + slope b (a least-squares line through
the measured (batch, ITL) points; from one point, the flat line ITL(b) = ITL up to that
batch and the same tokens per second beyond it, which assumes no gain from a bigger batch).
Solving b = lam E[out] ITL(b) / n gives b = lam E[out] base / (n - lam E[out] slope), for
n > lam E[out] slope (ITL is taken at a batch of at least 1: a stream's own step); the plan is
the smallest n whose ITL(b) is within the target and whose
streams' KV fits (b (E[in] + E[out]) <= the pod's KV tokens, when known).

Each count is held within [min, max]; where even max misses the target, max is the plan and
the explanation says by how much. Nothing here is tuned by hand: every number is measured or
a target. `baton plan` prints the same from a JSON of these figures (`main`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Lengths:
    """A length distribution by its first two moments (tokens)."""

    mean: float
    second: float  # E[L^2]

    @classmethod
    def of(cls, samples: Sequence[float]) -> Lengths:
        if not samples:
            raise ValueError("no lengths to plan from")
        return cls(sum(samples) / len(samples), sum(x * x for x in samples) / len(samples))

    @classmethod
    def fixed(cls, n: float) -> Lengths:
        return cls(n, n * n)


@dataclass(frozen=True)
class Load:
    rate: float  # requests per second arriving
    prompt: Lengths
    output: Lengths


@dataclass(frozen=True)
class Measured:
    prefill_tokens_per_s: float  # one prefill pod, prompt tokens per second of prefill
    decode_steps: tuple[tuple[float, float], ...]  # (batch, ITL seconds) a decode pod ran
    decode_kv_tokens: float | None = None  # one decode pod's KV pool, when known


@dataclass(frozen=True)
class Targets:
    ttft_s: float
    itl_s: float
    prefill: tuple[int, int] = (1, 64)  # min, max replicas
    decode: tuple[int, int] = (1, 64)


@dataclass(frozen=True)
class RolePlan:
    role: str
    replicas: int
    predicted_s: float  # TTFT (prefill) or ITL (decode) at that count; inf if unstable
    target_s: float
    met: bool
    why: str
    details: dict[str, float] = field(default_factory=dict)


def prefill_ttft(n: int, load: Load, mu: float) -> float:
    """Mean TTFT with n prefill pods (M/G/1 each); inf when they cannot keep up."""
    es, es2 = load.prompt.mean / mu, load.prompt.second / mu ** 2
    lam = load.rate / n
    rho = lam * es
    if rho >= 1:
        return math.inf
    return es + lam * es2 / (2 * (1 - rho))


def step_line(steps: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(base, slope) of ITL(b) = base + slope b through the measured (batch, ITL) points; one
    point (or one batch size) gives the flat-then-proportional line described above, as
    (its ITL, 0) with the batch the caller caps at."""
    pts = [(float(b), float(t)) for b, t in steps if b > 0 and t > 0]
    if not pts:
        raise ValueError("no decode steps measured (batch, ITL) to plan from")
    bs = {b for b, _ in pts}
    if len(bs) == 1:
        return sum(t for _, t in pts) / len(pts), 0.0
    mb, mt = sum(b for b, _ in pts) / len(pts), sum(t for _, t in pts) / len(pts)
    slope = (sum((b - mb) * (t - mt) for b, t in pts) / sum((b - mb) ** 2 for b, _ in pts))
    slope = max(slope, 0.0)  # a step never gets faster with more streams
    return max(mt - slope * mb, 0.0), slope


def decode_itl(n: int, load: Load, steps: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(mean ITL, streams per pod) with n decode pods; (inf, inf) when they cannot keep up."""
    base, slope = step_line(steps)
    demand = load.rate * load.output.mean  # output tokens per second, all pods
    if slope == 0:  # flat up to the measured batch, no faster beyond it
        b = demand * base / n
        return (base, b) if b <= max(bt for bt, _ in steps) else (math.inf, math.inf)
    if n <= demand * slope:
        return math.inf, math.inf
    b = demand * base / (n - demand * slope)
    # a stream's step has at least itself in it: where the line runs through the origin (a
    # step's time proportional to its batch, as on a CPU) the fixed point is b = 0, not ITL 0
    return base + slope * max(b, 1.0), b


def plan_prefill(load: Load, measured: Measured, targets: Targets) -> RolePlan:
    lo, hi = targets.prefill
    mu = measured.prefill_tokens_per_s
    if mu <= 0:
        raise ValueError("prefill tokens per second must be > 0")
    floor = load.prompt.mean / mu
    for n in range(lo, hi + 1):
        ttft = prefill_ttft(n, load, mu)
        if ttft <= targets.ttft_s:
            return RolePlan("prefill", n, ttft, targets.ttft_s, True,
                            f"{n} pod(s): mean TTFT {ttft:.3f} s <= {targets.ttft_s} s "
                            f"(utilization {load.rate / n * floor:.0%})", _prefill_details(n, load, mu))
    ttft = prefill_ttft(hi, load, mu)
    why = (f"a mean prompt alone takes {floor:.3f} s of prefill, over the {targets.ttft_s} s target"
           if floor > targets.ttft_s else
           f"even {hi} pod(s) (the max) give a mean TTFT of {ttft:.3f} s > {targets.ttft_s} s")
    return RolePlan("prefill", hi, ttft, targets.ttft_s, False, why, _prefill_details(hi, load, mu))


def _prefill_details(n: int, load: Load, mu: float) -> dict[str, float]:
    return {"utilization": load.rate / n * load.prompt.mean / mu,
            "prefill_s": load.prompt.mean / mu}


def plan_decode(load: Load, measured: Measured, targets: Targets) -> RolePlan:
    lo, hi = targets.decode
    kv = measured.decode_kv_tokens
    per_stream = load.prompt.mean + load.output.mean
    for n in range(lo, hi + 1):
        itl, b = decode_itl(n, load, measured.decode_steps)
        fits = kv is None or b * per_stream <= kv
        if itl <= targets.itl_s and fits:
            return RolePlan("decode", n, itl, targets.itl_s, True,
                            f"{n} pod(s): {b:.1f} streams each, ITL {itl * 1e3:.1f} ms <= "
                            f"{targets.itl_s * 1e3:.1f} ms", {"streams_per_pod": b})
    itl, b = decode_itl(hi, load, measured.decode_steps)
    if kv is not None and b * per_stream > kv and itl <= targets.itl_s:
        why = (f"even {hi} pod(s) (the max) hold {b:.1f} streams each, whose KV "
               f"({b * per_stream:.0f} tokens) exceeds a pod's {kv:.0f}")
    else:
        why = (f"even {hi} pod(s) (the max) give ITL {itl * 1e3:.1f} ms > "
               f"{targets.itl_s * 1e3:.1f} ms")
    return RolePlan("decode", hi, itl, targets.itl_s, False, why, {"streams_per_pod": b})


def plan(load: Load, measured: Measured, targets: Targets) -> dict[str, RolePlan]:
    """Both roles' replica counts (each within its min/max)."""
    return {"prefill": plan_prefill(load, measured, targets),
            "decode": plan_decode(load, measured, targets)}


# ---- `baton plan` ------------------------------------------------------------------------------

def figures_from(doc: dict[str, Any]) -> tuple[Load, Measured, Targets]:
    """The JSON `baton plan` reads (docs/rollouts.md "The P:D planner" shows one)."""

    def lengths(v: Any) -> Lengths:
        if isinstance(v, (int, float)):
            return Lengths.fixed(float(v))
        if isinstance(v, list):
            return Lengths.of([float(x) for x in v])
        return Lengths(float(v["mean"]), float(v.get("second", float(v["mean"]) ** 2)))

    try:
        load = Load(float(doc["rate"]), lengths(doc["prompt_tokens"]), lengths(doc["output_tokens"]))
        measured = Measured(float(doc["prefill_tokens_per_s"]),
                            tuple((float(b), float(t)) for b, t in doc["decode_steps"]),
                            None if doc.get("decode_kv_tokens") is None
                            else float(doc["decode_kv_tokens"]))
        bounds = doc.get("replicas", {})
        targets = Targets(float(doc["ttft_target_s"]), float(doc["itl_target_s"]),
                          tuple(bounds.get("prefill", (1, 64))),  # type: ignore[arg-type]
                          tuple(bounds.get("decode", (1, 64))))  # type: ignore[arg-type]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"planner figures: {type(e).__name__}: {e}") from e
    if load.rate < 0 or min(*targets.prefill, *targets.decode) < 1:
        raise ValueError("planner figures: rate must be >= 0 and replica bounds >= 1")
    return load, measured, targets


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="baton plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("figures", type=Path, help="JSON: rate, prompt_tokens, output_tokens, "
                   "prefill_tokens_per_s, decode_steps, ttft_target_s, itl_target_s[, replicas, "
                   "decode_kv_tokens]")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = p.parse_args(argv)
    try:
        result = plan(*figures_from(json.loads(args.figures.read_text())))
    except (OSError, ValueError) as e:
        print(f"baton plan: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({k: asdict(v) for k, v in result.items()}, indent=1))
    else:
        for role_plan in result.values():
            mark = "" if role_plan.met else "  (target missed)"
            print(f"{role_plan.role:8s} {role_plan.replicas:3d}  {role_plan.why}{mark}")
    return 0
