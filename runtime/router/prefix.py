"""Which prefill last served a prompt prefix: a bounded, char-level prefix-hash map.

A prompt is cut into blocks of `block` characters; the prefix ending at block k is named by a
hash chained over blocks 0..k. The map keeps the most recently used `capacity` prefix hashes
(LRU) and the prefill URL that served each, so the longest remembered prefix of a new prompt is
one dict lookup per block. Hashes are Python's (salted per process): the map lives only as long
as the router process, like the workers' own prefix caches it approximates.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container

BLOCK_CHARS = 16


def block_hashes(text: str, block: int = BLOCK_CHARS) -> list[int]:
    """One hash per full block: entry k names text[: (k + 1) * block]."""
    hashes, h = [], 0
    for start in range(0, len(text) - block + 1, block):
        h = hash((h, text[start:start + block]))
        hashes.append(h)
    return hashes


class PrefixIndex:
    def __init__(self, capacity: int, block: int = BLOCK_CHARS):
        self.capacity, self.block = capacity, block
        self.owner: OrderedDict[int, str] = OrderedDict()  # prefix hash -> worker URL

    def match(self, text: str, candidates: Container[str]) -> tuple[str | None, int]:
        """The candidate that served the longest remembered prefix of `text`, and that
        prefix's length in characters; (None, 0) when none did."""
        hashes = block_hashes(text, self.block)
        for k in range(len(hashes) - 1, -1, -1):
            url = self.owner.get(hashes[k])
            if url is not None and url in candidates:
                return url, (k + 1) * self.block
        return None, 0

    def record(self, text: str, url: str) -> None:
        """`url` now holds every prefix of `text` (the most recent owner wins)."""
        for h in block_hashes(text, self.block):
            self.owner[h] = url
            self.owner.move_to_end(h)
        while len(self.owner) > self.capacity:
            self.owner.popitem(last=False)

    def __len__(self) -> int:
        return len(self.owner)
