"""Room tickets: the router's signed word that a request's rooms pair this prefill with this
decode, until a deadline.

    v1.<payload: base64url JSON>.<MAC: base64url>
    payload {"rooms": [int], "rid": str, "prefill": instance id, "host": str, "port": int,
             "decode": instance id, "exp": unix seconds, "prompt": sha256 hex}

The router signs one per request (`sign`) and sends it to both sides as `bootstrap_ticket`.
A worker with a cluster key (`TicketGate.admit`, in its HTTP process, before it tokenizes or
allocates anything) accepts a request only with a ticket that verifies, has not expired, names
exactly the request's rooms, rid, bootstrap address and prompt (`runtime.protocol.prompt_digest`
of its text, ids or messages and its `resume`: one unused ticket cannot carry prompt A to the
prefill and B to the decode), names this worker's instance as its side, and was not used here
before. So a decode connects only to the prefill a signed ticket
names (never to a `bootstrap_host` of the caller's choosing), and the prefill checks the same
ticket again when the decode registers the room (`check_room`). Failures are 401 (no ticket)
or 403 (forged, expired, replayed, or for another room, address or instance).
Instance ids are the workers' KV instance ids, which their /ready shows.
"""

from __future__ import annotations

import base64
import binascii
import json
import time
from dataclasses import asdict, dataclass
from typing import Any, Literal

from runtime.auth.key import ClusterKey, ReplayCache
from runtime.validation import InvalidRequest

PURPOSE = "room-ticket"
TTL_S = 60.0  # the router -> worker hop; a decode that waits longer for pages is not affected


class TicketRefused(InvalidRequest):
    def __init__(self, status: Literal[401, 403], message: str, code: str) -> None:
        super().__init__(message, "bootstrap_ticket", status, code)


@dataclass(frozen=True)
class RoomTicket:
    rooms: list[int]
    rid: str
    prefill: str
    host: str
    port: int
    decode: str
    exp: float
    prompt: str  # runtime.protocol.prompt_digest of the request's prompt

    def sign(self, key: ClusterKey) -> str:
        payload = json.dumps(asdict(self), separators=(",", ":"), sort_keys=True).encode()
        return f"v1.{_b64(payload)}.{_b64(key.mac(PURPOSE, payload))}"

    def covers(self, room: int, rid: str) -> bool:
        """`room` is one of the ticket's and `rid` its request's (`X`, or choice i's `X-i`)."""
        if room not in self.rooms:
            return False
        return rid == self.rid or rid == f"{self.rid}-{self.rooms.index(room)}"


def sign(key: ClusterKey, rooms: int | list[int], rid: str, prefill: str, host: str, port: int,
         decode: str, prompt: str, ttl_s: float = TTL_S) -> str:
    listed = [rooms] if isinstance(rooms, int) else list(rooms)
    return RoomTicket(listed, rid, prefill, host, port, decode, time.time() + ttl_s,
                      prompt).sign(key)


def verify(key: ClusterKey, token: str) -> tuple[RoomTicket, bytes]:
    """The ticket and its MAC if `token` was signed with `key` (TicketRefused 403 otherwise).
    Its deadline and fields are the caller's to check."""
    try:
        version, payload_b64, mac_b64 = token.split(".")
        payload, mac = _unb64(payload_b64), _unb64(mac_b64)
    except (ValueError, binascii.Error):
        raise TicketRefused(403, "bootstrap_ticket is not a room ticket", "ticket_forged") from None
    if version != "v1" or not key.verify(mac, PURPOSE, payload):
        raise TicketRefused(403, "bootstrap_ticket was not signed with this deployment's "
                            "cluster key", "ticket_forged")
    return _parse(payload), mac


def _parse(payload: bytes) -> RoomTicket:
    try:
        data: Any = json.loads(payload)
        return RoomTicket(**data)
    except (ValueError, TypeError):  # signed, yet not ours: only with a leaked key
        raise TicketRefused(403, "bootstrap_ticket is not a room ticket", "ticket_forged") from None


class TicketGate:
    """A prefill or decode worker's check of the router's tickets (HTTP process)."""

    def __init__(self, key: ClusterKey, role: str) -> None:
        self.key, self.role = key, role
        self.seen = ReplayCache()

    @property
    def required(self) -> bool:
        return self.key.enabled and self.role in ("prefill", "decode")

    def admit(self, token: str | None, rooms: list[int], rid: str | None, host: str | None,
              port: int | None, me: str | None, prompt: str, now: float | None = None) -> None:
        """Raise TicketRefused unless `token` lets this worker (instance `me`) serve a request
        with these rooms, rid, bootstrap address and prompt digest. No-op without a cluster key."""
        if not self.required:
            return
        if not token:
            raise TicketRefused(401, f"this {self.role} server takes requests only with the "
                                "router's signed bootstrap_ticket (send them through `baton "
                                "router` of this deployment)", "ticket_required")
        ticket, mac = verify(self.key, token)
        now = time.time() if now is None else now
        if now > ticket.exp:
            raise TicketRefused(403, f"bootstrap_ticket expired {now - ticket.exp:.0f} s ago",
                                "ticket_expired")
        mine = ticket.prefill if self.role == "prefill" else ticket.decode
        wrong = [name for name, ok in (
            ("bootstrap_room", ticket.rooms == rooms), ("rid", ticket.rid == rid),
            ("bootstrap_host", ticket.host == host), ("bootstrap_port", ticket.port == port),
            ("prompt", ticket.prompt == prompt),
        ) if not ok]
        if wrong:
            raise TicketRefused(403, f"bootstrap_ticket does not cover this request's "
                                f"{', '.join(wrong)}", "ticket_mismatch")
        if mine != me:
            raise TicketRefused(403, f"bootstrap_ticket names {self.role} {mine!r}, not this "
                                f"one ({me}); the router will know it at its next health check",
                                "ticket_other_instance")
        if not self.seen.first_use(mac, ticket.exp, now):
            raise TicketRefused(403, "bootstrap_ticket was used before", "ticket_replayed")


def check_room(key: ClusterKey, token: str | None, room: int, rid: str, prefill: str,
               decode: str) -> None:
    """The prefill's check of a room a decode registers (POST /rooms): the router's ticket,
    for this prefill and that decode, covers it. Its deadline is not checked again: the decode
    checked it on arrival and may have waited for pages since. No-op without a key."""
    if not key.enabled:
        return
    if not token:
        raise TicketRefused(401, f"room {room}: no bootstrap ticket", "ticket_required")
    ticket, _ = verify(key, token)
    if ticket.prefill != prefill or ticket.decode != decode or not ticket.covers(room, rid):
        raise TicketRefused(403, f"room {room}: the ticket is for another room, prefill or "
                            "decode", "ticket_mismatch")


def peer_of(token: str | None) -> str | None:
    """The prefill instance a (verified) ticket names, for the decode role."""
    if not token:
        return None
    try:
        return _parse(_unb64(token.split(".")[1])).prefill
    except (ValueError, IndexError, binascii.Error):  # (TicketRefused is a ValueError)
        return None


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
