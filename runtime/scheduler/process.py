"""The scheduler process: owns the ModelRunner, the Scheduler and the server's role around it;
talks to the HTTP process over ZMQ.

Loop, one breath: receive (non-blocking while there is work, else a bounded wait that a role's
thread can cut short through the wake pipe: a KV transfer that completes is handled at once) →
`scheduler.step()` → `role.poll()` (prefill/decode queues: right after the step, so a room its
outputs moved on goes on in the same breath, and a request the role hands to the scheduler
makes the next receive non-blocking) → send what both returned, in one place → send stats when
they changed. No handoff may wait for the role's poll tick (tests/disagg/test_pd_wakeups.py).
Nothing here keeps its own list of requests: what is in flight is what the scheduler and the
role hold (`inflight`).
Started with multiprocessing `spawn` by `runtime.server.main`; it connects, the HTTP side binds.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import signal
import time
from dataclasses import asdict
from typing import TYPE_CHECKING

import zmq

from runtime.codec import decode
from runtime.config import ServerArgs
from runtime.figures import ServingFigures
from runtime.lifecycle import die_with_parent
from runtime.messages import (
    AbortRequest,
    BatchOutput,
    CacheQuery,
    CacheReport,
    DrainRequest,
    GenerateRequest,
    KVEvents,
    Message,
    PrefixCacheStats,
    ReqOutput,
    RequestError,
    SchedulerReady,
    SchedulerStats,
    ShutdownRequest,
)
from runtime.scheduler.outbox import HttpGone, Outbox
from runtime.scheduler.roles import ColocatedRole, Role, build_role

if TYPE_CHECKING:
    from runtime.disagg.plane import KVPlane

log = logging.getLogger("baton.scheduler")

IDLE_POLL_MS = 200
ALIVE_EVERY_S = 1.0  # at least one message this often: the HTTP side's /ready counts on it
ROLE_POLL_MS = 50  # rooms in flight: check their timeouts at least this often
SHUTDOWN_MAX_STEPS = 10_000
SHUTDOWN_ROLE_S = 10.0  # at shutdown, how long failed rooms may wait for their peer's word


class WakePipe:
    """Lets any thread cut the loop's wait short (a transfer finished, a frame arrived)."""

    def __init__(self) -> None:
        self.r, self.w = os.pipe()
        os.set_blocking(self.r, False)
        os.set_blocking(self.w, False)

    def wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # full: a wake-up is pending anyway
            os.write(self.w, b"\0")

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self.r, 4096):
                pass

    def close(self) -> None:
        os.close(self.r)
        os.close(self.w)


class SchedulerLoop:
    def __init__(self, args: ServerArgs, recv: zmq.Socket[bytes], outbox: Outbox) -> None:
        from runtime.scheduler.ranks import start_model
        from runtime.scheduler.scheduler import Scheduler
        from runtime.scheduler.streamer import OutputStreamer
        from runtime.tokenizer import load_tokenizer, tail_decoder

        self.recv, self.outbox = recv, outbox
        sched_cfg = args.scheduler
        # a decode server's prompt KV arrives by transfer: nothing to reuse unless asked for
        cache = args.engine.disable_prefix_cache
        # under --tp N the other ranks start with it (runtime/scheduler/ranks.py); one that
        # dies ends this process, and with it the server
        self.runner, self.ranks = start_model(
            args.engine, sched_cfg.max_running_requests,
            prefix_cache=not cache if cache is not None else args.role != "decode",
            canary=args.canary, on_death=_end_now)
        if self.runner.kv.cache is not None:
            self.runner.kv.cache.events = []  # GET /kv_events follows them (_send_events)
        self.tokenizer = load_tokenizer(self.runner.model_path)
        self.streamer = OutputStreamer(sched_cfg.stream_interval, sched_cfg.forced_stream_interval)
        self.scheduler = Scheduler(
            sched_cfg, self.runner, decode_tail=tail_decoder(self.tokenizer), streamer=self.streamer,
            canary=args.canary, ranks=self.ranks,
        )
        self.args = args
        self.wakeup = WakePipe()
        self.poller = zmq.Poller()
        self.poller.register(recv, zmq.POLLIN)
        self.poller.register(self.wakeup.r, zmq.POLLIN)
        self.role: Role = ColocatedRole(self.scheduler)  # the real one once warmed up
        self.plane: KVPlane | None = None  # prefill and decode: opened with the role, closed after it
        self.need_step = False  # an abort leaves an output to emit even with no other work
        self.last_stats: SchedulerStats | None = None
        self.warm_up_figures = ServingFigures()  # what the warm-up computed: not traffic
        self.last_sent = 0.0  # monotonic time of the last message to the HTTP process
        self.stopping = False

    # ---- start-up ---------------------------------------------------------------------------
    def warm_up(self) -> None:
        """One short greedy request through the whole path, so the first client pays nothing."""
        from runtime.sampling_params import SamplingParams
        from runtime.scheduler.req import Req

        ids = self.tokenizer.encode("Warm-up: the quick brown fox")
        req = Req("warmup", ids, SamplingParams(max_new_tokens=2, temperature=0.0))
        self.scheduler.add_request(req)
        while self.scheduler.has_work():
            self.scheduler.step()
        self.warm_up_figures = self.scheduler.figures.since(ServingFigures())
        if self.args.role != "colocated":
            from runtime.disagg.plane import open_plane
            from runtime.scheduler.roles import advertise_host

            self.plane = open_plane(self.args, self.runner.pool, self.wakeup.wake,
                                    self.runner.canary, self.scheduler.canary, self.ranks,
                                    self.runner.model_config.num_kv_heads, advertise_host(self.args))
        self.role = build_role(self.args, self.scheduler, self.plane, self.runner.vocab_size,
                               self.wakeup.wake)
        kv = self.runner.kv
        self._send(
            SchedulerReady(
                context_len=self.runner.context_len,
                vocab_size=self.runner.vocab_size,
                kv_capacity_tokens=kv.allocator.num_pages * kv.page_size,
                max_running_requests=self.scheduler.config.max_running_requests,
                kv_transfer=self.plane.transfer.describe() if self.plane else None,
                instance_id=self.plane.name if self.plane else None,
                page_size=kv.page_size,
                prefix_cache=kv.cache is not None,
                architecture=self.runner.model_config.architecture,
                dtype=str(self.runner.dtype).removeprefix("torch."),
                kv_cache_dtype=self.runner.kv_cache_dtype,
            )
        )
        self._send_stats()

    # ---- the loop ---------------------------------------------------------------------------
    def run(self) -> None:
        while not self.stopping:
            self._receive(self._wait_ms())
            self._send_outputs(self._breathe())
            self._send_events()
            self._send_stats()
        self._drain()

    def _breathe(self) -> list[ReqOutput]:
        """The step (when there is work), then the role's queues; the outputs due from both."""
        outputs = []
        if self.scheduler.has_work() or self.need_step:
            self.need_step = False
            outputs = self._step()
        # after the step: a prefill's first token starts its transfer now
        return outputs + self.streamer.emit(self.role.poll())

    def _wait_ms(self) -> int:
        if self.scheduler.has_work() or self.need_step:
            return 0
        return ROLE_POLL_MS if self.role.has_work() else IDLE_POLL_MS

    def _step(self) -> list[ReqOutput]:
        try:
            return self.scheduler.step()
        except HttpGone:
            raise
        except Exception:
            # The process exits, and the HTTP process fails every request in flight as lost
            # (an error event, a 503: TokenizerManager.scheduler_died), which a router follows
            # elsewhere. Never a finish: an "abort" finish would end a stream as if answered,
            # and under TP a failed collective (a rank gone) lands here before the rank's exit.
            log.exception("scheduler step failed with %d requests in flight; exiting",
                          len(self.inflight()))
            raise

    def inflight(self) -> set[str]:
        """The rids of every unfinished request: what the scheduler and the role hold."""
        return {r.rid for r in (*self.scheduler.requests(), *self.role.requests())}

    def _receive(self, wait_ms: int) -> None:
        ready = dict(self.poller.poll(wait_ms)) if wait_ms else {self.recv: zmq.POLLIN}
        if self.wakeup.r in ready:
            self.wakeup.drain()
        self.outbox.check_parent()  # every breath: no orphan keeps generating for nobody
        if not ready:
            return
        while True:
            try:
                raw = self.recv.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._handle(decode(raw))

    def _handle(self, msg: Message) -> None:
        if isinstance(msg, GenerateRequest):
            self._add(msg)
        elif isinstance(msg, AbortRequest):
            if self.role.abort(msg.rid, msg.message):
                self.need_step = True
        elif isinstance(msg, CacheQuery):
            self._send(self._cache_report(msg))
        elif isinstance(msg, DrainRequest):
            self.scheduler.drain()
            self.role.drain()
        elif isinstance(msg, ShutdownRequest):
            for rid in self.inflight():
                self.role.abort(rid, msg.message)
            self.need_step = True
            self.stopping = True
        else:
            log.error("unexpected message %s", type(msg).__name__)

    def _add(self, msg: GenerateRequest) -> None:
        from runtime.disagg.rooms import RoomError
        from runtime.sampling_params import InvalidRequest, SamplingParams
        from runtime.scheduler.req import Req

        try:
            if msg.rid in self.inflight():
                raise InvalidRequest(f"request id {msg.rid!r} is already running", "rid")
            req = Req(
                rid=msg.rid,
                origin_input_ids=list(msg.input_ids),
                sampling_params=SamplingParams.from_dict(msg.sampling_params),
                stream=msg.stream,
                return_logprob=msg.return_logprob or msg.top_logprobs_num > 0,
                top_logprobs_num=msg.top_logprobs_num,
                bootstrap=msg.bootstrap,
                movable=msg.allow_kv_move,
                resumed_outputs=msg.resumed_outputs,
                cache_salt=msg.cache_salt,
            )
            self.role.add(req)
        except InvalidRequest as e:
            self._send(RequestError(msg.rid, str(e), e.field))
            return
        except RoomError as e:
            self._send(RequestError(msg.rid, str(e), "bootstrap_room", e.status))

    def _drain(self) -> None:
        """Shutting down: run until every aborted request has emitted its last output and the
        role's rooms are settled (or SHUTDOWN_ROLE_S passed)."""
        deadline = time.monotonic() + SHUTDOWN_ROLE_S
        for _ in range(SHUTDOWN_MAX_STEPS):
            self._send_outputs(self.streamer.emit(self.role.poll()))
            role_busy = self.role.has_work() and time.monotonic() < deadline
            if not (self.scheduler.has_work() or self.need_step or role_busy):
                break
            self.need_step = False
            if self.scheduler.has_work():
                self._send_outputs(self._step())
            else:
                self._receive(ROLE_POLL_MS)
        self._send_stats()

    # ---- sending ----------------------------------------------------------------------------
    def _send_outputs(self, outputs: list[ReqOutput]) -> None:
        """The one way out of this process for outputs, with the stats of the moment."""
        if not outputs:
            return
        self.last_stats = self.stats()
        self._send(BatchOutput(outputs, self.last_stats))

    def _send_events(self) -> None:
        """What the prefix cache took in and let go this breath (after its outputs, before
        the stats that count them)."""
        cache = self.runner.kv.cache
        if cache is not None and cache.events:
            self._send(KVEvents(cache.take_events()))

    def _send_stats(self) -> None:
        """Stats when they changed, and at least every ALIVE_EVERY_S: a breath of life."""
        stats = self.stats()  # takes the role's counters: they must go out now
        due = time.monotonic() - self.last_sent >= ALIVE_EVERY_S
        if due or stats != self.last_stats or (stats.disagg is not None and stats.disagg.has_counts()):
            self.last_stats = stats
            self._send(BatchOutput([], stats))

    def stats(self) -> SchedulerStats:
        alloc = self.runner.kv.allocator
        return SchedulerStats(
            num_waiting=len(self.scheduler.waiting) + self.role.queued(),
            num_running=self.scheduler.num_running(),
            kv_used_pages=self.runner.kv.used_pages(),
            kv_total_pages=alloc.num_pages,
            page_size=alloc.page_size,
            kv_all_free=self.runner.kv.is_all_free(),
            disagg=self.role.stats.take() if self.role.stats is not None else None,
            prefix_cache=self._cache_stats(),
            queued_prompt_tokens=self.scheduler.queued_prompt_tokens(),
            canary=self.scheduler.canary.stats.copy() if self.scheduler.canary is not None else None,
            retractions=self.scheduler.decode.num_retractions,
            figures=self.scheduler.figures.since(self.warm_up_figures),
        )

    def _cache_stats(self) -> PrefixCacheStats | None:
        cache = self.runner.kv.cache
        if cache is None:
            return None
        s = cache.stats
        return PrefixCacheStats(cache.cached_pages * cache.page_size, s.hit_tokens,
                                s.query_tokens, s.evicted_tokens)

    def _cache_report(self, query: CacheQuery) -> CacheReport:
        kv = self.runner.kv
        freed = kv.flush_cache() * kv.page_size if query.flush else 0
        hashes = kv.cache.hashes() if query.hashes and kv.cache is not None else None
        return CacheReport(query.id, kv.cache is not None, kv.page_size,
                           self._cache_stats() or PrefixCacheStats(), freed, hashes)

    def _send(self, msg: Message) -> None:
        self.outbox.send(msg)
        self.last_sent = time.monotonic()

    def close(self) -> None:
        self.role.close()
        if self.plane is not None:
            self.plane.close()
        self.scheduler.shutdown()
        if self.ranks is not None:
            self.ranks.close()
        self.wakeup.close()


def _end_now(message: str) -> None:
    """A TP rank died: this rank cannot compute alone. The HTTP process sees the exit and
    shuts down (/ready fails, the router retries elsewhere)."""
    log.error("%s; exiting", message)
    logging.shutdown()
    os._exit(1)


def run_scheduler_process(args: ServerArgs, in_addr: str, out_addr: str, parent_pid: int) -> None:
    """Process entry (spawn). Exits 0 after a ShutdownRequest or when the HTTP process (pid
    `parent_pid`) is gone: SIGKILLed with it on Linux, else at the next breath or send."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group; the parent decides
    # a killed HTTP process leaves nobody to serve: go at once (even if it died before this)
    die_with_parent(signal.SIGKILL, parent=parent_pid)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s [scheduler] %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # decode -> prefill calls, per room
    for module in args.plugin:
        importlib.import_module(module)
    ctx = zmq.Context()
    recv, send = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    recv.connect(in_addr)
    send.connect(out_addr)
    outbox = Outbox(send, parent_pid)
    log.info("loading %s (%s)", args.model, asdict(args.engine))
    loop = SchedulerLoop(args, recv, outbox)
    try:
        loop.warm_up()
        log.info("model loaded and warmed up")
        loop.run()
    except HttpGone as e:
        log.warning("%s; exiting", e)
    finally:
        loop.close()
        recv.close(0)
        outbox.close()
        ctx.term()
