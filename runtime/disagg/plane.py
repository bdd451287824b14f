"""One rank's KV plane (docs/kv-plane.md): how its pool's pages move to and from peers, built in
one place and handed to the roles.

A plane is its transfer backend (which holds the pool's layout and the decode side's write fence,
runtime/disagg/fence.py), the cluster key that signs and checks every call and link, the tally of
KV-plane events, and the KV canary's hand-off checks when the canary is on. The roles
(runtime/disagg/prefill.py, decode.py) take a plane and open their servers in `start()`; whoever
opened the plane closes it, after the roles (runtime/scheduler/process.py). A server with several
ranks has a plane per rank, each over its own pool: rank 0's holds the others' receivers
(`rank_receivers`) and reaches them through `ranks` (runtime/disagg/ranks_plane.py).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

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
    from runtime.disagg.interfaces import RankCalls


@dataclass(frozen=True)
class KVPlane:
    transfer: KVTransfer  # moves the bytes; holds the layout and the write fence
    key: ClusterKey = field(default_factory=ClusterKey.none)
    tally: Tally = field(default_factory=Tally)  # KV-plane events, counted on server threads
    canary: HandoffCanary | None = None  # the KV canary's tags and sums travel with the pages
    ranks: RankCalls | None = None  # the other TP ranks' planes (None: one rank)
    rank_receivers: list[list[Any]] = field(default_factory=list)  # decode: ranks 1.., [host, port]
    rank_info: list[dict[str, Any]] = field(default_factory=list)  # decode: ranks 1..' local_info

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
               canary: CanaryGuard | None = None, monitor: CanaryMonitor | None = None,
               ranks: RankCalls | None = None, kv_heads: int | None = None,
               advertise: str = "127.0.0.1") -> KVPlane:
    """The plane of a prefill or decode server over `pool`: its fence wakes the scheduler loop
    (`wake`) when KV arrives; with the runner's KV canary (`canary`, and the scheduler's
    `monitor`), the canary's tags travel with the pages and the layout says so. Under TP
    (`ranks`: the followers; the model's `kv_heads`), every follower opens its own plane too,
    a decode's receivers advertised as `advertise`."""
    key = load_cluster_key(args.disagg.cluster_key_file)
    name = f"baton-{args.role}-{uuid.uuid4().hex[:12]}"
    tp = args.engine.tp if ranks is not None else 1
    layout, handoff = replace(layout_of(pool, tp, kv_heads), revision=args.revision or ""), None
    if canary is not None and monitor is not None:
        handoff = HandoffCanary(canary, monitor, pool.page_size, ranks)
        layout = replace(layout, canary_tags=True, canary_bytes=args.canary.kv_canary_bytes)
    if ranks is None:
        transfer = create_transfer(args.disagg.kv_transfer, pool, name, WriteFence(wake), layout)
        return KVPlane(transfer, key, Tally(), handoff)
    from runtime.disagg.ranks_plane import LeaderFence, open_followers

    receivers, info = open_followers(ranks, args.role, name, layout, args.disagg.kv_transfer,
                                     (args.host, args.disagg.kv_port), advertise,
                                     args.disagg.cluster_key_file)
    tally = Tally()  # the followers' receivers count into it too
    transfer = create_transfer(args.disagg.kv_transfer, pool, name,
                               LeaderFence(wake, ranks, tally), layout)
    return KVPlane(transfer, key, tally, handoff, ranks, receivers, info)
