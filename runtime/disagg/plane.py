"""One rank's KV plane (docs/kv-plane.md): how its pool's pages move to and from peers, built in
one place and handed to the roles.

A plane is its transfer backend (which holds the pool's layout and the decode side's write fence,
runtime/disagg/fence.py), the cluster key that signs and checks every call and link, the tally of
KV-plane events, and the KV canary's hand-off checks when the canary is on. The roles
(runtime/disagg/prefill.py, decode.py) take a plane and open their servers in `start()`; whoever
opened the plane closes it, after the roles (runtime/scheduler/process.py). A server with several
ranks has a plane per rank: each over its own pool.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from runtime.auth.key import ClusterKey, load_cluster_key
from runtime.canary.handoff import HandoffCanary
from runtime.disagg.fence import WriteFence
from runtime.disagg.tally import Tally
from runtime.disagg.transfer.base import KVTransfer, create_transfer, layout_of
from runtime.disagg.wire import KVLayout
from runtime.kvcache.pool import KVPool

if TYPE_CHECKING:
    from collections.abc import Callable

    from runtime.canary.guard import CanaryGuard
    from runtime.canary.monitor import CanaryMonitor
    from runtime.config import ServerArgs


@dataclass(frozen=True)
class KVPlane:
    transfer: KVTransfer  # moves the bytes; holds the layout and the write fence
    key: ClusterKey = field(default_factory=ClusterKey.none)
    tally: Tally = field(default_factory=Tally)  # KV-plane events, counted on server threads
    canary: HandoffCanary | None = None  # the KV canary's tags and sums travel with the pages

    @property
    def name(self) -> str:
        """The instance id peers know this server by (nixl's agent name too)."""
        return self.transfer.agent_name

    @property
    def fence(self) -> WriteFence:
        return self.transfer.fence

    @property
    def layout(self) -> KVLayout:
        return self.transfer.layout

    def close(self) -> None:
        self.transfer.close()


def open_plane(args: ServerArgs, pool: KVPool, wake: Callable[[], None],
               canary: CanaryGuard | None = None, monitor: CanaryMonitor | None = None) -> KVPlane:
    """The plane of a prefill or decode server over `pool`: its fence wakes the scheduler loop
    (`wake`) when KV arrives; with the runner's KV canary (`canary`, and the scheduler's
    `monitor`), the canary's tags travel with the pages and the layout says so."""
    key = load_cluster_key(args.disagg.cluster_key_file)
    name = f"baton-{args.role}-{uuid.uuid4().hex[:12]}"
    layout, handoff = layout_of(pool), None
    if canary is not None and monitor is not None:
        handoff = HandoffCanary(canary, monitor, pool.page_size)
        layout = replace(layout, canary_tags=True, canary_bytes=args.canary.kv_canary_bytes)
    transfer = create_transfer(args.disagg.kv_transfer, pool, name, WriteFence(wake), layout)
    return KVPlane(transfer, key, Tally(), handoff)
