"""What each prefill worker's prefix cache holds, followed from its KV events.

For every prefill worker the router keeps one `GET /kv_events` stream open
(runtime/server/kv_events.py): a snapshot of the block hashes its cache holds, then each block
stored or removed. A stream that breaks (the worker died, restarted, or cut us off for lagging)
drops what we knew of it, and the follower reconnects with a backoff; the new snapshot is the
truth again. A worker that keeps no cache (503 `no_kv_events`) is asked again rarely.

Block hashes are `runtime.kvcache.radix.block_hashes` of the prompt's token ids at the
worker's page size, from the root of the request's cache salt: the same function on both sides,
so a prompt's k-th hash is in a worker's set exactly when that worker holds the KV of the
prompt's first k pages for requests of that salt.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx

from runtime.kvcache.radix import block_hashes

log = logging.getLogger("baton.router")

RETRY_S = (0.2, 0.5, 1.0, 2.0, 5.0)  # reconnect backoff, then every 5 s
NO_CACHE_RETRY_S = 30.0
PENDING_S = 10.0  # a routed prompt's blocks count as the worker's this long before its events
PENDING_SWEEP = 65536
SILENCE_S = 45.0  # no event nor keep-alive (every 15 s) for this long: a frozen worker


@dataclass
class WorkerBlocks:
    instance: str
    page_size: int
    seq: int
    blocks: set[int] = field(default_factory=set)


class KVIndex:
    def __init__(self, pending_s: float = PENDING_S) -> None:
        self.workers: dict[str, WorkerBlocks] = {}
        # blocks a request routed to a worker will store there, before its events say so: a
        # burst of prompts sharing a prefix then sticks to one worker instead of spreading
        self.pending: dict[str, dict[int, float]] = {}
        self.pending_s = pending_s

    def expect(self, url: str, ids: Sequence[int], salt: str | None = None) -> None:
        """A request with these prompt ids was just routed to `url`."""
        known = self.workers.get(url)
        if known is None:
            return
        until = time.monotonic() + self.pending_s
        pending = self.pending.setdefault(url, {})
        for h in block_hashes(ids, known.page_size, salt):
            pending[h] = until

    def apply(self, url: str, event: dict[str, object]) -> None:
        """One event of `url`'s stream; raises ValueError on one that does not follow."""
        kind = event.get("type")
        blocks = event.get("blocks")
        seq = event.get("seq")
        if not isinstance(blocks, list) or not isinstance(seq, int):
            raise ValueError(f"malformed KV event from {url}: {event!r}")
        if kind == "snapshot":
            page_size, instance = event.get("page_size"), event.get("instance")
            if not isinstance(page_size, int) or page_size < 1:
                raise ValueError(f"snapshot from {url} without a page size")
            self.workers[url] = WorkerBlocks(str(instance), page_size, seq, set(blocks))
            return
        known = self.workers.get(url)
        if known is None:
            raise ValueError(f"KV event from {url} before its snapshot")
        if seq != known.seq + len(blocks):
            raise ValueError(f"KV events from {url} skipped: at {known.seq}, got {seq}")
        known.seq = seq
        if kind == "stored":
            known.blocks.update(blocks)
        elif kind == "removed":
            known.blocks.difference_update(blocks)
        else:
            raise ValueError(f"unknown KV event {kind!r} from {url}")

    def drop(self, url: str) -> None:
        self.workers.pop(url, None)
        self.pending.pop(url, None)

    def cached_tokens(self, url: str, ids: Sequence[int], salt: str | None = None) -> int:
        """How many leading tokens of `ids` the worker at `url` holds KV for, or will once the
        requests just routed there are prefilled (full pages)."""
        known = self.workers.get(url)
        if known is None:
            return 0
        pending, now, matched = self.pending.get(url, {}), time.monotonic(), 0
        for h in block_hashes(ids, known.page_size, salt):
            if h not in known.blocks and pending.get(h, 0.0) < now:
                break
            matched += 1
        if len(pending) > PENDING_SWEEP:  # forget what expired
            self.pending[url] = {h: t for h, t in pending.items() if t >= now}
        return matched * known.page_size

    def view(self) -> dict[str, dict[str, object]]:
        return {url: {"instance": w.instance, "page_size": w.page_size, "seq": w.seq,
                      "blocks": sorted(w.blocks)} for url, w in self.workers.items()}


async def follow(client: httpx.AsyncClient, index: KVIndex, url: str) -> None:
    """Keep `url`'s view in `index` up to date until cancelled."""
    failures = 0
    while True:
        wait = RETRY_S[min(failures, len(RETRY_S) - 1)]
        try:
            async with client.stream("GET", f"{url}/kv_events",
                                     timeout=httpx.Timeout(SILENCE_S, connect=5.0)) as resp:
                if resp.status_code != 200:
                    if b"no_kv_events" in await resp.aread():  # it keeps no cache: for good
                        wait = NO_CACHE_RETRY_S
                    raise httpx.HTTPStatusError(f"HTTP {resp.status_code}", request=resp.request,
                                                response=resp)
                async for line in resp.aiter_lines():
                    if line.startswith("data: "):
                        index.apply(url, json.loads(line[6:]))
                        failures = 0
        except asyncio.CancelledError:
            index.drop(url)
            raise
        except (httpx.HTTPError, ValueError) as e:
            log.debug("KV events of %s: %s; again in %.1f s", url, e, wait)
        index.drop(url)  # what we knew may be stale now: the next snapshot says
        failures += 1
        await asyncio.sleep(wait)
