"""Tensor parallelism's processes: one rank decides, the others follow.

Rank 0 is the process that schedules (`baton serve`'s scheduler process, or the offline
Engine's). It starts ranks 1..N-1 as processes of their own (`python -m runtime.scheduler.ranks`),
each with its part of the model and of the KV pool (runtime/models/parallel.py), and joins them
in one torch.distributed group (gloo on the CPU; nccl when every rank has a GPU of its own).
Every forward rank 0 launches goes to every follower as it is launched (the host batch, before
its future tokens are resolved), in launch order, over the follower's stdin; the follower runs
the same forward on its part, meets rank 0 in the same collectives, and samples the same tokens
from the same gathered logits, so its future map holds what rank 0's holds. A follower never
decides anything: there is nothing for the ranks to disagree on.

Failure is bounded: a rank that hangs makes the next collective time out (`--tp-timeout-s`);
a follower that dies is seen at once by rank 0's watchdog, which ends rank 0 (`on_death`);
followers die with rank 0 (PDEATHSIG) and leave when their stdin closes.
"""

from __future__ import annotations

import logging
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import IO, TYPE_CHECKING, Any

import torch

from runtime.config import CanaryConfig, EngineConfig
from runtime.forward_batch import ForwardBatch
from runtime.scheduler.future import FutureMap
from runtime.scheduler.runner import Runner, run_forward

if TYPE_CHECKING:
    from runtime.engine.model_runner import ModelRunner

log = logging.getLogger(__name__)

READY = "ready"
_HEADER = struct.Struct("<Q")  # each message: its length, then its pickle


def start_model(config: EngineConfig, max_running_requests: int, prefix_cache: bool | None = None,
                canary: CanaryConfig | None = None, on_death: Callable[[str], None] | None = None,
                ) -> tuple[ModelRunner, Ranks | None]:
    """Rank 0's runner; under `config.tp` > 1 also the followers, started first and loaded
    alongside (None when there is one rank). A model the TP size cannot split is refused
    before any process starts."""
    from runtime.engine.model_runner import ModelRunner
    from runtime.model_store import resolve_model_path
    from runtime.models.registry import check_architecture

    if config.tp == 1:
        return ModelRunner(config, max_running_requests, prefix_cache, canary), None
    check_architecture(resolve_model_path(config.model), config.tp)
    ranks = Ranks(config, max_running_requests, config.tp, _free_port(), config.tp_timeout_s,
                  on_death)
    try:
        runner = ModelRunner(config, max_running_requests, prefix_cache, canary)
        ranks.wait_ready(config.tp_timeout_s)
    except BaseException:
        ranks.close()
        raise
    return runner, ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def backend_for(device: str, size: int) -> str:
    """nccl when every rank has a GPU of its own, else gloo (CUDA tensors included)."""
    if device.startswith("cuda") and torch.cuda.device_count() >= size:
        return "nccl"
    return "gloo"


def join_group(rank: int, size: int, port: int, device: str, timeout_s: float) -> None:
    import torch.distributed as dist

    dist.init_process_group(backend_for(device, size), init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=size, timeout=timedelta(seconds=timeout_s))


def leave_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


class Ranks:
    """Rank 0's side: the followers it started, the batches it sends them."""

    def __init__(self, config: EngineConfig, max_running_requests: int, size: int, port: int,
                 timeout_s: float, on_death: Callable[[str], None] | None = None) -> None:
        """Start followers 1..size-1 and join them (rank 0) in the group on `port`
        (`wait_ready` then waits for their parts to load). `on_death(message)`: what a
        follower's death does to rank 0, from the moment it starts (None: log it; the next
        collective then fails)."""
        self.size, self.timeout_s, self.closing = size, timeout_s, False
        self.procs: list[subprocess.Popen[bytes]] = []
        start = (config, max_running_requests, size, port, timeout_s, os.getpid())
        try:
            for rank in range(1, size):
                proc = subprocess.Popen([sys.executable, "-m", "runtime.scheduler.ranks"],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE)
                self.procs.append(proc)
                assert proc.stdin is not None
                _write(proc.stdin, (rank, *start), timeout_s)
            self.watchdogs = [threading.Thread(target=self._watch, args=(rank, proc, on_death),
                                               daemon=True, name=f"tp-watch-{rank}")
                              for rank, proc in enumerate(self.procs, start=1)]
            for t in self.watchdogs:
                t.start()
            join_group(0, size, port, config.device, timeout_s)
        except BaseException:
            self.close()
            raise

    def wait_ready(self, timeout_s: float) -> None:
        """Every follower's part is loaded (after rank 0's own: their pools are sized together)."""
        deadline = time.monotonic() + timeout_s
        for rank, proc in enumerate(self.procs, start=1):
            assert proc.stdout is not None
            line = _read_line(proc.stdout, deadline)
            if line != READY:
                self.close()
                raise RuntimeError(f"TP rank {rank} did not start: {line or 'no answer'}")

    def send(self, batch: ForwardBatch, future_indices: torch.Tensor | None) -> None:
        """The forward about to be launched, to every follower (in launch order)."""
        for proc in self.procs:
            assert proc.stdin is not None
            _write(proc.stdin, (batch, future_indices), self.timeout_s)

    def close(self) -> None:
        """Stop the followers (a stop message, then a bounded wait, then SIGKILL), leave."""
        self.closing = True
        for proc in self.procs:
            try:
                assert proc.stdin is not None
                _write(proc.stdin, None, 1.0)
                proc.stdin.close()
            except (OSError, TimeoutError):
                pass
        for proc in self.procs:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
            if proc.stdout is not None:
                proc.stdout.close()
        leave_group()

    def _watch(self, rank: int, proc: subprocess.Popen[bytes],
               on_death: Callable[[str], None] | None) -> None:
        code = proc.wait()
        if self.closing:
            return
        message = f"TP rank {rank} exited with code {code}: the group cannot compute without it"
        log.error("%s", message)
        if on_death is not None:
            on_death(message)


def _write(pipe: IO[bytes], obj: Any, timeout_s: float) -> None:
    """One message, or TimeoutError when the reader stops reading (a hung follower)."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(_HEADER.pack(len(data)) + data)
    fd, deadline = pipe.fileno(), time.monotonic() + timeout_s
    os.set_blocking(fd, False)
    while view:
        if not _ready(fd, select.POLLOUT, deadline):
            raise TimeoutError(f"a TP follower read nothing for {timeout_s:.0f} s")
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:
            continue


def _ready(fd: int, event: int, deadline: float) -> bool:
    """Whether `fd` is ready for `event` (or hung up) before `deadline`. poll, not select: a
    process with many files may hand out descriptors above select's 1024."""
    poller = select.poll()
    poller.register(fd, event)
    return bool(poller.poll(max(0.0, deadline - time.monotonic()) * 1000))


def _read(pipe: IO[bytes]) -> Any:
    """One message (blocking); EOFError when rank 0 is gone."""
    head = pipe.read(_HEADER.size)
    if len(head) < _HEADER.size:
        raise EOFError
    (n,) = _HEADER.unpack(head)
    data = pipe.read(n)
    if len(data) < n:
        raise EOFError
    return pickle.loads(data)


def _read_line(pipe: IO[bytes], deadline: float) -> str:
    fd, line = pipe.fileno(), b""
    while not line.endswith(b"\n"):
        if not _ready(fd, select.POLLIN, deadline):
            return ""
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        line += chunk
    return line.decode(errors="replace").strip()


# ---- a follower -------------------------------------------------------------------------------
def follow(inbox: IO[bytes], status: IO[bytes]) -> int:
    """A follower's life: its start message, its part of the model, then every forward rank 0
    sends, until a stop message or rank 0's end."""
    from runtime.engine.model_runner import ModelRunner
    from runtime.lifecycle import die_with_parent

    try:
        rank, config, max_running, size, port, timeout_s, parent = _read(inbox)
    except EOFError:  # rank 0 went before it said who this is
        return 1
    die_with_parent(signal.SIGKILL, parent=parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group; rank 0 decides
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s %(levelname)s [tp{rank}] %(message)s")
    try:
        join_group(rank, size, port, config.device, timeout_s)
        runner: Runner = ModelRunner(config, max_running, prefix_cache=False, rank=rank)
        future_map = FutureMap(max_running, runner.device)
    except Exception as e:  # logged, and reported to rank 0, which names it
        log.exception("TP rank %d could not start", rank)
        status.write(f"{type(e).__name__}: {e}\n".encode())
        status.flush()
        return 1
    status.write(f"{READY}\n".encode())
    status.flush()
    try:
        while True:
            try:
                message = _read(inbox)
            except EOFError:
                log.warning("rank 0 is gone; exiting")
                return 0
            if message is None:
                return 0
            batch, future_indices = message
            run_forward(runner, future_map, batch, future_indices)
    finally:
        leave_group()


if __name__ == "__main__":
    status = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever else prints goes to the log, not into the status pipe
    sys.exit(follow(sys.stdin.buffer, status))
