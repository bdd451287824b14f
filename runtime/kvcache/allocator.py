"""Page allocator: fixed-size runs of KV slots handed out by index.

A page index means the same slots for its whole lifetime (docs/architecture.md "KV cache layout"):
page p owns slots [p * page_size, (p + 1) * page_size).
"""

from __future__ import annotations


class OutOfPages(RuntimeError):
    pass


class PageAllocator:
    """Free list of page indices. Pure Python: the scheduler's policy runs on it without a device."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"num_pages ({num_pages}) and page_size ({page_size}) must be > 0")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low indices first
        self._used = bytearray(num_pages)

    @property
    def available_pages(self) -> int:
        return len(self._free)

    @property
    def available_tokens(self) -> int:
        return len(self._free) * self.page_size

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._used[p] = 1
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if not self._used[p]:
                raise RuntimeError(f"page {p} freed twice")
            self._used[p] = 0
        self._free.extend(reversed(pages))

    def is_all_free(self) -> bool:
        return len(self._free) == self.num_pages
