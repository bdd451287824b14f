"""The decode's KV receiver against hostile and late peers, over real loopback sockets: no byte
lands in a page its room does not own, a malformed frame closes only its own link, and nothing a
peer sends takes the receiver down (issue: KV plane integrity)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.auth.key import ClusterKey
from runtime.disagg.fence import WriteFence
from runtime.disagg.handshake import HandshakeFailed, open_link
from runtime.disagg.receiver import KVReceiver
from runtime.disagg.tally import Tally
from runtime.disagg.transfer.base import KVTransfer, create_transfer
from runtime.disagg.wire import (
    FRAMES,
    AuxRecord,
    BadFrame,
    LinkClosed,
    PagesFrame,
    RoomDone,
    RoomFailed,
    header_limit,
    recv_frame,
    send_frame,
)
from runtime.kvcache.pool import KVPool
from tests.disagg.test_transfer import pool

KEY = ClusterKey(b"k" * 32)
DECODE, PREFILL = "baton-decode-test", "baton-prefill-test"


class Receiver:
    """A real KVReceiver on a tcp backend over a 16-page pool, with what it counted."""

    def __init__(self, key: ClusterKey = KEY) -> None:
        self.pool = pool(16)
        self.woken = threading.Event()
        self.transfer: KVTransfer = create_transfer("tcp", self.pool, DECODE,
                                                    WriteFence(self.woken.set))
        self.tally = Tally()
        self.counts: dict[str, int] = {}
        self.receiver = KVReceiver("127.0.0.1", 0, self.transfer, key, DECODE,
                                   self.woken.set, self.tally)
        self.receiver.start()

    def link(self, key: ClusterKey = KEY, prefill: str = PREFILL) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.receiver.port), timeout=5)
        open_link(sock, key, prefill, DECODE)
        return sock

    def count(self, kind: str) -> int:
        for k, n in self.tally.take().items():
            self.counts[k] = self.counts.get(k, 0) + n
        return self.counts.get(kind, 0)

    def close(self) -> None:
        self.receiver.close()


@pytest.fixture
def rx() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def send_pages(sock: socket.socket, p: KVPool, room: int, pages: list[int], fill: int) -> None:
    payload = bytes([fill]) * (len(pages) * p.page_bytes)
    send_frame(sock, PagesFrame(room, pages, len(payload)), [memoryview(payload)])


def eventually(check, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def closed_by_peer(sock: socket.socket) -> bool:
    sock.settimeout(5)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_a_room_gets_its_pages_and_nothing_else_lands(rx: Receiver) -> None:
    before = rx.pool.buffer.clone()
    rx.transfer.fence.expect(7, [3, 4], PREFILL)
    with rx.link() as sock:
        send_pages(sock, rx.pool, 7, [5, 6], 0xAA)  # not the room's pages
        send_pages(sock, rx.pool, 8, [3, 4], 0xAB)  # a room nobody expects
        send_pages(sock, rx.pool, 7, [3, 4], 0xCC)  # the room's own: lands
        send_frame(sock, RoomDone(AuxRecord(7, "r", 20, 1)))
        eventually(lambda: rx.transfer.fence.arrived(7) is not None)
    rows = rx.pool.page_rows()
    assert bool((rows[3:5] == 0xCC).all())
    untouched = [p for p in range(16) if p not in (3, 4)]
    assert torch.equal(rows[untouched], before.view(torch.uint8).reshape(16, -1)[untouched])
    assert rx.count("refused_write") == 2


def test_another_prefill_cannot_write_a_room_nor_end_it(rx: Receiver) -> None:
    before = rx.pool.buffer.clone()
    rx.transfer.fence.expect(7, [3, 4], PREFILL)
    with rx.link(prefill="baton-prefill-intruder") as sock:
        send_pages(sock, rx.pool, 7, [3, 4], 0xEE)
        send_frame(sock, RoomDone(AuxRecord(7, "r", 20, 1)))
        send_frame(sock, RoomFailed(7, "not yours"))
        eventually(lambda: rx.count("refused_write") == 1)
        eventually(lambda: not rx.receiver.failed.empty())
    assert torch.equal(rx.pool.buffer, before)
    assert rx.transfer.fence.arrived(7) is None
    prefill, frame = rx.receiver.failed.get_nowait()
    assert (prefill, frame.room) == ("baton-prefill-intruder", 7)  # the decode role ignores it: not that room's
    assert rx.transfer.fence.peer_of(7) == PREFILL


def test_a_revoked_room_waits_for_its_landing_write_then_refuses_the_rest(rx: Receiver) -> None:
    """The fence: revoke() while a write is landing says 'not yet'; once the write breaks off
    (the link is cut) the pages may be freed, and a late write is read into nothing."""
    rx.transfer.fence.expect(7, [3, 4], PREFILL)
    sock = rx.link()
    half = rx.pool.page_bytes
    send_frame(sock, PagesFrame(7, [3, 4], 2 * half))
    sock.sendall(b"\x11" * half)  # one page of two: the receiver is landing the room
    eventually(lambda: rx.transfer.fence._rooms[7].landing)
    assert rx.transfer.fence.revoke(7) is False
    rx.woken.clear()
    rx.receiver.close_links(PREFILL)  # the decode declared this prefill gone
    assert rx.woken.wait(5), "the end of the landing must wake the decode role"
    assert rx.transfer.fence.revoke(7) is True
    sock.close()
    before = rx.pool.buffer.clone()
    with rx.link() as late:  # the prefill comes back and finishes the room
        send_pages(late, rx.pool, 7, [3, 4], 0x22)
        send_frame(late, RoomDone(AuxRecord(7, "r", 20, 1)))
        eventually(lambda: rx.count("refused_write") == 1)
    assert torch.equal(rx.pool.buffer, before) and rx.transfer.fence.arrived(7) is None


def test_wrong_or_missing_key_gets_no_link_and_writes_nothing() -> None:
    rx = Receiver()
    try:
        before = rx.pool.buffer.clone()
        rx.transfer.fence.expect(7, [3], PREFILL)
        with pytest.raises(HandshakeFailed):
            rx.link(key=ClusterKey(b"x" * 32))
        with socket.create_connection(("127.0.0.1", rx.receiver.port), timeout=5) as raw:
            raw.recv(40)  # HELLO; answer it with a frame instead of the proof
            with contextlib.suppress(ConnectionResetError):  # closed while we still send
                send_pages(raw, rx.pool, 7, [3], 0x33)
            assert closed_by_peer(raw)
        eventually(lambda: rx.count("bad_link") == 2)
        assert torch.equal(rx.pool.buffer, before)
    finally:
        rx.close()


def test_a_receiver_that_cannot_prove_the_key_gets_nothing() -> None:
    """The prefill's side: a listener of the caller's choosing (no key, or another decode's
    id) never gets a frame."""
    listener = socket.create_server(("127.0.0.1", 0))
    got = bytearray()

    def fake_decode() -> None:
        conn, _ = listener.accept()
        conn.sendall(b"BATONKV1" + b"\0" * 32)
        conn.settimeout(5)
        try:
            while chunk := conn.recv(65536):
                got.extend(chunk)
                conn.sendall(b"\0" * 32)  # a made-up ACCEPT
        except OSError:
            pass
        conn.close()

    t = threading.Thread(target=fake_decode)
    t.start()
    sock = socket.create_connection(listener.getsockname(), timeout=5)
    with pytest.raises(HandshakeFailed, match="not decode"):
        open_link(sock, KEY, PREFILL, DECODE)
    sock.close()
    t.join(5)
    listener.close()
    assert len(got) == 1 + len(PREFILL) + 64  # our proof only: no frame followed


@pytest.mark.parametrize("bad", [
    "room_as_list", "negative_room", "string_pages", "huge_header", "not_msgpack", "unknown_type",
    "bool_room",
])
def test_a_malformed_frame_closes_its_link_and_nothing_else(rx: Receiver, bad: str) -> None:
    before = rx.pool.buffer.clone()
    rx.transfer.fence.expect(7, [3], PREFILL)
    raw = {
        "room_as_list": FRAMES.encode(RoomFailed(1, "x")).replace(b"\x01", b"\x91\x01", 1),
        "negative_room": msgpack.packb({"__msg__": "RoomFailed", "room": -5, "reason": "x"}),
        "string_pages": msgpack.packb({"__msg__": "PagesFrame", "room": 7, "dst_pages": ["3"],
                                       "nbytes": rx.pool.page_bytes}),
        "huge_header": None,
        "not_msgpack": b"\xc1\xc1\xc1",
        "unknown_type": msgpack.packb({"__msg__": "Shell", "cmd": "rm"}),
        "bool_room": msgpack.packb({"__msg__": "RoomFailed", "room": True, "reason": "x"}),
    }[bad]
    with rx.link() as sock:
        if raw is None:
            sock.sendall((64 << 20).to_bytes(4, "big"))  # announces 64 MB: never allocated
        else:
            sock.sendall(len(raw).to_bytes(4, "big") + raw)
        assert closed_by_peer(sock)
    eventually(lambda: rx.count("bad_frame") == 1)
    assert rx.receiver.failed.empty() and torch.equal(rx.pool.buffer, before)
    with rx.link() as sock:  # the receiver still serves
        send_pages(sock, rx.pool, 7, [3], 0x44)
        send_frame(sock, RoomDone(AuxRecord(7, "r", 10, 1)))
        eventually(lambda: rx.transfer.fence.arrived(7) is not None)


def test_too_many_unproven_links_are_closed(rx: Receiver) -> None:
    idle = [socket.create_connection(("127.0.0.1", rx.receiver.port)) for _ in range(70)]
    eventually(lambda: rx.count("bad_link") >= 6)  # past MAX_UNPROVEN: closed at once
    for s in idle:
        s.close()
    with rx.link() as sock:
        send_frame(sock, RoomFailed(9, "fine"))
        eventually(lambda: not rx.receiver.failed.empty())


def test_a_handshake_has_one_deadline_however_slowly_its_bytes_come(
        rx: Receiver, monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer that sends a byte every 0.3 s is cut off when the whole handshake's deadline
    passes, not given a fresh timeout per byte (a proof is ~100 bytes: ~30 s)."""
    import runtime.disagg.handshake as handshake

    monkeypatch.setattr(handshake, "TIMEOUT_S", 1.0)
    sock = socket.create_connection(("127.0.0.1", rx.receiver.port), timeout=5)
    sock.recv(64)  # the HELLO
    began = time.monotonic()
    sock.sendall(bytes([60]))  # a prefill id of 60 bytes follows... slowly
    with pytest.raises(OSError):
        while time.monotonic() - began < 4:
            time.sleep(0.3)
            sock.sendall(b"p")
    assert time.monotonic() - began < 2.5
    eventually(lambda: rx.count("bad_link") == 1)
    sock.close()


def test_slow_peers_cannot_keep_a_prefill_out(rx: Receiver) -> None:
    """Every unproven slot taken by peers that connect and say nothing: a real prefill still
    gets in (the oldest idler is closed for it) and its link works."""
    from runtime.disagg.receiver import MAX_UNPROVEN, MIN_WAIT_S

    idle = [socket.create_connection(("127.0.0.1", rx.receiver.port)) for _ in range(MAX_UNPROVEN)]
    time.sleep(MIN_WAIT_S + 0.2)
    with rx.link() as sock:
        send_frame(sock, RoomFailed(9, "fine"))
        eventually(lambda: not rx.receiver.failed.empty())
    assert rx.count("bad_link") >= 1  # an idler made room
    for s in idle:
        s.close()


INTS = st.integers(-2**63, 2**64 - 1)  # what msgpack can carry


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.one_of(
    st.binary(max_size=200),
    st.recursive(st.none() | st.booleans() | INTS | st.floats() | st.text(max_size=8),
                 lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8),
                                                                          kids, max_size=4),
                 max_leaves=12).map(lambda v: msgpack.packb(v)),
    st.fixed_dictionaries({
        "__msg__": st.sampled_from(["PagesFrame", "RoomDone", "RoomFailed", "AuxRecord"]),
        "room": INTS | st.text(max_size=3) | st.lists(INTS, max_size=2),
        "reason": st.text(max_size=5) | INTS,
        "dst_pages": st.lists(st.integers(-5, 2**40) | st.text(max_size=2), max_size=4),
        "nbytes": INTS,
        "aux": st.none() | INTS | st.dictionaries(st.text(max_size=5), INTS),
    }).map(lambda v: msgpack.packb(v)),
))
def test_the_frame_decoder_raises_only_bad_frame(raw: bytes) -> None:
    """Fuzz: any bytes are a well-formed frame or BadFrame/LinkClosed, never another error."""
    a, b = socket.socketpair()
    with a, b:
        a.sendall(len(raw).to_bytes(4, "big") + raw)
        a.shutdown(socket.SHUT_WR)
        try:
            frame = recv_frame(b, header_limit(16))
        except (BadFrame, LinkClosed):
            return
        assert isinstance(frame, PagesFrame | RoomDone | RoomFailed)  # checked as it was built
