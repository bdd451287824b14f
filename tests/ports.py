"""Ports for the servers a test starts, picked where nothing else picks them.

A port taken with `bind(("127.0.0.1", 0))` comes from the kernel's ephemeral range, the same
range every outgoing connection takes its source port from: between the pick and the server's
own bind, any connection of any process on the machine may take it ("Address already in use",
seen under two pytest workers). So ports are picked below the ephemeral range (Linux's default
starts at 32768), each pytest-xdist worker in a band of its own so that two workers never pick
the same one, and a port is handed out only after a bind to it succeeded.
"""

from __future__ import annotations

import os
import random
import socket

LOW, HIGH = 21000, 32000  # below /proc/sys/net/ipv4/ip_local_port_range's 32768
BANDS = 8  # pytest-xdist workers gw0..gw7 each get their own slice


def _band() -> range:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # "gw1" under xdist, "" otherwise
    index = int(worker[2:]) % BANDS if worker.startswith("gw") and worker[2:].isdigit() else 0
    width = (HIGH - LOW) // BANDS
    start = LOW + index * width
    return range(start, start + width)


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct ports that were free on `host` a moment ago, from this worker's band."""
    band, found, held = _band(), [], []
    try:
        for port in random.sample(band, len(band)):
            s = socket.socket()
            try:
                s.bind((host, port))
            except OSError:
                s.close()
                continue
            held.append(s)
            found.append(port)
            if len(found) == n:
                return found
    finally:
        for s in held:
            s.close()
    raise OSError(f"no {n} free ports on {host} in {band.start}-{band.stop - 1}")


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]
