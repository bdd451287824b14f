"""Lanes: a small executor per (prefill address, purpose), so that blocking HTTP calls to one
prefill never wait behind calls to another. A frozen prefill holds the threads of its own lanes
until their calls time out; registrations with every other prefill go on. Lanes of addresses no
longer in use are shut down by `sweep`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")
THREADS = 2  # calls in flight to one prefill, per purpose


class Lanes:
    def __init__(self, name: str) -> None:
        self.name = name
        self.lanes: dict[Hashable, ThreadPoolExecutor] = {}

    def submit(self, key: Hashable, fn: Callable[..., T], *args: Any) -> Future[T]:
        lane = self.lanes.get(key)
        if lane is None:
            lane = self.lanes[key] = ThreadPoolExecutor(THREADS, thread_name_prefix=self.name)
        return lane.submit(fn, *args)

    def sweep(self, keep: set[Hashable]) -> None:
        """Shut down the lanes whose key is not in `keep` (their threads end after their call)."""
        for key in set(self.lanes) - keep:
            self.lanes.pop(key).shutdown(wait=False)

    def shutdown(self) -> None:
        for lane in self.lanes.values():
            lane.shutdown(wait=False, cancel_futures=True)
        self.lanes = {}
