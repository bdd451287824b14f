"""Counts by kind, kept from any thread (the KV receiver's links, the bootstrap server's
handlers) and taken by the role's poll into its DisaggStats. A follower TP rank's receiver
counts into a `Forwarded` tally: each count goes to rank 0's (runtime/disagg/ranks_plane.py)."""

from __future__ import annotations

import threading
from collections.abc import Callable


class Tally:
    def __init__(self) -> None:
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def add(self, kind: str, n: int = 1) -> None:
        with self._lock:
            self._counts[kind] = self._counts.get(kind, 0) + n

    def take(self) -> dict[str, int]:
        """The counts since the last take."""
        with self._lock:
            counts, self._counts = self._counts, {}
        return counts


class Forwarded(Tally):
    """A tally that keeps nothing: each count is handed to `send` (kind, n) at once."""

    def __init__(self, send: Callable[[str, int], None]) -> None:
        super().__init__()
        self.send = send

    def add(self, kind: str, n: int = 1) -> None:
        self.send(kind, n)
