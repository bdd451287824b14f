"""A server's role around its Scheduler: colocated, prefill or decode (docs/disaggregation.md).

Every role composes the same Scheduler and ModelRunner; what differs is where requests wait
before and after it, which lives in small classes (runtime/disagg/prefill.py, decode.py). The
scheduler process talks to any of them through `Role`: add, abort, poll (advance the queues,
return the requests whose outputs are due), requests (what it holds), has_work, close. The
flow runs one way: a role gives requests to the scheduler (`add_request`, and through its
`handoffs`, `process_prebuilt`) and takes back what the scheduler is done with
(`handoffs.take_handed_off`); the scheduler knows no role.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Protocol

from runtime.config import ServerArgs
from runtime.messages import DisaggStats
from runtime.scheduler.req import Req
from runtime.scheduler.scheduler import Scheduler

if TYPE_CHECKING:
    from runtime.disagg.plane import KVPlane
    from runtime.disagg.prefill import PrefillRole

log = logging.getLogger("baton.scheduler")


class Role(Protocol):
    @property
    def stats(self) -> DisaggStats | None:
        """KV transfer counters (prefill and decode roles)."""

    def add(self, req: Req) -> None:
        """Take a new request; raises InvalidRequest or RoomError (both reach the client)."""

    def abort(self, rid: str, message: str) -> bool: ...

    def poll(self) -> list[Req]: ...

    def requests(self) -> list[Req]:
        """The unfinished requests it holds in its rooms (some may be in the scheduler too)."""

    def queued(self) -> int:
        """How many of those wait for something before the scheduler has them (a decode's
        KV, a prefill's first poll): with the scheduler's waiting ones, the queue depth."""

    def has_work(self) -> bool: ...

    def drain(self) -> None:
        """The server drains (SIGTERM): a decode moves its followed streams elsewhere."""

    def close(self) -> None: ...


class ColocatedRole:
    """Prefill and decode in one server: requests go straight to the scheduler."""

    stats: DisaggStats | None = None

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def add(self, req: Req) -> None:
        self.scheduler.add_request(req)

    def abort(self, rid: str, message: str) -> bool:
        return self.scheduler.abort(rid, message)

    def poll(self) -> list[Req]:
        return []

    def requests(self) -> list[Req]:
        return []

    def queued(self) -> int:
        return 0

    def has_work(self) -> bool:
        return False

    def drain(self) -> None:
        pass

    def close(self) -> None:
        pass


def advertise_host(args: ServerArgs) -> str:
    """The address peers use to reach this server's KV endpoint."""
    if args.disagg.advertise_host:
        return args.disagg.advertise_host
    if os.environ.get("POD_IP"):
        return os.environ["POD_IP"]
    if args.host not in ("0.0.0.0", "::", ""):
        return args.host
    return socket.gethostbyname(socket.gethostname())


def build_role(args: ServerArgs, scheduler: Scheduler, plane: KVPlane | None, vocab_size: int,
               wake: Callable[[], None]) -> Role:
    """The role for `args.role` over `plane` (runtime/disagg/plane.py; None when colocated),
    its servers started (bootstrap server or KV receiver)."""
    if plane is None:  # colocated: no KV plane
        return ColocatedRole(scheduler)
    from runtime.auth.key import warn_if_open

    def sender() -> PrefillRole[Req]:
        """The sending side: a prefill's, or a draining decode's (its moved requests, on the
        decode's plane)."""
        from runtime.disagg.prefill import PrefillRole
        from runtime.disagg.sender import KVSender

        warn_if_open(plane.key, f"{args.role} {plane.name} (bootstrap port {args.disagg.bootstrap_port})")
        role: PrefillRole[Req] = PrefillRole(
            scheduler, scheduler.handoffs, scheduler.kv, plane,
            KVSender(plane.transfer, plane.key, ranks=plane.ranks), args.disagg, wake)
        role.start(args.host)
        return role

    if args.role == "prefill":
        return sender()
    from runtime.disagg.decode import DecodeRole
    from runtime.disagg.move import Mover
    from runtime.disagg.peers import PrefillClient
    from runtime.disagg.receiver import KVReceiver
    from runtime.disagg.wire import PeerRegistration

    transfer = plane.transfer
    receiver = KVReceiver(args.host, args.disagg.kv_port, transfer, plane.key, plane.name, wake,
                          plane.tally)
    if plane.ranks is not None:
        from runtime.disagg.ranks_plane import close_links_everywhere

        receiver.also_close = close_links_everywhere(plane.ranks)
    warn_if_open(plane.key, f"decode {plane.name} (KV port {receiver.port})")
    me = PeerRegistration(plane.name, advertise_host(args), receiver.port, asdict(plane.layout),
                          transfer.name, transfer.local_info(), plane.rank_receivers,
                          plane.rank_info)
    log.info("decode %s: KV receiver on %s:%d (%s)", plane.name, me.receiver_host,
             me.receiver_port, transfer.name)
    # under TP the moved KV leaves as a prefill's does: each rank's heads, as shares
    mover = (Mover(scheduler.handoffs, sender(), me.receiver_host)
             if args.disagg.move_kv_on_drain else None)
    client = PrefillClient(me, transfer, plane.key, args.disagg.heartbeat_interval_s)
    decode: DecodeRole[Req] = DecodeRole(scheduler, scheduler.handoffs, scheduler.kv, plane, client,
                                         receiver, args.disagg, wake, vocab_size, mover=mover)
    decode.start()
    return decode
