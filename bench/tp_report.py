"""Results of bench/tp.py: greedy tokens against tp=1's, ratios against tp=1, the tables."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Greedy:
    """One prompt's greedy output; with the engine's logprobs, each chosen token's logprob and
    the top-1 minus top-2 logprob gap at each step (how near a tie the choice was)."""

    ids: list[int]
    logprobs: list[float] | None = None
    gaps: list[float] | None = None

    @classmethod
    def of_result(cls, result: dict[str, Any]) -> Greedy:
        meta = result["meta_info"]
        top = meta.get("output_top_logprobs")  # per step: [[token id, logprob], ...]
        return cls(result["output_ids"], [lp for lp, _ in meta["output_token_logprobs"]],
                   [row[0][1] - row[1][1] for row in top] if top else None)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(ref: list[Greedy], got: list[Greedy], near_tie: float) -> dict[str, Any]:
    """Each prompt's ids against tp=1's: equal, a near-tie (tp=1's top-2 gap at the first
    divergence under `near_tie`), a mismatch, or unclassified (no gaps known); the largest
    logprob difference before any divergence."""
    counts = {"equal": 0, "near_tie": 0, "mismatch": 0, "unclassified": 0}
    divergences, delta = [], 0.0
    for i, (r, g) in enumerate(zip(ref, got, strict=True)):
        at = first_divergence(r.ids, g.ids)
        if r.logprobs is not None and g.logprobs is not None:
            upto = len(r.logprobs) if at is None else at
            delta = max([delta, *(abs(x - y) for x, y in zip(r.logprobs[:upto], g.logprobs[:upto],
                                                             strict=False))])
        if at is None:
            counts["equal"] += 1
            continue
        gap = r.gaps[at] if r.gaps is not None and at < len(r.gaps) else None
        kind = "unclassified" if gap is None else "near_tie" if gap < near_tie else "mismatch"
        counts[kind] += 1
        divergences.append({"prompt": i, "step": at, "kind": kind, "tp1_top2_gap": gap,
                            "tp1": r.ids[at:at + 4], "this": g.ids[at:at + 4]})
    return {**counts, "divergences": divergences,
            "max_logprob_delta": delta if ref[0].logprobs is not None else None}


def add_comparisons(report: dict[str, Any]) -> None:
    """Each row's tokens against, and ratios over, its model's tp=1 row (the Greedy lists are
    replaced by the comparison)."""
    for part, keys in (("engine", ("out_tok_s", "ttft_batch_ms", "ttft_one_ms")),
                       ("serve", ("out_tok_s", "ttft_p50_ms", "ttft_max_ms"))):
        rows = report[part]
        base = {r["model"]: r for r in rows if r["tp"] == 1 and not r.get("error")}
        for row in rows:
            ref = base.get(row["model"])
            if row.get("error") or ref is None:
                continue
            row["vs_tp1"] = {k: row[k] / ref[k] for k in keys}
            row["tokens_vs_tp1"] = compare(ref["greedy"], row["greedy"], report["near_tie"])
        for row in rows:
            row.pop("greedy", None)


def _f(x: Any, spec: str = ".1f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _tokens(row: dict[str, Any]) -> str:
    t = row.get("tokens_vs_tp1")
    if t is None:
        return "-"
    n = t["equal"] + t["near_tie"] + t["mismatch"] + t["unclassified"]
    text = f"{t['equal']}/{n} equal"
    for kind in ("near_tie", "mismatch", "unclassified"):
        if t[kind]:
            text += f", {t[kind]} {kind.replace('_', '-')}"
    if row.get("timed_run_equals_check_run") is False:
        text += "; ITS TIMED RUN DIFFERS FROM ITS CHECK RUN"
    return text


def print_engine(rows: list[dict[str, Any]]) -> None:
    print("\nEngine (x tp1: this tp's value over tp=1's; tok/s higher is better, TTFT lower)")
    print(f"{'model':<8}{'tp':>3}{'thr/rank':>9}{'out tok/s':>11}{'x tp1':>7}{'TTFT batch ms':>15}"
          f"{'x tp1':>7}{'TTFT one ms':>13}{'x tp1':>7}  tokens vs tp=1 (max |dlogprob|)")
    for r in rows:
        if r.get("error"):
            print(f"{r['model']:<8}{r['tp']:>3}  FAILED: {r['error']}")
            continue
        v, t = r.get("vs_tp1", {}), r.get("tokens_vs_tp1") or {}
        print(f"{r['model']:<8}{r['tp']:>3}{r['threads_per_rank']:>9}{r['out_tok_s']:>11.1f}"
              f"{_f(v.get('out_tok_s'), '.2f'):>7}{r['ttft_batch_ms']:>15.1f}"
              f"{_f(v.get('ttft_batch_ms'), '.2f'):>7}{r['ttft_one_ms']:>13.1f}"
              f"{_f(v.get('ttft_one_ms'), '.2f'):>7}  {_tokens(r)}"
              f" ({_f(t.get('max_logprob_delta'), '.1e')})")


def print_steps(rows: list[dict[str, Any]]) -> None:
    print("\nRank 0's step in the fastest timed run, ms per forward (a collective's time includes "
          "waiting for the other ranks; collect. %: all-reduce + gather over forward)")
    print(f"{'model':<8}{'tp':>3} {'mode':<7}{'fwds':>5}{'step':>8}{'forward':>9}{'all-red':>9}"
          f"{'n/fwd':>6}{'gather':>8}{'send':>7}{'collect. %':>11}")
    for r in rows:
        for mode, s in sorted(r.get("steps", {}).items()):
            print(f"{r['model']:<8}{r['tp']:>3} {mode:<7}{s['forwards']:>5.0f}"
                  f"{_f(s.get('step_ms'), '.2f'):>8}{s['forward_ms']:>9.2f}"
                  f"{_f(s.get('all_reduce_ms'), '.2f'):>9}{_f(s.get('all_reduce_calls'), '.0f'):>6}"
                  f"{_f(s.get('all_gather_ms'), '.2f'):>8}{_f(s.get('send_ms'), '.2f'):>7}"
                  f"{100 * s['collective_share']:>10.1f}%")


def print_serve(rows: list[dict[str, Any]]) -> None:
    print("\n`baton serve --tp N` (all prompts at once, streaming; x tp1 as above)")
    print(f"{'model':<8}{'tp':>3}{'out tok/s':>11}{'x tp1':>7}{'TTFT p50 ms':>13}{'x tp1':>7}"
          f"{'TTFT max ms':>13}{'x tp1':>7}  tokens vs tp=1's server")
    for r in rows:
        if r.get("error"):
            print(f"{r['model']:<8}{r['tp']:>3}  FAILED: {r['error']}")
            continue
        v = r.get("vs_tp1", {})
        left = f"; LEFT BEHIND {r['left_behind']}" if r["left_behind"] else ""
        print(f"{r['model']:<8}{r['tp']:>3}{r['out_tok_s']:>11.1f}{_f(v.get('out_tok_s'), '.2f'):>7}"
              f"{r['ttft_p50_ms']:>13.1f}{_f(v.get('ttft_p50_ms'), '.2f'):>7}"
              f"{r['ttft_max_ms']:>13.1f}{_f(v.get('ttft_max_ms'), '.2f'):>7}  {_tokens(r)}{left}")


def print_report(report: dict[str, Any]) -> None:
    w = report["workload"]
    print(f"\n{w['num_prompts']} prompts of {w['min_len']}-{w['max_len']} tokens, "
          f"{w['max_new_tokens']} new tokens each, greedy")
    if report["engine"]:
        print_engine(report["engine"])
        print_steps([r for r in report["engine"] if not r.get("error")])
    if report["serve"]:
        print_serve(report["serve"])
    diverged = [(part, r["model"], r["tp"], d) for part in ("engine", "serve")
                for r in report[part] for d in (r.get("tokens_vs_tp1") or {}).get("divergences", [])]
    for part, model, tp, d in diverged:
        print(f"{part} {model} tp={tp}: prompt {d['prompt']} differs from step {d['step']} "
              f"({d['kind']}, tp=1's top-2 gap {_f(d['tp1_top2_gap'], '.2e')}): "
              f"tp=1 {d['tp1']}, this {d['this']}")
