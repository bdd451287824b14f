"""KV transfer backends move exactly the asked pages of every layer, K and V, between two pools
of the same layout (different sizes), over real loopback: a socket for tcp, UCX for nixl."""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict

import pytest
import torch

from runtime.disagg.fence import WriteFence
from runtime.disagg.shares import Split, plan
from runtime.disagg.transfer.base import KVTransfer, TransferError, create_transfer, layout_of
from runtime.disagg.wire import (
    AuxRecord,
    KVLayout,
    PagesFrame,
    PeerRegistration,
    RoomDone,
    header_limit,
    recv_frame,
)
from runtime.kvcache.fp8 import KVScales
from runtime.kvcache.pool import KVPool


def pool(num_pages: int, dtype: torch.dtype = torch.float32, page_size: int = 4) -> KVPool:
    """float8_e4m3fn: an fp8 pool (--kv-cache-dtype fp8_e4m3) of a float32 model."""
    if dtype == torch.float8_e4m3fn:
        p = KVPool(3, num_pages, page_size, 2, 8, torch.float32, scales=KVScales.default(3))
    else:
        p = KVPool(3, num_pages, page_size, 2, 8, dtype)
    gen = torch.Generator().manual_seed(num_pages)
    p.buffer.copy_(torch.randn(p.buffer.shape, generator=gen).to(dtype))
    return p


def pages_equal(a: KVPool, a_pages: list[int], b: KVPool, b_pages: list[int]) -> bool:
    for layer in range(a.num_layers):
        for x, y in zip(a.pages(layer), b.pages(layer), strict=True):
            if not torch.equal(x[a_pages], y[b_pages]):
                return False
    return True


def transfer(name: str, p: KVPool, fence: WriteFence | None = None) -> KVTransfer:
    return create_transfer(name, p, f"test-{uuid.uuid4().hex[:8]}", fence)


def aux_for(room: int) -> AuxRecord:
    """An aux record with everything a real one may carry (a notification must hold it all)."""
    info = {"note": "ünïcode ✓ and \x00 bytes", "blob": "x" * 3000, "ids": list(range(50))}
    return AuxRecord(room, f"rid-{room}", 12, 4242, -0.25, [[4242, -0.25], [7, -1.5]], info)


def move(name: str, src: KVPool, dst: KVPool, src_pages: list[int], dst_pages: list[int]) -> None:
    arrivals = threading.Semaphore(0)
    fence = WriteFence(arrivals.release)
    sender, receiver = transfer(name, src), transfer(name, dst, fence)
    sender.connect("decode", receiver.local_info())
    a, b = socket.socketpair()
    me = sender.agent_name  # the prefill's instance id: its links and nixl agent carry it
    limit = header_limit(dst.num_pages)

    def receive() -> None:
        if name == "tcp":
            frame = recv_frame(b, limit)
            assert isinstance(frame, PagesFrame)
            assert receiver.read_pages(frame, b, me)
            done = recv_frame(b, limit)
            assert isinstance(done, RoomDone)
            assert receiver.read_done(done.aux, me)

    fence.expect(77, dst_pages, me)
    t = threading.Thread(target=receive)
    t.start()
    nbytes = sender.write("decode", a, src_pages, dst_pages, aux_for(77))
    t.join(10)
    per_page = 2 * src.num_layers * src.page_size * src.num_kv_heads * src.head_dim  # K and V
    assert nbytes == len(src_pages) * per_page * src.buffer.element_size()
    assert nbytes == len(src_pages) * layout_of(src).page_bytes == len(src_pages) * src.page_bytes
    assert arrivals.acquire(timeout=10), "on_arrival was not called"
    assert fence.arrived(77) == aux_for(77)
    assert fence.arrived(78) is None
    fence.discard(77)
    assert fence.arrived(77) is None
    # a room nobody expects (it ended before its KV came) is not kept: it would leak
    fence.expect(79, [], me)
    for room in (78, 79):
        if name == "nixl":
            sender.write("decode", a, [], [], aux_for(room))
        else:
            fence.landed(room, True)  # (what read_pages of an empty page list leaves)
            receiver.read_done(aux_for(room), me)
    assert arrivals.acquire(timeout=10)
    assert fence.arrived(79) == aux_for(79) and fence.arrived(78) is None
    a.close(), b.close()
    sender.close(), receiver.close()


@pytest.mark.parametrize("name", ["tcp", "nixl"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_pages_land_exactly_where_asked(name: str, dtype: torch.dtype) -> None:
    src, dst = pool(16, dtype), pool(40, dtype)
    # runs on both sides (5-7 -> 2-4, 14-15 -> 17-18), runs on one side only, gaps, any order
    src_pages, dst_pages = [5, 6, 7, 0, 15, 14, 15, 9], [2, 3, 4, 39, 0, 17, 18, 19]
    untouched = [p for p in range(40) if p not in dst_pages]
    before = dst.buffer.clone()
    move(name, src, dst, src_pages, dst_pages)
    assert pages_equal(src, src_pages, dst, dst_pages)
    assert torch.equal(before[untouched], dst.buffer[untouched])


def test_unknown_backend_and_layout_mismatch_messages() -> None:
    with pytest.raises(ValueError, match="unknown KV transfer backend"):
        create_transfer("carrier-pigeon", pool(2), "x")
    a, b = layout_of(pool(2)), layout_of(pool(2, torch.bfloat16, page_size=8))
    assert a.mismatch(a) is None
    assert a.mismatch(b) == "page_size 4 vs 8; dtype float32 vs bfloat16"


def test_tcp_refuses_a_frame_that_does_not_fit() -> None:
    dst = pool(4)
    receiver = transfer("tcp", dst)
    a, b = socket.socketpair()
    page = layout_of(dst).page_bytes
    with pytest.raises(TransferError, match="bytes for 1 pages"):
        receiver.read_pages(PagesFrame(1, [0], page + 1), b, "p")
    with pytest.raises(TransferError, match="a pool of 4 pages"):
        receiver.read_pages(PagesFrame(1, [0] * 5, 5 * page), b, "p")
    a.close(), b.close()


def _rank_pool(num_pages: int, heads: int, seed: int) -> KVPool:
    p = KVPool(3, num_pages, 4, heads, 8, torch.float32)
    p.buffer.copy_(torch.randn(p.buffer.shape, generator=torch.Generator().manual_seed(seed)))
    return p


def _wait(check: Callable[[], bool]) -> bool:
    deadline = time.monotonic() + 10
    while not check() and time.monotonic() < deadline:
        time.sleep(0.005)
    return check()


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (2, 1), (2, 2)])
def test_nixl_shares_land_in_the_heads_of_the_decode_ranks_that_hold_them(p_tp: int,
                                                                          d_tp: int) -> None:
    """Each prefill rank WRITEs its shares (runtime/disagg/shares.py) into the decode ranks'
    pools, over UCX: a head range of each page where the two sides split the heads differently
    (descriptors per row), whole pages where they split them alike; each share's notification
    counts at its rank's fence, and the RoomDone, sent first here, waits for them all."""
    pytest.importorskip("nixl")
    from runtime.disagg.transfer.nixl import NixlTransfer

    kv, me, room = 2, f"baton-prefill-{uuid.uuid4().hex[:8]}", 9
    src_split, dst_split = Split(p_tp, kv), Split(d_tp, kv)
    arrived = threading.Event()
    fences = [WriteFence(arrived.set)] + [WriteFence(rank=r) for r in range(1, d_tp)]
    dsts = [_rank_pool(12, kv // d_tp, 100 + r) for r in range(d_tp)]
    d_layout = KVLayout(3, 4, kv, 8, "float32", tp_size=d_tp)
    receivers = [NixlTransfer(p, f"baton-decode-x{d_tp}", f, d_layout, r)
                 for r, (p, f) in enumerate(zip(dsts, fences, strict=True))]
    srcs = [_rank_pool(8, kv // p_tp, r) for r in range(p_tp)]
    p_layout = KVLayout(3, 4, kv, 8, "float32", tp_size=p_tp)
    senders = [NixlTransfer(p, me, None, p_layout, r) for r, p in enumerate(srcs)]
    peer = PeerRegistration("decode", "h", 1, asdict(d_layout), "nixl",
                            receivers[0].local_info(), [["h", 2 + r] for r in range(1, d_tp)],
                            [t.local_info() for t in receivers[1:]])
    src_pages, dst_pages = [6, 7, 0, 3], [2, 3, 11, 5]
    before = [p.buffer.clone() for p in dsts]
    shares = plan(src_split, dst_split)
    try:
        for fence in fences:
            fence.expect(room, dst_pages, me)
            assert fence.bind_peer(room, me, shares)
        senders[0].connect("decode", peer.backend_info)  # (the prefill's registration)
        senders[0].write_done(peer, None, aux_for(room))  # early: it waits
        nbytes = sum(senders[s.src].write_share(peer, None, room, src_pages, dst_pages, s)
                     for s in shares)
        assert nbytes == len(src_pages) * layout_of(_rank_pool(1, kv, 0)).page_bytes
        assert arrived.wait(10) and fences[0].arrived(room) == aux_for(room)
        for r, fence in enumerate(fences):
            assert _wait(lambda f=fence: f._rooms[room].complete()), r  # type: ignore[misc]
        for d, pool_d in enumerate(dsts):
            d_first = dst_split.held(d)[0]
            for s in (s for s in shares if s.dst == d):
                s_first = src_split.held(s.src)[0]
                got = pool_d.buffer[dst_pages][..., s.lo - d_first:s.hi - d_first, :]
                want = srcs[s.src].buffer[src_pages][..., s.lo - s_first:s.hi - s_first, :]
                assert torch.equal(got, want), (d, s)
            untouched = [p for p in range(12) if p not in dst_pages]
            assert torch.equal(pool_d.buffer[untouched], before[d][untouched])
        # a share into pages its room does not name lands (one-sided) but counts for nothing
        first = shares[0]
        fences[first.dst].expect(10, [1, 4, 8, 9], me)
        assert fences[first.dst].bind_peer(10, me, shares)
        senders[first.src].write_share(peer, None, 10, src_pages, dst_pages, first)
        time.sleep(0.2)
        assert not fences[first.dst]._rooms[10].written
    finally:
        for t in (*senders, *receivers):
            t.close()
