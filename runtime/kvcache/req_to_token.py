"""req -> token table: row r holds, for each position of request slot r, its KV slot index."""

from __future__ import annotations

import torch


class ReqToTokenPool:
    def __init__(self, max_reqs: int, max_context: int, device: str | torch.device = "cpu") -> None:
        self.max_reqs = max_reqs
        self.max_context = max_context
        # [max_reqs, max_context] int64: KV slot of each position; stale beyond a request's length
        self.table = torch.zeros((max_reqs, max_context), dtype=torch.int64, device=device)
        self._free = list(range(max_reqs - 1, -1, -1))

    @property
    def available(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        if not self._free:
            raise RuntimeError("no free request slot (raise --max-running-requests)")
        return self._free.pop()

    def free(self, idx: int) -> None:
        if idx in self._free:
            raise RuntimeError(f"request slot {idx} freed twice")
        self._free.append(idx)

    def is_all_free(self) -> bool:
        return len(self._free) == self.max_reqs
