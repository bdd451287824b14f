"""req -> token table: row r holds, for each position of request slot r, its KV slot index.

The table lives with the KV pool (the attention kernels read it). On the CPU the scheduler
writes it directly. On a GPU writing it from the scheduler would cost a copy and a wait per
request, so writes are queued on the host instead, and the next forward takes them
(`take_writes`) and applies them on its own stream, before its attention reads the table.
"""

from __future__ import annotations

import torch


class ReqToTokenPool:
    def __init__(self, max_reqs: int, max_context: int, device: str | torch.device = "cpu",
                 deferred: bool | None = None) -> None:
        """deferred None: writes wait for the next forward off the CPU (True: there too, as
        under tensor parallelism, where each forward carries them to every rank)."""
        self.max_reqs = max_reqs
        self.max_context = max_context
        # [max_reqs + 1, max_context] int64: KV slot of each position; stale beyond a request's
        # length. The last row is never handed out: padding rows of a decode graph use it.
        self.table = torch.zeros((max_reqs + 1, max_context), dtype=torch.int64, device=device)
        self.scratch_row = max_reqs
        self.deferred = deferred or self.table.device.type != "cpu"  # writes wait for the next forward
        self._writes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (rows, cols, slots)
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

    def write(self, rows: torch.Tensor, cols: torch.Tensor, slots: torch.Tensor) -> None:
        """Position cols[i] of row rows[i] lives in slots[i] ([N] int64 host tensors each)."""
        if self.deferred:
            self._writes.append((rows, cols, slots))
        else:
            self.table[rows, cols] = slots

    def take_writes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The writes queued since the last call, as one (rows, cols, slots); None if none."""
        if not self._writes:
            return None
        rows, cols, slots = zip(*self._writes, strict=True)
        self._writes = []
        return torch.cat(rows), torch.cat(cols), torch.cat(slots)

    def apply(self, writes: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None) -> None:
        """On the forward's stream: the queued writes (already on the table's device)."""
        if writes is not None:
            rows, cols, slots = writes
            self.table[rows, cols] = slots
