"""FutureMap: placeholders for tokens that an in-flight forward has not produced yet (overlap).

When step N is launched, its batch gets `input_ids = -future_indices` (the one sanctioned use of a
sign as meaning, STYLE.md): slot i of the map will hold row i's next token once step N finishes.
Step N+1 is scheduled meanwhile; right before it runs (on the forward thread, after step N),
`resolve_future` swaps every negative id for the stored token. Index 0 is never handed out, so
every placeholder is strictly negative and every real token id is >= 0.
A placeholder that step N+1 did not consume (N+1 was a prefill step, and the running batch
waits) is swapped on the host once step N's tokens are back (`settle`), so no placeholder
outlives the step after its forward and the ring never laps a slot still waited for, however
many prefill steps come before the next decode.

The slots live on the forward's device, so the token bridge never leaves it: `store` and
`resolve_future` are device work queued on the forward thread, with no host sync.
"""

from __future__ import annotations

import torch


class FutureMap:
    def __init__(self, max_batch: int, device: torch.device | str = "cpu") -> None:
        # Two batches are in flight at most; a ring of 4x the widest batch never laps itself.
        self.size = 4 * max_batch + 1
        self.tokens = torch.zeros(self.size, dtype=torch.int64, device=device)  # [size] slot -> token
        self._next = 1

    def alloc(self, n: int) -> torch.Tensor:
        """Reserve n consecutive slots; returns their indices ([n] int64 on the host, all >= 1)."""
        if n > self.size - 1:
            raise ValueError(f"batch of {n} exceeds the future map ({self.size - 1} slots)")
        if self._next + n > self.size:
            self._next = 1
        idx = torch.arange(self._next, self._next + n, dtype=torch.int64)
        self._next += n
        return idx

    def store(self, indices: torch.Tensor, tokens: torch.Tensor) -> None:
        """tokens [n] (on the map's device) into the n consecutive slots `indices` from alloc."""
        first = int(indices[0])  # a host tensor: no device sync
        self.tokens[first : first + len(indices)] = tokens

    @staticmethod
    def settle(input_ids: torch.Tensor, indices: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """input_ids (host) with the placeholders of the consecutive slots `indices` replaced by
        `tokens` (host: the forward that filled them is done); other ids pass through."""
        slot = -input_ids - int(indices[0])  # [B] position of each id among `indices`
        mine = (input_ids < 0) & (slot >= 0) & (slot < len(indices))
        return torch.where(mine, tokens[slot.clamp(0, len(indices) - 1)], input_ids)

    def resolve_future(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids (on the map's device) with each -index placeholder replaced by the token
        stored at index. Real ids pass through; no host sync, whatever the mix."""
        return torch.where(input_ids < 0, self.tokens[(-input_ids).clamp(min=0)], input_ids)
