"""The decode server's KV receiver: a TCP listener (`--kv-port`) that prefill servers open one
link to.

A link starts with the handshake (handshake.py): the prefill proves the cluster key and its
instance id within one deadline, or the link is closed (counted as `bad_link`). At most
MAX_UNPROVEN links wait for their proof at once; a new link that finds them all taken closes the
oldest that has waited MIN_WAIT_S, so peers that connect and then dawdle (a slow-loris) cannot
keep a real prefill, whose proof takes milliseconds, from getting in. Then one thread per link reads frames in order, each bounded by the pool
(`header_limit`) and checked as it is decoded: a PagesFrame's payload goes into the pool only if
its room admits it (the room is expected from this link's prefill and names exactly the room's
pages; else it is read into nothing and counted as `refused_write`), a RoomDone's aux record to
the backend's arrivals, a RoomFailed into `failed` for the decode role's loop (`wake` tells it),
with the link's prefill id. A frame that is not one of ours closes the link (`bad_frame`); its
rooms then fail by the decode's timeouts or heartbeats. Nothing a peer sends raises out of here.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable

from runtime.auth.key import ClusterKey
from runtime.disagg.handshake import HandshakeFailed, accept_link
from runtime.disagg.tally import Tally
from runtime.disagg.transfer.base import KVTransfer, TransferError
from runtime.disagg.wire import (
    BadFrame,
    LinkClosed,
    PagesFrame,
    RoomDone,
    RoomFailed,
    header_limit,
    recv_frame,
)

log = logging.getLogger(__name__)

MAX_UNPROVEN = 64  # links still in their handshake
MIN_WAIT_S = 0.5  # an unproven link this old may be closed for a newcomer


class KVReceiver:
    def __init__(self, host: str, port: int, transfer: KVTransfer, key: ClusterKey,
                 decode_id: str, wake: Callable[[], None], tally: Tally,
                 also_close: Callable[[str], None] = lambda prefill: None) -> None:
        """`also_close(prefill)`: break off that prefill's links elsewhere too (the other TP
        ranks' receivers)."""
        self.transfer, self.key, self.decode_id = transfer, key, decode_id
        self.also_close = also_close
        self.wake, self.tally = wake, tally
        self.failed: queue.SimpleQueue[tuple[str, RoomFailed]] = queue.SimpleQueue()
        try:
            self.listener = socket.create_server((host, port), backlog=64)
        except OSError as e:
            raise OSError(f"KV receiver cannot listen on {host}:{port}: {e} (--kv-port)") from e
        self.port: int = self.listener.getsockname()[1]
        self.limit = header_limit(transfer.pool.num_pages, transfer.pool.page_size)
        self.links: dict[socket.socket, str | None] = {}  # -> the proven prefill id
        self.unproven: dict[socket.socket, float] = {}  # -> since when; the oldest first
        self.closed = False
        self._lock = threading.Lock()

    def start(self) -> None:
        """Serve the links that come to the port (bound already: peers may be told it)."""
        threading.Thread(target=self._accept, name="kv-receiver", daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                sock, peer = self.listener.accept()
            except OSError:
                return
            if not self._make_room():
                self.tally.add("bad_link")
                sock.close()
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self.links[sock] = None
                self.unproven[sock] = time.monotonic()
            threading.Thread(target=self._serve, args=(sock, peer), name="kv-link", daemon=True).start()

    def _make_room(self) -> bool:
        """Whether a new link may wait for its proof: there is room, or the oldest unproven
        link has waited MIN_WAIT_S and is closed for it (its handshake then fails)."""
        with self._lock:
            if len(self.unproven) < MAX_UNPROVEN:
                return True
            oldest, since = next(iter(self.unproven.items()))
            if time.monotonic() - since < MIN_WAIT_S:
                return False
            del self.unproven[oldest]
        with contextlib.suppress(OSError):
            oldest.shutdown(socket.SHUT_RDWR)
        return True

    def _serve(self, sock: socket.socket, addr: object) -> None:
        try:
            prefill = self._prove(sock, addr)
            if prefill is not None:
                self._read(sock, prefill)
        finally:
            with self._lock:
                self.links.pop(sock, None)
            sock.close()

    def _prove(self, sock: socket.socket, addr: object) -> str | None:
        try:
            prefill = accept_link(sock, self.key, self.decode_id)
        except (HandshakeFailed, OSError) as e:
            self.tally.add("bad_link")
            log.warning("KV link from %s refused: %s", addr, e)
            return None
        finally:
            with self._lock:
                self.unproven.pop(sock, None)
        with self._lock:
            if sock not in self.links:  # closed meanwhile (close_links, close)
                return None
            self.links[sock] = prefill
        return prefill

    def _read(self, sock: socket.socket, prefill: str) -> None:
        try:
            while True:
                frame = recv_frame(sock, self.limit)
                if isinstance(frame, PagesFrame):
                    if not self.transfer.read_pages(frame, sock, prefill):
                        self.tally.add("refused_write")
                        log.warning("KV for room %d from %s refused: not a room it may write now",
                                    frame.room, prefill)
                elif isinstance(frame, RoomDone):
                    self.transfer.read_done(frame.aux, prefill)  # wakes the loop (`on_arrival`)
                else:
                    self.failed.put((prefill, frame))
                    self.wake()
        except (LinkClosed, OSError) as e:
            if not self.closed:
                log.info("KV link from %s closed: %s", prefill, e)
        except (BadFrame, TransferError, ValueError) as e:
            self.tally.add("bad_frame")
            log.error("KV link from %s sent a bad frame, closing it: %s", prefill, e)
        except Exception:  # never let a peer's bytes take the receiver down
            self.tally.add("bad_frame")
            log.exception("KV link from %s: unexpected error, closing it", prefill)

    def close_links(self, prefill: str) -> None:
        """Break off every link of prefill `prefill` (declared gone): a write landing on one
        ends now, and the prefill must open (and prove) a new link to send again."""
        with self._lock:
            links = [s for s, p in self.links.items() if p == prefill]
        for sock in links:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self.also_close(prefill)

    def close(self) -> None:
        self.closed = True
        self.listener.close()
        with self._lock:
            links, self.links = list(self.links), {}
        for sock in links:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
