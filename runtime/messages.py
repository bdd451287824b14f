"""Messages between the HTTP process and the scheduler process (and the offline Engine).

Plain dataclasses; one msgpack codec (runtime.codec) carries them over ZMQ.
Outputs are incremental: each ReqOutput carries only what is new since the request's last one,
and `ReqOutput.concat` coalesces several of them into one (list-valued keys concatenated).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from runtime.figures import ForwardTotals, Moments, ServingFigures
from runtime.handover import Bootstrap, Handover, KVOffer

# "moved" and "drained" end a decode's stream that goes on elsewhere (runtime/handover.py):
# outcomes, not failures; the HTTP side turns them into the stream's hand-over event
FinishKind = Literal["stop", "length", "abort", "moved", "drained"]


@dataclass(frozen=True)
class FinishReason:
    kind: FinishKind
    matched: int | str | None = None  # the stop token id or stop string that ended it
    message: str | None = None  # why, for aborts
    offer: KVOffer | None = None  # "moved": where the request's KV waits for another decode

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.kind, "matched": self.matched, "message": self.message}

    def handover(self) -> Handover | None:
        """The hand-over this finish is (None: a finish of the stream itself)."""
        if self.kind == "moved":
            return Handover("moved", self.offer)
        if self.kind == "drained":
            return Handover("drained")
        return None


# ---- HTTP process -> scheduler process --------------------------------------------------------


@dataclass
class GenerateRequest:
    rid: str
    input_ids: list[int]
    sampling_params: dict[str, Any]
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    bootstrap: Bootstrap | None = None  # PD: its room and prefill (the ticket verified here)
    allow_kv_move: bool = False  # its client can follow it to another decode (a router)
    resumed_outputs: int = 0  # a resumed stream: the last input ids it had generated already
    cache_salt: str | None = None  # the prefix cache's namespace (runtime/kvcache/radix.py)


@dataclass
class AbortRequest:
    rid: str
    message: str = "aborted by client"


@dataclass
class DrainRequest:
    """The server is draining (SIGTERM): keep each step short from now on (small prefill
    chunks), so the aborts that come when the grace period ends take effect soon."""


@dataclass
class CacheQuery:
    """What the prefix cache holds (`CacheReport` answers, naming `id`); with `flush`, free
    every page it holds unlocked first (POST /flush_cache)."""

    id: int
    flush: bool = False
    hashes: bool = False  # list the block hash of every cached page


@dataclass
class ShutdownRequest:
    """Abort whatever is still in flight, free its KV, and exit the scheduler process."""

    message: str = "server shutting down"


# ---- scheduler process -> HTTP process --------------------------------------------------------


@dataclass
class SchedulerReady:
    """Sent once the model is loaded and a warm-up forward ran: the HTTP side may serve."""

    context_len: int
    vocab_size: int
    kv_capacity_tokens: int
    max_running_requests: int
    kv_transfer: dict[str, Any] | None = None  # prefill/decode: backend and KV layout
    instance_id: str | None = None  # prefill/decode: its KV instance (room tickets name it)
    page_size: int = 1
    prefix_cache: bool = False
    architecture: str = ""  # config.json's, as the model registry ran it
    dtype: str = ""  # the weights' and activations' (e.g. "float32")
    kv_cache_dtype: str = ""  # the KV pool's: the model's dtype, or "fp8_e4m3"


@dataclass
class KVEvents:
    """Pages the prefix cache took in (kind 1) or let go (kind 0), as [kind, block hash]
    pairs in the order they happened (runtime/server/kv_events.py)."""

    events: list[list[int]] = field(default_factory=list)


@dataclass
class DisaggStats:
    """KV transfer activity of a prefill or decode server. Counters are increments since the
    previous stats message; `rooms` is the current count per room state."""

    transfers: int = 0
    transfer_bytes: int = 0
    transfer_seconds: list[float] = field(default_factory=list)
    failures: dict[str, int] = field(default_factory=dict)  # reason -> count
    rooms: dict[str, int] = field(default_factory=dict)  # state -> count
    # KV-plane events -> count: refused links, frames and writes, bad bootstrap calls, late
    # writes contained in quarantined pages (docs/kv-plane.md)
    kv_plane: dict[str, int] = field(default_factory=dict)
    quarantined_pages: int = 0  # decode: pages of failed rooms a prefill may still write

    def failed(self, reason: str) -> None:
        self.failures[reason] = self.failures.get(reason, 0) + 1

    def count_kv_plane(self, counts: dict[str, int]) -> None:
        for kind, n in counts.items():
            self.kv_plane[kind] = self.kv_plane.get(kind, 0) + n

    def has_counts(self) -> bool:
        return bool(self.transfers or self.transfer_bytes or self.transfer_seconds or self.failures
                    or self.kv_plane)

    def take(self) -> DisaggStats:
        """These numbers, leaving zeroed counters behind (rooms and quarantine stay levels)."""
        out = DisaggStats(self.transfers, self.transfer_bytes, self.transfer_seconds,
                          self.failures, dict(self.rooms), self.kv_plane, self.quarantined_pages)
        self.transfers, self.transfer_bytes, self.transfer_seconds, self.failures = 0, 0, [], {}
        self.kv_plane = {}
        return out


@dataclass
class PrefixCacheStats:
    cached_tokens: int = 0  # held by the cache now, read by a request or not
    hit_tokens: int = 0  # since start: prompt tokens found cached at admission
    query_tokens: int = 0  # since start: prompt tokens looked up at admission
    evicted_tokens: int = 0  # since start


@dataclass
class CanaryStats:
    """The KV canary since start (docs/kv-canary.md)."""

    # request rows whose KV a forward checked; it rises every step, so it rides along with the
    # next stats message rather than causing one (not compared)
    checks: int = field(default=0, compare=False)
    violations: dict[str, int] = field(default_factory=dict)  # kind -> failed checks
    injections: dict[str, int] = field(default_factory=dict)  # perturb kind -> requests hit

    def copy(self) -> CanaryStats:
        return CanaryStats(self.checks, dict(self.violations), dict(self.injections))


@dataclass
class CacheReport:
    id: int
    enabled: bool
    page_size: int
    stats: PrefixCacheStats
    freed_tokens: int = 0  # by the flush asked for
    hashes: list[int] | None = None


@dataclass
class SchedulerStats:
    num_waiting: int = 0
    num_running: int = 0
    kv_used_pages: int = 0
    kv_total_pages: int = 0
    page_size: int = 1
    kv_all_free: bool = True
    disagg: DisaggStats | None = None
    prefix_cache: PrefixCacheStats | None = None  # None: the cache is off
    queued_prompt_tokens: int = 0  # prompt tokens of the requests waiting in the scheduler
    canary: CanaryStats | None = None  # None: the KV canary is off
    # since start: running requests retracted to free KV (re-prefilled later from their tokens)
    retractions: int = field(default=0, compare=False)
    # since the server became ready, for the P:D planner (runtime/figures.py); it rises every
    # step, so it rides along with the next stats message rather than causing one
    figures: ServingFigures = field(default_factory=ServingFigures, compare=False)


@dataclass
class RequestError:
    """The scheduler refused a request (InvalidRequest): nothing of it was scheduled."""

    rid: str
    message: str
    field: str | None = None
    status: int = 400  # 409: a bootstrap room already in use


@dataclass
class ReqOutput:
    rid: str
    output_ids: list[int]  # new tokens since the last ReqOutput for this rid
    prompt_tokens: int
    completion_tokens: int  # total so far
    finished_reason: FinishReason | None = None  # once finished (JSON only at the HTTP edge)
    output_logprobs: list[float] | None = None
    output_top_logprobs: list[list[tuple[int, float]]] | None = None
    customized_info: dict[str, list[Any]] | None = None
    cached_tokens: int = 0  # prompt tokens found in the prefix cache (of the prefill server in PD)

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @staticmethod
    def concat(outputs: list[ReqOutput]) -> ReqOutput:
        """Coalesce consecutive outputs of one request into one.

        Incremental keys (output_ids, logprobs, top logprobs and every customized_info key) are
        concatenated in order; totals and the finish reason come from the last output.
        """
        if not outputs:
            raise ValueError("concat needs at least one output")
        if len(outputs) == 1:
            return outputs[0]
        last = outputs[-1]
        merged = ReqOutput(
            rid=last.rid,
            output_ids=[t for o in outputs for t in o.output_ids],
            prompt_tokens=last.prompt_tokens,
            completion_tokens=last.completion_tokens,
            finished_reason=last.finished_reason,
            cached_tokens=last.cached_tokens,
        )
        if any(o.output_logprobs is not None for o in outputs):
            merged.output_logprobs = [x for o in outputs for x in o.output_logprobs or []]
        if any(o.output_top_logprobs is not None for o in outputs):
            merged.output_top_logprobs = [x for o in outputs for x in o.output_top_logprobs or []]
        keys = dict.fromkeys(k for o in outputs for k in o.customized_info or {})
        if keys:
            merged.customized_info = {
                k: [v for o in outputs for v in (o.customized_info or {}).get(k, [])] for k in keys
            }
        return merged


@dataclass
class BatchOutput:
    outputs: list[ReqOutput] = field(default_factory=list)
    stats: SchedulerStats | None = None


Message = (
    GenerateRequest
    | AbortRequest
    | CacheQuery
    | CacheReport
    | KVEvents
    | DrainRequest
    | ShutdownRequest
    | SchedulerReady
    | SchedulerStats
    | DisaggStats
    | RequestError
    | ReqOutput
    | BatchOutput
)
MESSAGE_TYPES: tuple[type, ...] = (
    FinishReason,  # travels inside ReqOutput
    KVOffer,  # inside a "moved" FinishReason
    Bootstrap,  # inside a GenerateRequest
    GenerateRequest,
    AbortRequest,
    CacheQuery,
    CacheReport,
    KVEvents,
    PrefixCacheStats,
    CanaryStats,
    ServingFigures,  # inside SchedulerStats, with its Moments and ForwardTotals
    Moments,
    ForwardTotals,
    DrainRequest,
    ShutdownRequest,
    SchedulerReady,
    SchedulerStats,
    DisaggStats,
    RequestError,
    ReqOutput,
    BatchOutput,
)
