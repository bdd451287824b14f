"""The KV canary over tensor-parallel ranks, for what crosses servers (handoff.py).

Every rank keeps and checks its own tags and partial byte sums during serving (slots.py,
kvsum.py; guard.py joins their violations). What a PD hand-off needs of them goes through rank 0:

    prefill  the sums that leave: the sum over the counted ranks (kvsum.HeadSplit.counted) of
             each rank's kept partials, the whole-model sums whatever either side's TP
    decode   the sums that landed: every rank's partials of the bytes now in the slots; the
             counted ranks' add up to what left, and a copy (a KV head on several ranks) equals
             its owner's, so a fault in any rank's pages is seen. After a clean arrival every
             rank keeps its own landed partials and the tags, so its later checks pass
    perturb  kv_before_send's element flipped on the rank it names (perturb.py), and back

`RankCanary` is one rank's side; a follower serves it on the KV call socket it shares with
rank 0 (runtime/scheduler/ranks.py, ops "canary.<name>" for the names in `RankCanary.OPS`).
`CanaryRanks` is rank 0's: its own side and the followers' through those calls, in rank order.
One rank is the case of no followers.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Protocol

import torch

from runtime.canary.guard import CanaryGuard
from runtime.canary.perturb import Element, flip

CALL_TIMEOUT_S = 10.0  # a follower answers a canary call at once, on its KV call thread


class RankCanary:
    """One rank's SlotTags and pool, as rank 0 asks about them (tensors on the CPU)."""

    OPS = ("kept", "landed", "keep", "flip")

    def __init__(self, guard: CanaryGuard) -> None:
        self.guard = guard

    def kept(self, slots: torch.Tensor) -> torch.Tensor:
        """[N] the partial sums this rank's forwards wrote for slots [N]."""
        st = self.guard.tags
        assert st.slot_sums is not None, "byte checksums are off"
        return st.slot_sums[slots.to(st.tags.device)].cpu()

    def landed(self, slots: torch.Tensor) -> torch.Tensor:
        """[N] the partial sums of the bytes in slots [N] now."""
        st = self.guard.tags
        assert st.sums is not None, "byte checksums are off"
        return st.sums.of(slots.to(st.tags.device)).cpu()

    def keep(self, slots: torch.Tensor, tags: torch.Tensor,
             sums: torch.Tensor | None = None) -> None:
        """The KV in slots [N] arrived clean: its tags [N] are these, its sums the landed ones
        (`sums` when known, else summed now)."""
        st = self.guard.tags
        slots = slots.to(st.tags.device)
        st.tags[slots] = tags.to(st.tags.device)
        if st.sums is not None and st.slot_sums is not None:
            st.slot_sums[slots] = st.sums.of(slots) if sums is None else sums.to(slots.device)

    def flip(self, element: Element) -> None:
        """Flip the sign of one element of this rank's pool (kv_before_send, and its undo)."""
        assert self.guard.perturber is not None, "fault injection is off"
        flip(self.guard.perturber.buffer, element)


class Followers(Protocol):
    """Rank 0's line to its followers (runtime/scheduler/ranks.py `Ranks`)."""

    @property
    def followers(self) -> range: ...

    def call(self, rank: int, op: str, *args: Any) -> Future[Any]: ...


class CanaryRanks:
    def __init__(self, guard: CanaryGuard, followers: Followers | None = None) -> None:
        self.own, self.followers = RankCanary(guard), followers
        sums = guard.tags.sums
        self.split = sums.split if sums is not None else None

    def _each(self, op: str, *args: Any) -> list[Any]:
        """`op`'s answer on every rank, rank 0's first."""
        if self.followers is None:
            return [getattr(self.own, op)(*args)]
        futures = [self.followers.call(r, f"canary.{op}", *args) for r in self.followers.followers]
        return [getattr(self.own, op)(*args), *(f.result(CALL_TIMEOUT_S) for f in futures)]

    def sent_sums(self, slots: torch.Tensor) -> torch.Tensor:
        """[N] the whole-model sums of slots [N] as the ranks' forwards wrote them."""
        assert self.split is not None
        parts = self._each("kept", slots.cpu())
        return torch.stack([parts[r] for r in self.split.counted]).sum(0)

    def landed_matches(self, slots: torch.Tensor,
                       sums: list[int] | None) -> tuple[bool, torch.Tensor | None]:
        """Whether the bytes now in slots [N] have the whole-model sums `sums` (None: none were
        sent), every copy of a head included; and rank 0's partials of them."""
        split = self.split
        assert split is not None
        if sums is None:
            return False, None
        parts = self._each("landed", slots.cpu())
        total = torch.stack([parts[r] for r in split.counted]).sum(0)
        ok = bool((total == torch.tensor(sums, dtype=torch.int64)).all())
        ok = ok and all(bool((parts[r] == parts[split.owner(r)]).all()) for r in range(split.size))
        return ok, parts[0]

    def keep(self, slots: torch.Tensor, tags: torch.Tensor, own_sums: torch.Tensor | None) -> None:
        """Every rank keeps the tags and its landed sums of slots (rank 0's: `own_sums`)."""
        slots, tags = slots.cpu(), tags.cpu()
        futures = [] if self.followers is None else [
            self.followers.call(r, "canary.keep", slots, tags) for r in self.followers.followers]
        self.own.keep(slots, tags, own_sums)
        for f in futures:
            f.result(CALL_TIMEOUT_S)

    def flip(self, rank: int, element: Element) -> None:
        if rank == 0:
            self.own.flip(element)
        else:
            assert self.followers is not None
            self.followers.call(rank, "canary.flip", element).result(CALL_TIMEOUT_S)


def serve(canary: RankCanary | None, op: str, args: tuple[Any, ...]) -> Any:
    """A follower's answer to rank 0's call `op` ("canary.<name>")."""
    name = op.removeprefix("canary.")
    if canary is None or name not in RankCanary.OPS:
        raise ValueError(f"no KV canary call {op!r} here")
    return getattr(canary, name)(*args)
