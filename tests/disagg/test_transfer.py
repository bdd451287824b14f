"""KV transfer backends move exactly the asked pages of every layer, K and V, between two pools
of the same layout (different sizes), over real loopback: a socket for tcp, UCX for nixl."""

from __future__ import annotations

import socket
import threading
import uuid

import pytest
import torch

from runtime.disagg.fence import WriteFence
from runtime.disagg.transfer.base import KVTransfer, TransferError, create_transfer, layout_of
from runtime.disagg.wire import AuxRecord, PagesFrame, RoomDone, header_limit, recv_frame
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
