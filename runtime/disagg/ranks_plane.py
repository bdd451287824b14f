"""The KV plane of a server with several TP ranks: rank 0 decides, every rank moves its own heads.

One control plane, one data plane per rank. The bootstrap server, room tickets, the rooms and
their state machines stay on rank 0 (runtime/disagg/prefill.py, decode.py), untouched. Each
follower rank (runtime/scheduler/ranks.py) opens a plane of its own over its pool when rank 0
opens its own (`open_followers`): a writer on every server, and on a decode a KV receiver with
its own port and its own write fence. Rank 0 reaches them by calls on the socket it shares
with each; they answer and report events on it.

A prefill room (KVSender, runtime/disagg/sender.py): after the claim, rank 0 has every rank write
its shares (runtime/disagg/shares.py) to the decode ranks that hold those heads, each over its
own authenticated link, and sends the room's RoomDone on its own link once every rank's writes
are done. A decode room: rank 0's fence (`LeaderFence`) tells every follower's fence
(`FollowerFence`) the room's pages, prefill and shares when it binds the room to its prefill
(before the prefill may know the pages); each follower admits only those shares, and reports
"written" once all of them landed; the room arrives when rank 0's own shares, the RoomDone and
every follower's report are in. A revoke reaches every follower, and the pages are freed only
once each has said that nothing lands there any more ("closed").
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict
from typing import Any

from runtime.auth.key import load_cluster_key
from runtime.disagg.fence import WriteFence
from runtime.disagg.interfaces import RankCalls
from runtime.disagg.receiver import KVReceiver
from runtime.disagg.sender import KVSender
from runtime.disagg.shares import Share
from runtime.disagg.tally import Forwarded, Tally
from runtime.disagg.transfer.base import KVTransfer, TransferError, create_transfer
from runtime.disagg.wire import KVLayout, PeerRegistration
from runtime.kvcache.pool import KVPool

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 10.0  # a follower answers a fence call at once; a write has SEND_TIMEOUT_S


def open_followers(ranks: RankCalls, role: str, name: str, layout: KVLayout, backend: str,
                   bind: tuple[str, int], advertise: str,
                   key_file: str | None) -> tuple[list[list[Any]], list[dict[str, Any]]]:
    """Open every follower's plane (prefill: a writer; decode: also a receiver on bind[0],
    port bind[1] + rank, or any free port when bind[1] is 0); on a decode, the followers'
    receivers as peers reach them, [advertise, port], and their backends' connection info."""
    host, kv_port = bind
    futures = [ranks.call(rank, "open", role, name, asdict(layout), backend, host,
                          kv_port + rank if kv_port else 0, key_file) for rank in ranks.followers]
    opened = [_answer(f, rank, "open its KV plane") for rank, f in zip(ranks.followers, futures,
                                                                       strict=True)]
    if role != "decode":
        return [], []
    return [[advertise, int(port)] for port, _ in opened], [info for _, info in opened]


def close_links_everywhere(ranks: RankCalls) -> Callable[[str], None]:
    """What decode rank 0's receiver does when it breaks off a prefill's links (declared gone):
    every follower's receiver breaks off that prefill's links too, so no share of its stays
    landing there (a frozen prefill's would hold its room's pages)."""
    def close(prefill: str) -> None:
        for rank in ranks.followers:
            ranks.call(rank, "close_links", prefill)
    return close


def _answer(future: Future[Any], rank: int, what: str) -> Any:
    try:
        return future.result(CALL_TIMEOUT_S)
    except Exception as e:  # RuntimeError from the follower, TimeoutError from the wait
        raise TransferError(f"TP rank {rank} could not {what}: {e}") from e


class LeaderFence(WriteFence):
    """Decode rank 0's fence: its own shares, and its followers' through their reports."""

    def __init__(self, on_arrival: Callable[[], None], ranks: RankCalls,
                 tally: Tally | None = None) -> None:
        """`tally`: rank 0's, where the followers' receivers' counts go (refused writes, bad
        links)."""
        super().__init__(on_arrival)
        self.ranks, self.tally = ranks, tally
        self.told: set[int] = set()  # rooms the followers were told of (under the lock)
        ranks.on_event = self._event

    def bind_peer(self, room: int, peer: str, shares: list[Share] | None = None) -> bool:
        """Rank 0's binding, then every follower's (the room's pages, prefill and shares), in
        full before the caller hands the prefill the pages; TransferError when one fails."""
        if not super().bind_peer(room, peer, shares):
            return False
        with self._lock:
            e = self._rooms.get(room)
            if e is None:
                return False
            pages = list(e.pages)
            e.others = set(self.ranks.followers)
            self.told.add(room)
        futures = [self.ranks.call(d, "expect", room, pages, peer, shares)
                   for d in self.ranks.followers]
        for d, future in zip(self.ranks.followers, futures, strict=True):
            _answer(future, d, f"take room {room}")
        return True

    def revoke(self, room: int) -> bool:
        with self._lock:
            e = self._rooms.get(room)
            first = e is not None and not e.revoked and room in self.told
            if first:
                assert e is not None
                e.unclosed = set(self.ranks.followers)
        closed = super().revoke(room)
        if first:
            for d in self.ranks.followers:
                future = self.ranks.call(d, "revoke", room)
                future.add_done_callback(functools.partial(self._revoked, room, d))
        return closed

    def _revoked(self, room: int, rank: int, future: Future[Any]) -> None:
        # True: nothing lands there; else its "closed" event follows once its write is over
        if future.exception() is None and future.result():
            self._closed(room, rank)

    def discard(self, room: int) -> None:
        super().discard(room)
        with self._lock:
            told = room in self.told
            self.told.discard(room)
        if told:
            for d in self.ranks.followers:
                self.ranks.call(d, "discard", room)

    def _event(self, rank: int, name: str, args: tuple[Any, ...]) -> None:
        if name == "tally":
            if self.tally is not None:
                self.tally.add(*args)
        elif name == "written":
            self._written(args[0], rank)
        elif name == "closed":
            self._closed(args[0], rank)

    def _written(self, room: int, rank: int) -> None:
        with self._lock:
            e = self._rooms.get(room)
            if e is None:
                return
            e.others.discard(rank)
            wake = self._release(room, e)
        if wake:
            self.on_arrival()

    def _closed(self, room: int, rank: int) -> None:
        with self._lock:
            e = self._rooms.get(room)
            if e is None:
                return
            e.unclosed.discard(rank)
            wake = e.revoked and not e.unclosed
        if wake:
            self.on_arrival()  # the decode role may free the pages now


class FollowerFence(WriteFence):
    """A follower decode rank's fence: told each room by rank 0, reporting back to it."""

    def __init__(self, rank: int, report: Callable[[str, int], None]) -> None:
        super().__init__(rank=rank)
        self.report = report

    def landed(self, room: int, complete: bool, source: int = 0) -> None:
        super().landed(room, complete, source)
        with self._lock:
            e = self._rooms.get(room)
            event = None
            if e is not None and e.revoked and not e.landing:
                event = "closed"
            elif e is not None and complete and e.sources <= e.written:
                event = "written"
        if event is not None:
            self.report(event, room)


class FollowerPlane:
    """A follower rank's plane: its writer, and on a decode its receiver and fence."""

    def __init__(self, transfer: KVTransfer, sender: KVSender, receiver: KVReceiver | None) -> None:
        self.transfer, self.sender, self.receiver = transfer, sender, receiver
        self.fence = transfer.fence

    @classmethod
    def open(cls, pool: KVPool, rank: int, event: Callable[..., None], role: str, name: str,
             layout: dict[str, Any], backend: str, host: str, port: int,
             key_file: str | None) -> FollowerPlane:
        key = load_cluster_key(key_file)
        def report(what: str, room: int) -> None:
            event(what, (room,))

        fence = FollowerFence(rank, report)
        transfer = create_transfer(backend, pool, name, fence, KVLayout(**layout), rank)
        receiver = None
        if role == "decode":
            counts = Forwarded(lambda kind, n: event("tally", (kind, n)))  # into rank 0's
            receiver = KVReceiver(host, port, transfer, key, name, lambda: None, counts)
            receiver.start()
        log.info("TP rank %d: KV plane open (%s%s)", rank, backend,
                 f", receiver on port {receiver.port}" if receiver else "")
        return cls(transfer, KVSender(transfer, key), receiver)

    @property
    def reached(self) -> tuple[int | None, dict[str, Any]]:
        """How peers reach this rank: its receiver's port (a decode's), its backend's info."""
        port = self.receiver.port if self.receiver is not None else None
        return port, self.transfer.local_info()

    # ---- rank 0's calls -------------------------------------------------------------------
    def expect(self, room: int, pages: list[int], peer: str, shares: list[Share] | None) -> None:
        self.fence.expect(room, pages, peer)
        self.fence.bind_peer(room, peer, shares)

    def revoke(self, room: int) -> bool:
        return self.fence.revoke(room)

    def discard(self, room: int) -> None:
        self.fence.discard(room)

    def close_links(self, prefill: str) -> None:
        if self.receiver is not None:
            self.receiver.close_links(prefill)

    def forget(self, decode: str) -> None:
        """A prefill's: drop what its backend set up to reach `decode` (gone or replaced)."""
        self.transfer.forget(decode)

    def write(self, room: int, peer: dict[str, Any], src_pages: list[int], dst_pages: list[int],
              shares: list[Share]) -> int:
        return self.sender.write_shares(PeerRegistration(**peer), room, src_pages, dst_pages, shares)

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
        self.sender.close()
        self.transfer.close()
