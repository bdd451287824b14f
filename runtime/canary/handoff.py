"""The KV canary across PD: what travels with a room's pages, and the check on arrival.

Prefill (`outgoing`): the tag and, with --kv-canary-bytes, the byte checksum of each prompt
slot, read from its side tensors (what its forwards wrote, not the bytes as they are now), go
in the aux record; `kv_before_send` fault injection strikes after that, on the last page.
Decode (`arrival_problem`), before `process_prebuilt`: the tags must be the chain of the
decode's own prompt (the prefill computed this request's tokens, in this order), and the bytes
that landed must have the checksums that left; then the tags and checksums become the decode's
own, so its later checks cover the prompt slots too. A KVLayout mismatch at pairing keeps a
side with the canary from pairing with one without.

Under tensor parallelism on either side (ranks.py) the checksums that travel are whole-model
sums, the ranks' partials added up, so they compare whatever the TP of each side; every rank's
landed bytes are checked, and every rank adopts the tags and its own partial sums.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from runtime.canary.chain import ReqChain
from runtime.canary.guard import CanaryGuard
from runtime.canary.monitor import CanaryMonitor
from runtime.canary.ranks import CanaryRanks, Followers


def slots_of(pages: list[int], n: int, page_size: int) -> torch.Tensor:
    """[n] slots of the first n positions of a request holding `pages`."""
    pos = torch.arange(n, dtype=torch.int64)
    return torch.tensor(pages, dtype=torch.int64)[pos // page_size] * page_size + pos % page_size


class HandoffCanary:
    def __init__(self, guard: CanaryGuard, monitor: CanaryMonitor, page_size: int,
                 followers: Followers | None = None) -> None:
        """`guard`: rank 0's; `followers`: under TP, rank 0's line to the other ranks."""
        self.guard, self.monitor, self.page_size = guard, monitor, page_size
        self.ranks = CanaryRanks(guard, followers)

    def outgoing(self, rid: str, pages: list[int], n: int) -> tuple[list[int], list[int] | None,
                                                                    Callable[[], None] | None]:
        """(tags, checksums or None) of the first n slots, and the undo of a fault injected
        into the pages about to be sent (None: none)."""
        tags = self.guard.tags
        slots = slots_of(pages, n, self.page_size)
        sums = self.ranks.sent_sums(slots).tolist() if tags.sums is not None else None
        out = tags.tags[slots.to(tags.tags.device)].tolist()
        undo = None
        strike = self.guard.perturber.before_send(pages[-1:]) if self.guard.perturber else None
        if strike is not None:
            self.ranks.flip(*strike)
            self.monitor.record_injection(rid, "kv_before_send")
            undo = functools.partial(self.ranks.flip, *strike)  # a second flip undoes it
        return out, sums, undo

    def arrival_problem(self, rid: str, prompt: list[int], pages: list[int],
                        tags: list[int] | None, sums: list[int] | None) -> str | None:
        """None if the prompt KV that landed in `pages` is this request's (then it is tagged);
        else why not, counted as a violation."""
        st = self.guard.tags
        slots = slots_of(pages, len(prompt), self.page_size)
        want = ReqChain().cover(prompt, [])
        problem, own_sums = None, None
        if tags is None or (torch.tensor(tags, dtype=torch.int64) != want).any():
            problem = "tag", "the prompt KV that arrived was computed from other tokens"
        elif st.sums is not None:
            ok, own_sums = self.ranks.landed_matches(slots, sums)
            if not ok:
                problem = "bytes", "prompt KV bytes changed in transfer"
        if problem is not None:
            return self.monitor.violation(rid, *problem)
        self.ranks.keep(slots, want, own_sums)
        return None
