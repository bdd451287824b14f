"""Prometheus metrics of one server, on its own registry (served by GET /metrics)."""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from runtime.figures import MODES, ServingFigures
from runtime.messages import CanaryStats, DisaggStats, PrefixCacheStats, SchedulerStats

_LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 30.0,
    60.0,
)


class PrefixCacheMetrics:
    """The prefix cache (PrefixCacheStats carries totals since start; counters take the rise)."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.hit = Counter("baton_prefix_cache_hit_tokens", "Prompt tokens found in the prefix "
                           "cache at admission", registry=r)
        self.query = Counter("baton_prefix_cache_query_tokens", "Prompt tokens looked up in the "
                             "prefix cache at admission", registry=r)
        self.evicted = Counter("baton_prefix_cache_evicted_tokens", "Tokens evicted from the "
                               "prefix cache", registry=r)
        self.cached = Gauge("baton_prefix_cache_tokens", "Tokens the prefix cache holds",
                            registry=r)
        self.last = PrefixCacheStats()

    def update(self, stats: PrefixCacheStats) -> None:
        self.hit.inc(max(0, stats.hit_tokens - self.last.hit_tokens))
        self.query.inc(max(0, stats.query_tokens - self.last.query_tokens))
        self.evicted.inc(max(0, stats.evicted_tokens - self.last.evicted_tokens))
        self.cached.set(stats.cached_tokens)
        self.last = stats


class CanaryMetrics:
    """The KV canary and fault injection (CanaryStats carries totals; counters take the rise)."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.checks = Counter("baton_kv_canary_checks", "Request rows whose KV a forward checked "
                              "(docs/kv-canary.md)", registry=r)
        self.violations = Counter("baton_kv_canary_violations", "Failed KV canary checks, by kind "
                                  "(tag, bytes, token)", ["kind"], registry=r)
        self.injections = Counter("baton_perturb_injections", "Requests hit by --perturb fault "
                                  "injection, by kind", ["kind"], registry=r)
        self.last = CanaryStats()

    def update(self, stats: CanaryStats) -> None:
        self.checks.inc(max(0, stats.checks - self.last.checks))
        for counter, now, before in ((self.violations, stats.violations, self.last.violations),
                                     (self.injections, stats.injections, self.last.injections)):
            for kind, n in now.items():
                counter.labels(kind=kind).inc(max(0, n - before.get(kind, 0)))
        self.last = stats


class FiguresMetrics:
    """What the scheduler computed, the P:D planner's figures (ServingFigures carries totals;
    counters take the rise). Lengths come as count, sum and sum of squares: rises over a window
    give their mean and second moment."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.forwards = Counter("baton_forwards", "Forward passes by mode (extend: prompt chunks, "
                                "decode: steps)", ["mode"], registry=r)
        self.tokens = Counter("baton_forward_tokens", "Input tokens of the forward passes by mode "
                              "(a decode step: one a request)", ["mode"], registry=r)
        self.seconds = Counter("baton_forward_seconds", "Seconds the device was busy with "
                               "forward passes, by mode", ["mode"], registry=r)
        self.received = Counter("baton_planner_received", "Requests given to the scheduler to "
                                "prefill (a decode's from a prefill are not)", registry=r)
        self.lengths = {kind: (
            Counter(f"baton_planner_{kind}s", f"{what}: how many", registry=r),
            Counter(f"baton_planner_{kind}_tokens", f"{what}: their tokens", registry=r),
            Counter(f"baton_planner_{kind}_tokens_squared", f"{what}: the sum of each one's "
                    "tokens squared", registry=r),
        ) for kind, what in (("prompt", "Prompts prefilled, the cached prefix not counted"),
                             ("output", "Requests that finished here by a stop or their "
                              "length, by completion tokens"))}
        self.last = ServingFigures()

    def update(self, figures: ServingFigures) -> None:
        rise, self.last = figures.since(self.last), figures
        if rise.went_down():  # (never while the scheduler process lives)
            return
        for mode in MODES:
            self.forwards.labels(mode=mode).inc(rise.forwards[mode].count)
            self.tokens.labels(mode=mode).inc(rise.forwards[mode].tokens)
            self.seconds.labels(mode=mode).inc(rise.forwards[mode].seconds)
        self.received.inc(rise.received)
        for kind, moments in (("prompt", rise.prompts), ("output", rise.outputs)):
            for counter, value in zip(self.lengths[kind], (moments.n, moments.sum, moments.sumsq),
                                      strict=True):
                counter.inc(value)


class DisaggMetrics:
    """KV transfers of a prefill or decode server (DisaggStats): on prefill the transfers it sent
    and how long each write took, on decode the transfers it received."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.transfers = Counter("baton_kv_transfers", "KV transfers completed", registry=r)
        self.bytes = Counter("baton_kv_transfer_bytes", "KV bytes transferred", registry=r)
        self.seconds = Histogram(
            "baton_kv_transfer_seconds", "Time to write one room's KV into the decode pool",
            registry=r, buckets=_LATENCY_BUCKETS,
        )
        self.failures = Counter(
            "baton_kv_transfer_failures", "Rooms that failed, by reason", ["reason"], registry=r
        )
        self.rooms = Gauge("baton_disagg_rooms", "Bootstrap rooms in flight by state", ["state"],
                           registry=r)
        self.kv_plane = Counter(
            "baton_kv_plane_events", "KV-plane refusals and contained late writes, by kind "
            "(bad_link, bad_frame, refused_write, bad_call, late_write_contained)", ["kind"],
            registry=r,
        )
        self.quarantined = Gauge(
            "baton_kv_quarantined_pages", "Decode: KV pages of failed rooms kept back until no "
            "write for them can land", registry=r,
        )

    def update(self, stats: DisaggStats) -> None:
        self.transfers.inc(stats.transfers)
        self.bytes.inc(stats.transfer_bytes)
        for seconds in stats.transfer_seconds:
            self.seconds.observe(seconds)
        for reason, n in stats.failures.items():
            self.failures.labels(reason=reason).inc(n)
        for state in ("bootstrapping", "waiting_for_input", "transferring"):
            self.rooms.labels(state=state).set(stats.rooms.get(state, 0))
        for kind, n in stats.kv_plane.items():
            self.kv_plane.labels(kind=kind).inc(n)
        self.quarantined.set(stats.quarantined_pages)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "baton_requests", "Finished requests by status (stop, length, abort, rejected; lost: its scheduler died)",
            ["status"], registry=r,
        )
        self.http_errors = Counter(
            "baton_http_errors", "Error responses by HTTP status", ["status"], registry=r
        )
        self.prompt_tokens = Counter("baton_prompt_tokens", "Prompt tokens", registry=r)
        self.generation_tokens = Counter("baton_generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram(
            "baton_time_to_first_token_seconds", "Time to first token", registry=r,
            buckets=_LATENCY_BUCKETS,
        )
        self.itl = Histogram(
            "baton_inter_token_latency_seconds", "Time between output tokens", registry=r,
            buckets=_LATENCY_BUCKETS,
        )
        self.e2e = Histogram(
            "baton_e2e_request_latency_seconds", "Request latency", registry=r,
            buckets=_LATENCY_BUCKETS,
        )
        self.queue_depth = Gauge("baton_queue_depth", "Requests waiting in the scheduler", registry=r)
        self.queued_prompt_tokens = Gauge(
            "baton_queued_prompt_tokens", "Prompt tokens of the requests waiting in the "
            "scheduler (a prefill pool's load: the autoscaler's default signal)", registry=r)
        self.running = Gauge("baton_running_requests", "Requests running in the scheduler", registry=r)
        self.inflight = Gauge("baton_inflight_requests", "Requests the HTTP side awaits", registry=r)
        self.kv_used = Gauge("baton_kv_used_tokens", "KV slots in use (page granular)", registry=r)
        self.kv_total = Gauge("baton_kv_total_tokens", "KV pool size in tokens", registry=r)
        self.kv_usage = Gauge("baton_kv_usage_ratio", "Fraction of KV pages in use", registry=r)
        self.retractions = Counter("baton_retractions", "Running requests retracted to free KV "
                                   "(re-prefilled later from their tokens)", registry=r)
        self.last_retractions = 0
        self.disagg = DisaggMetrics(r)
        self.cache = PrefixCacheMetrics(r)
        self.canary = CanaryMetrics(r)
        self.figures = FiguresMetrics(r)

    def on_tokens(self, n: int, since_last: float, first: bool, ttft: float) -> None:
        """`n` new tokens arrived `since_last` seconds after the previous ones."""
        if n <= 0:
            return
        if first:  # tokens arriving with the first one have a TTFT, not an inter-token latency
            self.ttft.observe(ttft)
            return
        for _ in range(n):
            self.itl.observe(since_last / n)

    def on_finish(self, status: str, prompt_tokens: int, completion_tokens: int, e2e: float) -> None:
        self.requests.labels(status=status).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.e2e.observe(e2e)

    def on_http_error(self, status: int) -> None:
        self.http_errors.labels(status=str(status)).inc()

    def on_rejected(self) -> None:
        self.requests.labels(status="rejected").inc()

    def on_lost(self) -> None:
        """A request its scheduler process died owing more (failed, not finished)."""
        self.requests.labels(status="lost").inc()

    def set_stats(self, stats: SchedulerStats) -> None:
        self.queue_depth.set(stats.num_waiting)
        self.queued_prompt_tokens.set(stats.queued_prompt_tokens)
        self.running.set(stats.num_running)
        self.kv_used.set(stats.kv_used_pages * stats.page_size)
        self.kv_total.set(stats.kv_total_pages * stats.page_size)
        self.kv_usage.set(stats.kv_used_pages / max(stats.kv_total_pages, 1))
        self.retractions.inc(max(0, stats.retractions - self.last_retractions))
        self.last_retractions = stats.retractions
        if stats.disagg is not None:
            self.disagg.update(stats.disagg)
        if stats.prefix_cache is not None:
            self.cache.update(stats.prefix_cache)
        if stats.canary is not None:
            self.canary.update(stats.canary)
        self.figures.update(stats.figures)

    def render(self) -> bytes:
        return generate_latest(self.registry)
