"""The scheduler process's way out to the HTTP process: a ZMQ PUSH socket whose sends never
block for ever.

A send waits at most SEND_TIMEOUT_MS for room in the queue. If the HTTP process is gone by then
(the one that started us: its pid is no longer our parent's), `HttpGone` ends the scheduler;
if it lives, it is slow rather than dead and the send is tried again. Closing waits LINGER_MS
at most for what is still queued.
"""

from __future__ import annotations

import logging
import os

import zmq

from runtime.codec import encode
from runtime.messages import Message

log = logging.getLogger("baton.scheduler")

SEND_TIMEOUT_MS = 1000
LINGER_MS = 2000
WARN_EVERY = 30  # retries between two warnings that the HTTP process is not reading


class HttpGone(Exception):
    """The HTTP process that started this scheduler has exited: nobody is left to serve."""


class Outbox:
    def __init__(self, sock: zmq.Socket[bytes], parent_pid: int) -> None:
        sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
        sock.setsockopt(zmq.LINGER, LINGER_MS)
        self.sock = sock
        self.parent_pid = parent_pid

    def parent_alive(self) -> bool:
        """Orphans are re-parented (to init or a subreaper): a new parent pid means ours died."""
        return os.getppid() == self.parent_pid

    def check_parent(self) -> None:
        if not self.parent_alive():
            raise HttpGone(f"the HTTP process (pid {self.parent_pid}) is gone")

    def send(self, msg: Message) -> None:
        data = encode(msg)
        retries = 0
        while True:
            try:
                self.sock.send(data)
                return
            except zmq.Again:
                self.check_parent()
                if retries % WARN_EVERY == 0:
                    log.warning("the HTTP process has not taken a message for %.0f s; waiting",
                                (retries + 1) * SEND_TIMEOUT_MS / 1000)
                retries += 1

    def close(self) -> None:
        self.sock.close()
