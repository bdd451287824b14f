"""Request identity as int64: rid -> 8-byte blake2b (little-endian, signed); room None -> -1."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch

NO_ROOM = -1


def rid_to_int64(rid: str) -> int:
    digest = hashlib.blake2b(rid.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def rids_to_tensor(rids: Iterable[str]) -> torch.Tensor:
    """[B] int64 hashes of the rids."""
    return torch.tensor([rid_to_int64(r) for r in rids], dtype=torch.int64)


def rooms_to_tensor(rooms: Iterable[int | None]) -> torch.Tensor:
    """[B] int64 bootstrap rooms; a request without one (colocated) is NO_ROOM."""
    return torch.tensor([NO_ROOM if r is None else r for r in rooms], dtype=torch.int64)
