"""One pass at a time per service, and no pile-up of passes behind it.

Every handler of a service (its create/update/resume, the resync timer, events of its
children) runs the same complete pass, which reads the cluster afresh. So a pass that is
still waiting for its turn will see any change made before it starts: a further event that
finds a pass waiting may skip its own. Kubernetes' controllers get the same from a work queue
that deduplicates keys.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

Key = tuple[str, str]  # (namespace, name)


@dataclass
class _Gate:
    lock: threading.Lock = field(default_factory=threading.Lock)
    waiting: int = 0


class Gates:
    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._gates: dict[Key, _Gate] = {}

    @contextmanager
    def turn(self, key: Key, *, skippable: bool) -> Iterator[bool]:
        """Hold the service's turn; yields False (without waiting) when `skippable` and a pass
        is already queued, which then covers this caller's reason to run."""
        with self._guard:
            gate = self._gates.setdefault(key, _Gate())
            skip = skippable and gate.waiting > 0
            if not skip:
                gate.waiting += 1
        if skip:
            yield False
            return
        with gate.lock:
            with self._guard:
                gate.waiting -= 1
            yield True


class Retries:
    """Passes to run again later, at most one pending per service. kopf retries its own
    handlers after a TemporaryError, but not event handlers: a child's event whose pass failed
    on an API error would be lost, with the events that skipped behind it (see `Gates`), until
    the resync. The pass runs in the caller's context (kopf's event posting lives there)."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._timers: dict[Key, threading.Timer] = {}

    def later(self, key: Key, delay: float, run: Callable[[], None]) -> None:
        with self._guard:
            if key in self._timers:
                return
            timer = threading.Timer(delay, self._fire, (key, contextvars.copy_context(), run))
            timer.daemon = True
            self._timers[key] = timer
            timer.start()

    def _fire(self, key: Key, context: contextvars.Context, run: Callable[[], None]) -> None:
        with self._guard:
            self._timers.pop(key, None)
        context.run(run)

    def pending(self) -> list[Key]:
        with self._guard:
            return list(self._timers)

    def cancel(self) -> None:
        with self._guard:
            timers, self._timers = list(self._timers.values()), {}
        for timer in timers:
            timer.cancel()


class Claims:
    """Child names a service wants while another object holds them (a NameConflict): an event
    of that object, its deletion say, wakes the service instead of waiting for the resync."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._wanted: dict[tuple[str, str, str], str] = {}  # (namespace, kind, name) -> service

    def update(self, namespace: str, service: str, held: list[tuple[str, str, str]]) -> None:
        """Record the (apiVersion, kind, name) children `service` found held by others."""
        with self._guard:
            self._wanted = {key: svc for key, svc in self._wanted.items()
                            if not (key[0] == namespace and svc == service)}
            for _, kind, name in held:
                self._wanted[namespace, kind, name] = service

    def waiting_for(self, namespace: str, kind: str, name: str) -> str | None:
        with self._guard:
            return self._wanted.get((namespace, kind, name))
