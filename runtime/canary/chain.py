"""The token chain: the tag a KV slot carries, named by the tokens up to its position.

    tag(p) = sum over j <= p of term(token_j, j)    (int64, wrapping)
    term(t, j) = splitmix64 finalizer of ((j << 32) | t) + golden

A slot's KV depends on exactly the tokens at and before its position, and so does its tag: two
requests whose tokens agree up to p carry the same tag at p (a page the prefix cache shares is
right for every reader), and KV that belongs to another request or another position carries
another tag (a collision is a 2^-64 chance). The terms are independent, so a run of tokens is
tagged with one cumsum: O(new tokens), vectorised, with no per-token Python.
"""

from __future__ import annotations

import torch

from runtime.canary.oracle import GOLDEN, _signed, mix64

_GOLDEN = _signed(GOLDEN)


def terms(tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[T] int64 terms of tokens [T] at positions [T] (token ids < 2^32)."""
    return mix64(((positions << 32) | tokens) + _GOLDEN)


def chain(prev: int, tokens: torch.Tensor, start: int) -> torch.Tensor:
    """[T] tags of tokens [T] at positions start.., after a chain whose last tag is `prev`
    (0 at position 0)."""
    positions = torch.arange(start, start + len(tokens), dtype=torch.int64, device=tokens.device)
    return terms(tokens, positions).cumsum(0) + prev


def segmented_chain(prev: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                    lens: torch.Tensor) -> torch.Tensor:
    """Tags of a flat batch: segment b holds lens[b] tokens following a chain ending in prev[b].
    prev, lens: [B] int64; tokens, positions: [T] int64 with T = lens.sum()."""
    t = terms(tokens, positions)
    total = t.cumsum(0)  # [T]
    starts = lens.cumsum(0) - lens  # [B] index of each segment's first token
    before = (total - t)[starts.clamp(max=max(len(t) - 1, 0))] if len(t) else prev  # [B]
    offset = torch.repeat_interleave(prev - before, lens, output_size=len(t))  # [T]
    return total + offset


class ReqChain:
    """One request's chain, [n] tags of its first n tokens, grown as its tokens grow (amortised
    O(new tokens): the buffer doubles)."""

    def __init__(self) -> None:
        self.buf = torch.empty(0, dtype=torch.int64)
        self.n = 0

    def cover(self, prompt: list[int], output: list[int]) -> torch.Tensor:
        """The tags of prompt + output ([len] int64; a view, valid until the next call)."""
        total = len(prompt) + len(output)
        if total > self.n:
            new = prompt[self.n:] + output[max(0, self.n - len(prompt)):]
            prev = int(self.buf[self.n - 1]) if self.n else 0
            if total > len(self.buf):
                grown = torch.empty(max(total, 2 * len(self.buf)), dtype=torch.int64)
                grown[: self.n] = self.buf[: self.n]
                self.buf = grown
            self.buf[self.n : total] = chain(prev, torch.tensor(new, dtype=torch.int64), self.n)
            self.n = total
        return self.buf[:total]
