"""Token oracle: token = splitmix64(id XOR position) mod vocab, id = room if >= 0 else rid hash.

`position` is the position the sampled token takes in the sequence (the prompt length for the
first token). Prefill samples the first token and decode the rest; both compute the same sequence
from (room, position) alone, so a request that got another's KV or first token is caught.
The Python and torch versions agree bit for bit (tests/canary).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the scalar functions serve without torch (the router's probes)
    import torch

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
_C1, _C2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def splitmix64(x: int) -> int:
    """The splitmix64 output for state x, as an unsigned 64-bit int."""
    z = (x + GOLDEN) & MASK64
    z = ((z ^ (z >> 30)) * _C1) & MASK64
    z = ((z ^ (z >> 27)) * _C2) & MASK64
    return z ^ (z >> 31)


def oracle_token(identity: int, position: int, vocab_size: int) -> int:
    return splitmix64((identity ^ position) & MASK64) % vocab_size


def oracle_sequence(identity: int, first_position: int, n: int, vocab_size: int) -> list[int]:
    """The n tokens a request with this identity samples from `first_position` on."""
    return [oracle_token(identity, first_position + i, vocab_size) for i in range(n)]


def lsr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical shift right of int64 lanes."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 lanes (wrapping multiplication)."""
    z = (z ^ lsr(z, 30)) * _signed(_C1)
    z = (z ^ lsr(z, 27)) * _signed(_C2)
    return z ^ lsr(z, 31)


def oracle_tokens(identities: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B] int64 oracle tokens for [B] identities at [B] positions."""
    z = mix64((identities ^ positions) + _signed(GOLDEN))
    # z read as unsigned, mod vocab: split into 32-bit halves so nothing overflows
    hi, lo = lsr(z, 32), z & 0xFFFFFFFF
    return ((hi % vocab_size) * ((1 << 32) % vocab_size) + lo % vocab_size) % vocab_size


def identities(rids_int: torch.Tensor, rooms_int: torch.Tensor) -> torch.Tensor:
    """The oracle's id per row: the bootstrap room where there is one, else the rid hash."""
    return rooms_int.where(rooms_int >= 0, rids_int)
