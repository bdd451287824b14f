"""A planned hand-over: how a draining decode ends a stream it does not finish, and how a router
reads that back (docs/disaggregation.md "Moving a request", docs/router.md "Migration").

It is an outcome, not a failure. Two kinds:
- "moved": the stream's KV waits at a `KVOffer`, a room on the draining decode's bootstrap
  server, for another decode to take (runtime/disagg/move.py);
- "drained": the server drained and the stream stopped with no move (the grace period ended);
  whoever follows the stream replays its tokens elsewhere.

On the wire the stream's last event before `data: [DONE]` (and its usage chunk, if asked for)
carries a top-level `handover` object, `Handover.to_wire()`:
`{"kind": "moved"|"drained", "message": str, "kv_offer": {"bootstrap_host", "bootstrap_port",
"bootstrap_room", "instance_id"} | null}`. `Handover.from_wire` reads it back: None for
anything that is not a hand-over; a "moved" whose offer is not well-formed reads as a move
without an offer (its tokens are replayed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, TypeGuard

HandoverKind = Literal["moved", "drained"]
MESSAGES: dict[HandoverKind, str] = {
    "moved": "the server is draining: the stream's KV moved to another decode server",
    "drained": "the server is draining: the stream stopped without a move",
}


@dataclass(frozen=True)
class Bootstrap:
    """Where a request's prompt KV comes from, as the router paired it, from the request body to
    the room: the prefill's bootstrap server (host, port), the room, and the router's signed
    ticket for it (runtime/auth/ticket.py). A colocated request may carry a room alone: it still
    names the request (the token oracle's and the KV canary's identity)."""

    room: int
    host: str | None = None
    port: int | None = None
    ticket: str | None = None


@dataclass(frozen=True)
class KVOffer:
    """Where a moved stream's KV waits: room `room` of the bootstrap server at host:port of
    the KV instance `instance_id` (the draining decode's; room tickets name it)."""

    host: str
    port: int
    room: int
    instance_id: str

    def to_wire(self) -> dict[str, Any]:
        return {"bootstrap_host": self.host, "bootstrap_port": self.port,
                "bootstrap_room": self.room, "instance_id": self.instance_id}

    @classmethod
    def from_wire(cls, obj: Any) -> KVOffer | None:
        """The offer `obj` names; None unless every field is there and well-formed."""
        if not isinstance(obj, dict):
            return None
        host, port, room, instance = (obj.get(k) for k in (
            "bootstrap_host", "bootstrap_port", "bootstrap_room", "instance_id"))
        if not (isinstance(host, str) and host and _whole(port, 1, 1 << 16)
                and _whole(room, 0, 1 << 63) and isinstance(instance, str) and instance):
            return None
        return cls(host, port, room, instance)


@dataclass(frozen=True)
class Handover:
    kind: HandoverKind
    offer: KVOffer | None = None  # "moved" only: where its KV waits

    @property
    def message(self) -> str:
        return MESSAGES[self.kind]

    def to_wire(self) -> dict[str, Any]:
        offer = self.offer.to_wire() if self.offer is not None else None
        return {"kind": self.kind, "message": self.message, "kv_offer": offer}

    def without_offer(self) -> Handover:
        """As a client that cannot take the KV is told: no address of the KV plane."""
        return Handover(self.kind)

    @classmethod
    def from_wire(cls, obj: Any) -> Handover | None:
        if not isinstance(obj, dict):
            return None
        kind = obj.get("kind")
        if kind == "moved":
            return cls("moved", KVOffer.from_wire(obj.get("kv_offer")))
        if kind == "drained":
            return cls("drained")
        return None


def _whole(value: Any, low: int, end: int) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value < end
