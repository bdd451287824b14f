"""The KV link handshake: before any frame, both ends of a prefill -> decode link prove who they
are with the cluster key (challenge-response; fresh nonces on both sides, so nothing replays).

  decode (receiver) -> prefill   HELLO   magic "BATONKV1", nonce_d (32 bytes)
  prefill -> decode              PROVE   len(id_p), id_p, nonce_p (32), mac_p
                                         mac_p = MAC("kv-link/prefill", nonce_d, nonce_p, id_p, id_d)
  decode -> prefill              ACCEPT  mac_d = MAC("kv-link/decode", nonce_p, nonce_d, id_d, id_p)

The prefill names the decode it means to reach (id_d, from its registration): a listener that is
not that decode, or has no key, cannot answer ACCEPT, and the prefill sends it nothing. The decode
learns which prefill instance the link belongs to (id_p): frames on it may touch only rooms that
prefill was given. Every read is bounded in size, and the whole handshake by one deadline
(TIMEOUT_S), however slowly its bytes trickle in. Without a cluster key the MACs use the empty
key: they prove nothing, but still bind the ids.
"""

from __future__ import annotations

import secrets
import socket
import time

from runtime.auth.key import ClusterKey
from runtime.disagg.wire import MAX_ID, LinkClosed

MAGIC = b"BATONKV1"
NONCE = 32
MAC = 32
TIMEOUT_S = 5.0  # the whole handshake, both sides: two round trips take milliseconds


class HandshakeFailed(ConnectionError):
    pass


def accept_link(sock: socket.socket, key: ClusterKey, decode_id: str) -> str:
    """Decode side, on a new connection: the proven prefill instance id, or HandshakeFailed."""
    nonce_d = secrets.token_bytes(NONCE)
    with _Deadline(sock) as link:
        sock.sendall(MAGIC + nonce_d)
        size = link.recv(1)[0]
        if not 1 <= size <= MAX_ID:
            raise HandshakeFailed(f"a prefill id of {size} bytes")
        raw = link.recv(size + NONCE + MAC)
        prefill_id = _ascii(raw[:size])
        nonce_p, mac_p = raw[size:size + NONCE], raw[size + NONCE:]
        if not key.verify(mac_p, "kv-link/prefill", nonce_d, nonce_p, prefill_id, decode_id):
            raise HandshakeFailed(f"{prefill_id!r} did not prove the cluster key")
        sock.sendall(key.mac("kv-link/decode", nonce_p, nonce_d, decode_id, prefill_id))
    return prefill_id


def open_link(sock: socket.socket, key: ClusterKey, prefill_id: str, decode_id: str) -> None:
    """Prefill side, on a new connection to decode `decode_id`: returns once both ends are
    proven; HandshakeFailed when the other end is not that decode with our key."""
    with _Deadline(sock) as link:
        hello = link.recv(len(MAGIC) + NONCE)
        if hello[:len(MAGIC)] != MAGIC:
            raise HandshakeFailed("the other end is not a baton KV receiver")
        nonce_d, nonce_p = hello[len(MAGIC):], secrets.token_bytes(NONCE)
        me = prefill_id.encode()
        mac_p = key.mac("kv-link/prefill", nonce_d, nonce_p, prefill_id, decode_id)
        sock.sendall(bytes([len(me)]) + me + nonce_p + mac_p)
        try:
            mac_d = link.recv(MAC)
        except LinkClosed:
            raise HandshakeFailed(f"decode {decode_id} refused our proof (do the cluster keys "
                                  "differ?)") from None
    if not key.verify(mac_d, "kv-link/decode", nonce_p, nonce_d, decode_id, prefill_id):
        raise HandshakeFailed(f"the receiver is not decode {decode_id} with this cluster key")


def _ascii(raw: bytes) -> str:
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        raise HandshakeFailed("a prefill id that is not ASCII") from None
    if not text.isprintable():
        raise HandshakeFailed("a prefill id that is not printable")
    return text


class _Deadline:
    """Inside the block every read and write of `sock` shares one deadline, TIMEOUT_S from its
    start (a peer sending a byte every few seconds cannot stretch it); the socket's own timeout
    is restored after."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.before = sock, sock.gettimeout()
        self.until = time.monotonic() + TIMEOUT_S

    def __enter__(self) -> _Deadline:
        self.sock.settimeout(TIMEOUT_S)
        return self

    def __exit__(self, *_: object) -> None:
        self.sock.settimeout(self.before)

    def recv(self, n: int) -> bytes:
        buf, got = bytearray(n), 0
        while got < n:
            left = self.until - time.monotonic()
            if left <= 0:
                raise HandshakeFailed(f"the handshake took longer than {TIMEOUT_S:g} s")
            self.sock.settimeout(left)
            k = self.sock.recv_into(memoryview(buf)[got:])
            if k == 0:
                raise LinkClosed("peer closed the link")
            got += k
        return bytes(buf)
