"""The HTTP side's disaggregation edge: what a prefill or decode server does at its door that a
colocated server does not (docs/disaggregation.md), in one place, so that the endpoints, the
TokenizerManager and the generation code carry no role branches.

- `bootstraps`: each choice's frozen `Bootstrap` (room, prefill, ticket), once the router's
  signed ticket lets this worker serve them (a 400 when they are missing, a 401/403 for the
  ticket, checked before anything is tokenized or allocated). A decode with
  --allow-local-prefill serves a request with no bootstrap field as a colocated server does.
- `failed_handoff`: a disaggregated request whose KV hand-off failed is an error response (a
  502, `KVTransferFailed`), not a 200.
- `ready_fields`: what /ready tells the router, which pairs by the KV transfer and names the
  instance in its room tickets.
(A draining decode's hand-over of a stream is a finish of its own, read by runtime/server/
generation.py: `HandedOver`.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from runtime.auth.ticket import TicketGate
from runtime.config import ServerArgs
from runtime.handover import Bootstrap
from runtime.messages import FinishReason, SchedulerReady
from runtime.protocol import BootstrapFields


class KVTransferFailed(RuntimeError):
    """A prefill/decode request whose KV handoff failed (the message says why): a 502."""


class PDEdge:
    def __init__(self, args: ServerArgs, tickets: TicketGate) -> None:
        self.role = args.role
        self.tickets = tickets
        self.local_prefill = args.role == "decode" and args.disagg.allow_local_prefill
        self.tp = args.engine.tp

    def bootstraps(self, body: BootstrapFields, choices: int,
                   info: SchedulerReady | None) -> list[Bootstrap | None]:
        """One Bootstrap per choice (None: no room, as on a colocated server)."""
        if self.local_prefill and body.bootstrap_room is None and body.bootstrap_host is None \
                and body.bootstrap_port is None:
            return [None] * choices  # prefilled here: it touches no KV plane
        rooms = body.rooms(self.role, choices)
        if self.tickets.required:
            me = info.instance_id if info is not None else None
            self.tickets.admit(body.bootstrap_ticket, [r for r in rooms if r is not None],
                               body.rid, body.bootstrap_host, body.bootstrap_port, me,
                               body.prompt_digest())
        return [body.bootstrap(room) for room in rooms]

    def failed_handoff(self, firsts: Sequence[tuple[FinishReason | None, list[int]]]) -> str | None:
        """The abort message of a request whose KV handoff failed, from each choice's first
        (finish reason, output ids): on a prefill server any abort (its one token is useless
        without the KV), on a decode server an abort before its first token (the KV never
        came). None otherwise, and always on a colocated server."""
        if self.role == "colocated":
            return None
        for reason, output_ids in firsts:
            if reason is not None and reason.kind == "abort" and (self.role == "prefill"
                                                                  or not output_ids):
                return reason.message or "aborted"
        return None

    def ready_fields(self, info: SchedulerReady) -> dict[str, Any]:
        """/ready's fields beyond its status: the KV transfer the router pairs by, the instance
        id its room tickets name, whether a decode takes the router's local-prefill fallback,
        and its TP size (shown; any pairs with any). None of them on a colocated server."""
        if info.kv_transfer is None:
            return {}
        return {"kv_transfer": info.kv_transfer, "instance_id": info.instance_id,
                "local_prefill": self.local_prefill, "tp": self.tp}
