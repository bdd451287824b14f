"""Issue 12, item 3: no send from the scheduler blocks for ever. With nobody reading, a send
gives up as soon as the HTTP process is gone, and waits for it while it lives."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

import pytest
import zmq

from runtime.messages import AbortRequest
from runtime.scheduler.outbox import SEND_TIMEOUT_MS, HttpGone, Outbox


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.fixture
def push(tmp_path: Path):  # type: ignore[no-untyped-def]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 1)
    sock.connect(f"ipc://{tmp_path}/nobody-binds-this")  # as after the HTTP process died
    yield ctx, sock, f"ipc://{tmp_path}/nobody-binds-this"
    sock.close(0)
    ctx.term()


def _send_all(outbox: Outbox, n: int, errors: list[BaseException]) -> None:
    try:
        for i in range(n):
            outbox.send(AbortRequest(f"r{i}"))
    except BaseException as e:
        errors.append(e)


def test_a_send_nobody_takes_ends_when_the_http_process_is_gone(push) -> None:  # type: ignore[no-untyped-def]
    _, sock, _ = push
    outbox = Outbox(sock, parent_pid=_dead_pid())  # our parent is not that pid: it is gone
    errors: list[BaseException] = []
    began = time.monotonic()
    sender = threading.Thread(target=_send_all, args=(outbox, 100, errors), daemon=True)
    sender.start()
    sender.join(SEND_TIMEOUT_MS / 1000 * 5)
    assert not sender.is_alive(), "a send blocked for ever"
    assert len(errors) == 1 and isinstance(errors[0], HttpGone), errors
    assert time.monotonic() - began < SEND_TIMEOUT_MS / 1000 * 3


def test_a_live_but_slow_reader_gets_every_message(push) -> None:  # type: ignore[no-untyped-def]
    ctx, sock, addr = push
    outbox = Outbox(sock, parent_pid=os.getppid())
    errors: list[BaseException] = []
    sender = threading.Thread(target=_send_all, args=(outbox, 5, errors), daemon=True)
    sender.start()
    time.sleep(SEND_TIMEOUT_MS / 1000 * 1.5)  # the queue is full and a send has timed out once
    assert sender.is_alive() and not errors
    pull = ctx.socket(zmq.PULL)
    pull.bind(addr)
    try:
        got = [pull.recv() for _ in range(5)]
    finally:
        pull.close(0)
    sender.join(10)
    assert not sender.is_alive() and not errors and len(got) == 5
