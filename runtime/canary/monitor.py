"""CanaryMonitor: the scheduler's side of the KV canary (the runner's is SlotTags).

Per forward it says what to check (`inputs`): on every prefill, and on every `sweep`-th decode
step, each request's positions whose tokens the host knows (in overlap mode the newest input
token is still on its way and is checked the step after), with the tags expected from the
request's own prompt + output (its ReqChain, grown by the new tokens only). It also marks the
rows fault injection may hit: requests certain to run more forwards, hit at most once.

Per result it reads the violations (`verdicts`): counts them (CanaryStats), logs the first few,
and in `raise` mode returns, per offending row, the message its request ends with.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from runtime.canary.chain import ReqChain
from runtime.canary.slots import VIOLATION_KINDS
from runtime.config import CanaryConfig
from runtime.forward_batch import CanaryInputs, ForwardOutput
from runtime.messages import CanaryStats

log = logging.getLogger(__name__)

LOGGED_VIOLATIONS = 10  # `log` mode: violations logged one by one; later ones are only counted
_WHAT = {
    "tag": "{n} of its KV slots hold KV of other tokens or positions",
    "bytes": "{n} of its KV slots changed since they were written",
    "token": "its input token is not the token oracle's",
}


class Checked(Protocol):
    """What the monitor reads of a request (Req satisfies it)."""

    rid: str
    origin_input_ids: list[int]
    output_ids: list[int]
    kv: Any  # its KVSlots (runtime/kvcache/manager.py): .length positions have slots
    hand_off: bool
    sampling_params: Any
    canary_chain: Any  # its ReqChain, made here


class CanaryMonitor:
    def __init__(self, config: CanaryConfig, context_len: int) -> None:
        self.raising = config.kv_canary == "raise"
        self.sweep = config.kv_canary_sweep
        self.perturbing = bool(config.perturb)
        self.context_len = context_len
        self.steps = 0
        self.stats = CanaryStats()
        self.injected: dict[str, str] = {}  # rid -> perturb kind (kept while perturbing only)
        self.caught: dict[str, str] = {}  # rid -> message (kept while perturbing only)
        self.logged = 0

    def inputs(self, reqs: Sequence[Checked], extend: bool) -> CanaryInputs:
        self.steps += not extend  # decode steps, which the sweep thins out
        rows, positions, expected = [], [], []
        if extend or self.steps % self.sweep == 0:
            for i, r in enumerate(reqs):
                if r.canary_chain is None:
                    r.canary_chain = ReqChain()
                tags = r.canary_chain.cover(r.origin_input_ids, r.output_ids)
                n = min(len(tags), r.kv.length)
                rows.append(torch.full((n,), i, dtype=torch.int64))
                positions.append(torch.arange(n, dtype=torch.int64))
                expected.append(tags[:n])
            self.stats.checks += len(reqs)
        ok = (torch.tensor([self._may_perturb(r) for r in reqs], dtype=torch.bool)
              if self.perturbing else torch.zeros(len(reqs), dtype=torch.bool))
        if not rows:
            empty = torch.empty(0, dtype=torch.int64)
            return empty, empty, empty, ok
        return torch.cat(rows), torch.cat(positions), torch.cat(expected), ok

    def _may_perturb(self, r: Checked) -> bool:
        """Certain to run two more forwards (so a fault is read and checked) and not hit yet."""
        sp = r.sampling_params
        seq = len(r.origin_input_ids) + len(r.output_ids)
        return (not r.hand_off and sp.ignore_eos and not sp.stop
                and not sp.stop_token_ids and sp.max_new_tokens - len(r.output_ids) >= 3
                and seq + 3 < self.context_len and r.rid not in self.injected)

    def verdicts(self, reqs: Sequence[Checked], out: ForwardOutput,
                 live: Sequence[bool]) -> dict[int, str]:
        """Rows to end (raise mode), with their message; counts and logs every violation.
        Rows not `live` are skipped: their request ended or was retracted while the forward
        ran, so their slots may be someone else's by now, and their result is dropped."""
        for row, kind in out.injections or []:
            if live[row]:
                self.record_injection(reqs[row].rid, kind)
        found = out.canary_violations
        if found is None:
            return {}
        ended = {}
        for row in found.sum(1).nonzero().flatten().tolist():
            if not live[row]:
                continue
            counts = dict(zip(VIOLATION_KINDS, found[row].tolist(), strict=True))
            what = "; ".join(_WHAT[k].format(n=n) for k, n in counts.items() if n)
            for kind, n in counts.items():
                if n:
                    self.stats.violations[kind] = self.stats.violations.get(kind, 0) + 1
            self._log(reqs[row].rid, what)
            if self.raising:
                ended[row] = f"KV canary: {what}; the request was ended rather than answer from it"
                if self.perturbing:
                    self.caught[reqs[row].rid] = ended[row]
        return ended

    def record_injection(self, rid: str, kind: str) -> None:
        if rid not in self.injected:
            self.injected[rid] = kind
            self.stats.injections[kind] = self.stats.injections.get(kind, 0) + 1

    def violation(self, rid: str, kind: str, what: str) -> str:
        """One found outside a forward (KV arriving from a prefill): counted and logged; the
        message to end the request with (in log mode too: the request never started)."""
        self.stats.violations[kind] = self.stats.violations.get(kind, 0) + 1
        self._log(rid, what)
        message = f"KV canary: {what}; the request was ended rather than answer from it"
        if self.perturbing:
            self.caught[rid] = message
        return message

    def _log(self, rid: str, what: str) -> None:
        self.logged += 1
        if self.logged <= LOGGED_VIOLATIONS:
            log.error("KV canary violation in request %s: %s", rid, what)
        if self.logged == LOGGED_VIOLATIONS:
            log.error("KV canary: further violations are counted, not logged")
