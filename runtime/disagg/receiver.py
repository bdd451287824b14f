"""The decode server's KV receiver: a TCP listener that prefill servers open one link to.

Per link, one thread reads frames in order: a PagesFrame's payload goes straight into the pool
and a RoomDone's aux record to the backend's arrivals (tcp backend); a RoomFailed goes into
`failed` for the decode role's loop (`wake` tells it). A link that sends garbage is closed; its
rooms then fail by the decode's timeouts or heartbeats, never by guesswork here.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import threading
from collections.abc import Callable

from runtime.disagg.transfer.base import KVTransfer, TransferError
from runtime.disagg.wire import LinkClosed, PagesFrame, RoomDone, RoomFailed, recv_frame

log = logging.getLogger(__name__)


class KVReceiver:
    def __init__(self, host: str, transfer: KVTransfer, wake: Callable[[], None]) -> None:
        self.transfer = transfer
        self.wake = wake
        self.failed: queue.SimpleQueue[RoomFailed] = queue.SimpleQueue()
        self.listener = socket.create_server((host, 0), backlog=64)
        self.port: int = self.listener.getsockname()[1]
        self.links: set[socket.socket] = set()
        self.closed = False
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="kv-receiver", daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                sock, peer = self.listener.accept()
            except OSError:
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self.links.add(sock)
            threading.Thread(target=self._serve, args=(sock, peer), name="kv-link", daemon=True).start()

    def _serve(self, sock: socket.socket, peer: object) -> None:
        try:
            while True:
                frame = recv_frame(sock)
                if isinstance(frame, PagesFrame):
                    self.transfer.read_pages(frame, sock)
                elif isinstance(frame, RoomDone):
                    self.transfer.read_done(frame.aux)  # wakes the loop (`on_arrival`)
                else:
                    self.failed.put(frame)
                    self.wake()
        except (LinkClosed, OSError) as e:
            if not self.closed:
                log.info("KV link from %s closed: %s", peer, e)
        except (TransferError, ValueError) as e:
            log.error("KV link from %s sent a bad frame, closing it: %s", peer, e)
        finally:
            with self._lock:
                self.links.discard(sock)
            sock.close()

    def close(self) -> None:
        self.closed = True
        self.listener.close()
        with self._lock:
            links, self.links = list(self.links), set()
        for sock in links:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
