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

Beside the forwards, rank 0 and each follower share a socket (`Calls`): rank 0 calls its
followers' KV planes on it (a prefill or decode server's ranks each move their own heads' KV:
runtime/disagg/ranks_plane.py; the KV canary's checksums and fault injection:
runtime/canary/ranks.py), and a follower tells rank 0 of its KV events on it. A thread on
each side serves it, so a KV call never waits behind a forward.

Failure is bounded: a rank that hangs makes the next collective time out (`--tp-timeout-s`);
a follower that dies is seen at once by rank 0's watchdog, which ends rank 0 (`on_death`);
followers die with rank 0 (PDEATHSIG) and leave when their stdin closes.
"""

from __future__ import annotations

import contextlib
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
from concurrent.futures import Future
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
                  on_death, canary)
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



class RankCallError(RuntimeError):
    """A call that failed on follower `rank`, with the name of the exception it raised there
    (`kind`: e.g. "WriteInDoubt", which the caller may tell from other failures)."""

    def __init__(self, rank: int, kind: str, message: str) -> None:
        super().__init__(f"TP rank {rank}: {kind}: {message}")
        self.rank, self.kind = rank, kind

class Calls:
    """One end of the KV call socket between rank 0 and a follower: messages (a length, then a
    pickle) both ways, sent under a lock from any thread. Rank 0 sends ("call", id, op, args)
    and gets ("reply", id, error or None, value); a follower also sends ("event", name, args).
    A send waits at most `timeout_s` for the other side to read (a hung peer fails it); a
    receive waits without a limit (the serving thread's; the process's end closes the socket)."""

    def __init__(self, sock: socket.socket, timeout_s: float) -> None:
        self.sock, self.lock, self.timeout_s = sock, threading.Lock(), timeout_s
        sock.setblocking(True)

    def send(self, message: Any) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        view = memoryview(_HEADER.pack(len(data)) + data)
        with self.lock:
            deadline = time.monotonic() + self.timeout_s
            while view:
                if not _ready(self.sock.fileno(), select.POLLOUT, deadline):
                    raise TimeoutError(f"the other TP rank read nothing for {self.timeout_s:.0f} s")
                try:
                    view = view[self.sock.send(view, socket.MSG_DONTWAIT):]
                except BlockingIOError:
                    continue

    def recv(self) -> Any:
        """The next message; EOFError when the other side is gone."""
        (n,) = _HEADER.unpack(self._exact(_HEADER.size))
        return pickle.loads(self._exact(n))

    def _exact(self, n: int) -> bytes:
        buf, got = bytearray(n), 0
        while got < n:
            k = self.sock.recv_into(memoryview(buf)[got:])
            if k == 0:
                raise EOFError
            got += k
        return bytes(buf)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


class Ranks:
    """Rank 0's side: the followers it started, the batches it sends them, the KV calls."""

    def __init__(self, config: EngineConfig, max_running_requests: int, size: int, port: int,
                 timeout_s: float, on_death: Callable[[str], None] | None = None,
                 canary: CanaryConfig | None = None) -> None:
        """Start followers 1..size-1 and join them (rank 0) in the group on `port`
        (`wait_ready` then waits for their parts to load). `on_death(message)`: what a
        follower's death does to rank 0, from the moment it starts (None: log it; the next
        collective then fails). `canary`: the KV canary, which every rank runs on its own KV."""
        self.size, self.timeout_s, self.closing = size, timeout_s, False
        self.procs: list[subprocess.Popen[bytes]] = []
        self.calls: list[Calls] = []
        self.pending: dict[int, Future[Any]] = {}
        self.next_id = 0
        self.lock = threading.Lock()
        # what a follower's KV event does here (runtime/disagg/ranks_plane.py sets it)
        self.on_event: Callable[[int, str, tuple[Any, ...]], None] = lambda *_: None
        start = (config, max_running_requests, canary, size, port, timeout_s, os.getpid())
        try:
            for rank in range(1, size):
                mine, theirs = socket.socketpair()
                self.calls.append(Calls(mine, timeout_s))
                fd = theirs.fileno()  # the same number in the follower (pass_fds keeps it)
                with theirs:
                    proc = subprocess.Popen([sys.executable, "-m", "runtime.scheduler.ranks"],
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                            pass_fds=(fd,))
                self.procs.append(proc)
                assert proc.stdin is not None
                _write(proc.stdin, (rank, *start, fd), timeout_s)
                threading.Thread(target=self._serve, args=(rank,), daemon=True,
                                 name=f"tp-calls-{rank}").start()
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

    @property
    def followers(self) -> range:
        return range(1, self.size)

    def call(self, rank: int, op: str, *args: Any) -> Future[Any]:
        """Call `op` on follower `rank`'s KV plane; the future fails with RuntimeError when it
        raised there (its message), or with the follower gone."""
        future: Future[Any] = Future()
        with self.lock:
            self.next_id += 1
            self.pending[self.next_id] = future
            key = self.next_id
        try:
            self.calls[rank - 1].send(("call", key, op, args))
        except OSError as e:
            with self.lock:
                self.pending.pop(key, None)
            future.set_exception(RuntimeError(f"TP rank {rank} cannot be called: {e}"))
        return future

    def _serve(self, rank: int) -> None:
        """Replies and events from follower `rank`, until it is gone."""
        calls = self.calls[rank - 1]
        try:
            while True:
                kind, *rest = calls.recv()
                if kind == "event":
                    self.on_event(rank, *rest)
                    continue
                key, error, value = rest
                with self.lock:
                    future = self.pending.pop(key, None)
                if future is None:
                    continue
                if error is not None:
                    future.set_exception(RankCallError(rank, *error))
                else:
                    future.set_result(value)
        except (EOFError, OSError):
            pass
        except Exception:
            log.exception("TP rank %d's KV calls", rank)
        with self.lock:
            gone, self.pending = self.pending, {}
        for future in gone.values():
            if not future.done():
                future.set_exception(RuntimeError(f"TP rank {rank} is gone"))

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
        for calls in self.calls:
            calls.close()
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
        rank, config, max_running, canary, size, port, timeout_s, parent, calls_fd = _read(inbox)
    except EOFError:  # rank 0 went before it said who this is
        return 1
    calls = Calls(socket.socket(fileno=calls_fd), timeout_s)
    die_with_parent(signal.SIGKILL, parent=parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group; rank 0 decides
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s %(levelname)s [tp{rank}] %(message)s")
    try:
        join_group(rank, size, port, config.device, timeout_s)
        model = ModelRunner(config, max_running, prefix_cache=False, canary=canary, rank=rank)
        runner: Runner = model
        future_map = FutureMap(max_running, runner.device)
    except Exception as e:  # logged, and reported to rank 0, which names it
        log.exception("TP rank %d could not start", rank)
        status.write(f"{type(e).__name__}: {e}\n".encode())
        status.flush()
        return 1
    status.write(f"{READY}\n".encode())
    status.flush()
    threading.Thread(target=_serve_calls, args=(calls, model, rank), daemon=True,
                     name="tp-calls").start()
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
        calls.close()
        leave_group()


def _serve_calls(calls: Calls, model: ModelRunner, rank: int) -> None:
    """A follower's KV calls from rank 0: the fence's (expect, revoke, discard) and the KV
    canary's (runtime/canary/ranks.py) answered in order on this thread, writes of its shares
    on the plane's writer threads (they wait on the network)."""
    from concurrent.futures import ThreadPoolExecutor

    from runtime.canary.ranks import RankCanary, serve
    from runtime.disagg.ranks_plane import FollowerPlane

    pool = model.pool
    canary = RankCanary(model.canary) if model.canary is not None else None
    plane: FollowerPlane | None = None
    writers = ThreadPoolExecutor(2, thread_name_prefix="kv-share")

    def event(name: str, *args: Any) -> None:
        with contextlib.suppress(OSError):
            calls.send(("event", name, *args))

    def answer(key: int, op: str, args: tuple[Any, ...]) -> None:
        nonlocal plane
        try:
            if op == "open":
                plane = FollowerPlane.open(pool, rank, event, *args)
                value = plane.reached
            elif op.startswith("canary."):
                value = serve(canary, op, args)
            else:
                assert plane is not None, "the KV plane is not open"
                value = getattr(plane, op)(*args)
            reply: tuple[Any, ...] = ("reply", key, None, value)
        except Exception as e:  # the call fails at rank 0, with this message
            log.warning("KV call %s: %s", op, e)
            reply = ("reply", key, (type(e).__name__, str(e)), None)
        with contextlib.suppress(OSError):
            calls.send(reply)

    while True:
        try:
            _, key, op, args = calls.recv()
        except (EOFError, OSError):
            writers.shutdown(wait=False, cancel_futures=True)
            if plane is not None:
                plane.close()
            return
        if op == "write":
            writers.submit(answer, key, op, args)
        else:
            answer(key, op, args)


if __name__ == "__main__":
    status = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever else prints goes to the log, not into the status pipe
    sys.exit(follow(sys.stdin.buffer, status))
