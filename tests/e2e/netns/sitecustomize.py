"""A pod's own network namespace, as far as listening goes (the local cluster's pod runner
puts this folder first on every pod process's PYTHONPATH; Python imports it at start-up).

In a pod, `--host 0.0.0.0` listens on the pod's addresses only: its IP and its private
loopback. Here all pods share the host's network, so two pods with the same container port
would collide. This narrows a wildcard bind (`0.0.0.0` or `""`) to the pod's IP from
$LOCAL_CLUSTER_POD_IP, for every socket of the process and of the processes it starts, and
changes nothing else: the rendered args run as written and no port is rewritten.
"""

from __future__ import annotations

import os
import socket

_POD_IP = os.environ.get("LOCAL_CLUSTER_POD_IP", "")
_WILDCARDS = ("0.0.0.0", "")
_bind = socket.socket.bind


def _pod_bind(self: socket.socket, address: object) -> None:
    if (_POD_IP and self.family == socket.AF_INET and isinstance(address, tuple)
            and address[0] in _WILDCARDS):
        address = (_POD_IP, *address[1:])
    _bind(self, address)


if _POD_IP:
    socket.socket.bind = _pod_bind  # type: ignore[method-assign]
