"""A TCP forwarder that can cut the line: a network partition between two real processes.

Connections to `port` are forwarded to `target`. `cut()` stops forwarding (bytes already sent
wait in the forwarder, new connections are accepted and held), `heal()` lets everything through
again, as a partition that heals does: what was held arrives late. Test infrastructure only: the
processes on both ends are the real ones.
"""

from __future__ import annotations

import contextlib
import socket
import threading


class Partition:
    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self.open = threading.Event()
        self.open.set()
        self.closed = False
        self.socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def cut(self) -> None:
        self.open.clear()

    def heal(self) -> None:
        self.open.set()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._join, args=(client,), daemon=True).start()

    def _join(self, client: socket.socket) -> None:
        self.open.wait()
        try:
            server = socket.create_connection(self.target, timeout=5)
        except OSError:
            client.close()
            return
        server.settimeout(None)
        self.socks += [client, server]
        for a, b in ((client, server), (server, client)):
            threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                self.open.wait()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.closed = True
        self.open.set()
        self.listener.close()
        for s in self.socks:
            with contextlib.suppress(OSError):
                s.close()
