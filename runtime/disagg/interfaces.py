"""What the prefill and decode roles need of a request and of the scheduler.

Structural types, so disagg/ depends on kvcache/ only (docs/architecture.md "Dependency directions":
scheduler -> disagg); the scheduler's Req, Scheduler and Handoffs satisfy them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Literal, Protocol, Self, TypeVar

from runtime.handover import Bootstrap, KVOffer
from runtime.kvcache.manager import KVHolder


class TokenEntries(Protocol):
    """A request's per-token outputs beyond the ids (runtime/scheduler/req.py TokenLog)."""

    def at(self, i: int) -> tuple[float | None, list[tuple[int, float]] | None,
                                  dict[str, Any]]: ...


class PDRequest(KVHolder, Protocol):
    rid: str
    origin_input_ids: list[int]
    output_ids: list[int]
    bootstrap: Bootstrap | None
    cached_tokens: int  # prompt tokens found in the prefill's prefix cache
    movable: bool  # decode role: its client can follow it to another decode

    @property
    def log(self) -> TokenEntries: ...

    @property
    def bootstrap_room(self) -> int | None: ...

    @property
    def finished(self) -> bool: ...

    def append_token(
        self,
        token: int,
        logprob: float | None = None,
        top_logprobs: list[tuple[int, float]] | None = None,
        info: dict[str, Any] | None = None,
    ) -> None: ...

    def finish(self, kind: Literal["length", "abort"], message: str | None = None) -> None: ...

    def hand_off_after_prompt(self) -> None: ...

    def split_off(self, rid: str, room: int, offer: KVOffer) -> Self: ...


R = TypeVar("R", bound=PDRequest)
R_in = TypeVar("R_in", bound=PDRequest, contravariant=True)  # a port that only takes requests


class SchedulerPort(Protocol[R_in]):
    def add_request(self, req: R_in) -> None: ...

    def validate(self, req: R_in) -> None: ...

    def abort(self, rid: str, message: str = "aborted") -> bool: ...


class HandoffPort(Protocol[R]):
    """The scheduler's PD edge (runtime/scheduler/handoff.py)."""

    def process_prebuilt(self, reqs: list[R]) -> list[R]: ...

    def take_handed_off(self) -> list[R]: ...

    def can_reserve(self, req: R, incoming: Sequence[R] = ()) -> bool: ...

    def kv_fence(self) -> int: ...

    def fence_passed(self, fence: int) -> bool: ...


class RankCalls(Protocol):
    """Rank 0's line to its TP followers' KV planes (runtime/scheduler/ranks.py `Ranks`;
    runtime/disagg/ranks_plane.py)."""

    on_event: Callable[[int, str, tuple[Any, ...]], None]

    @property
    def followers(self) -> range: ...

    def call(self, rank: int, op: str, *args: Any) -> Future[Any]: ...
