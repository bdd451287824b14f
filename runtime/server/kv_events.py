"""KV events: which KV blocks this worker's prefix cache holds, as a stream a router follows.

The scheduler reports each page the cache takes in or lets go (`KVEvents`, in order); this log,
in the HTTP process, keeps the resulting set of block hashes and numbers every change. A
subscriber (`GET /kv_events`, server-sent events) first gets a snapshot of the whole set with
the sequence number it stands at, then every change after it, so a router that connects late,
or reconnects after a gap, converges to the truth. A subscriber that falls more than
`SUBSCRIBER_BACKLOG` batches behind is cut off: it reconnects and starts from a new snapshot
rather than the log buffering without bound.

Blocks are named by `runtime.kvcache.radix.block_hash`: blake2b chained over the page's token
ids and its parent's hash, so a hash stands for the whole prefix up to its page.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from runtime.kvcache.radix import STORED

SUBSCRIBER_BACKLOG = 1024


@dataclass(eq=False)
class Subscription:
    queue: asyncio.Queue[dict[str, Any] | None]


class KVEventLog:
    def __init__(self, page_size: int, instance: str) -> None:
        self.page_size = page_size
        self.instance = instance  # changes when the worker restarts: a router drops what it knew
        self.blocks: set[int] = set()
        self.seq = 0
        self._subscribers: set[Subscription] = set()

    def apply(self, events: list[list[int]]) -> None:
        """[kind, hash] pairs in the order they happened (kind: STORED or REMOVED)."""
        if not events:
            return
        batches: list[dict[str, Any]] = []
        for kind, block in events:
            if kind == STORED:
                self.blocks.add(block)
            else:
                self.blocks.discard(block)
            name = "stored" if kind == STORED else "removed"
            self.seq += 1
            if batches and batches[-1]["type"] == name:
                batches[-1]["blocks"].append(block)
                batches[-1]["seq"] = self.seq
            else:
                batches.append({"type": name, "seq": self.seq, "blocks": [block]})
        for sub in list(self._subscribers):
            for batch in batches:
                self._offer(sub, batch)

    def snapshot(self) -> dict[str, Any]:
        return {"type": "snapshot", "seq": self.seq, "instance": self.instance,
                "page_size": self.page_size, "blocks": sorted(self.blocks)}

    def subscribe(self) -> tuple[dict[str, Any], Subscription]:
        """The snapshot and, atomically with it (one event loop), the changes after it."""
        sub = Subscription(asyncio.Queue(SUBSCRIBER_BACKLOG))
        self._subscribers.add(sub)
        return self.snapshot(), sub

    def unsubscribe(self, sub: Subscription) -> None:
        self._subscribers.discard(sub)

    def close(self) -> None:
        """The server stops: every stream ends."""
        for sub in list(self._subscribers):
            self._end(sub)

    def _offer(self, sub: Subscription, batch: dict[str, Any]) -> None:
        try:
            sub.queue.put_nowait(batch)  # complete by now: subscribers share it
        except asyncio.QueueFull:
            self._end(sub)

    def _end(self, sub: Subscription) -> None:
        self._subscribers.discard(sub)
        while True:  # make room for the end marker
            try:
                sub.queue.put_nowait(None)
                return
            except asyncio.QueueFull:
                sub.queue.get_nowait()
