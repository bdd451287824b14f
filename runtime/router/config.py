"""`baton router` configuration: frozen dataclasses built once in `main` and passed down.

argparse defaults come from `RouterConfig`'s fields (see `runtime.router.args`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from runtime.config import MAX_BODY_BYTES

Role = Literal["prefill", "decode"]
ROLES: tuple[Role, ...] = ("prefill", "decode")
DiscoveryMode = Literal["flags", "kubernetes"]
DISCOVERY_MODES: tuple[DiscoveryMode, ...] = ("flags", "kubernetes")
Fallback = Literal["fail", "colocated"]
FALLBACKS: tuple[Fallback, ...] = ("fail", "colocated")
PolicyName = Literal["round_robin", "least_load", "cache_aware", "prefix"]
POLICIES: tuple[PolicyName, ...] = ("round_robin", "least_load", "cache_aware", "prefix")
DEFAULT_BOOTSTRAP_PORT = 8998


@dataclass(frozen=True)
class WorkerAddress:
    """Where one worker answers HTTP; a prefill also names its bootstrap port."""

    url: str  # scheme://host:port, no trailing slash
    bootstrap_port: int | None = None


@dataclass(frozen=True)
class DnsName:
    """A name whose A/AAAA records are the workers of one role, all on `port`."""

    host: str
    port: int
    bootstrap_port: int | None = None  # prefill only


@dataclass(frozen=True)
class RouterConfig:
    """Every `baton router` flag. A role's workers come from a static list or a DNS name
    (discovery "flags"), or from the Ready pods a label selector picks (discovery
    "kubernetes", in `namespace`: None is the service account's or kubeconfig's)."""

    host: str = "127.0.0.1"
    port: int = 8000
    prefill: tuple[WorkerAddress, ...] = ()
    decode: tuple[WorkerAddress, ...] = ()
    prefill_dns: DnsName | None = None
    decode_dns: DnsName | None = None
    discovery: DiscoveryMode = "flags"
    prefill_selector: str = ""
    decode_selector: str = ""
    namespace: str | None = None
    discovery_sync_s: float = 0.5  # kubernetes: pools synced from the watched pods this often
    policy: PolicyName = "round_robin"
    request_timeout_s: float = 600.0  # longest silence from a worker during one request
    connect_timeout_s: float = 5.0
    abort_timeout_s: float = 5.0
    health_interval_s: float = 2.0
    health_timeout_s: float = 2.0
    health_failures: int = 2  # unanswered polls in a row that take a ready worker out
    dns_refresh_s: float = 5.0
    shutdown_grace_s: float = 30.0  # on SIGTERM, streams in flight get this long to finish
    fallback: Fallback = "fail"  # with no prefill to pair: a 503, or a decode prefills locally
    max_retries: int = 2  # tries on other pairs for a request that failed before its answer
    max_migrations: int = 3  # times a stream may move to another pair after its first byte
    retry_backoff_s: float = 0.05  # before the first retry; doubled for each next one
    retry_wait_s: float = 15.0  # a retry that finds no ready pair waits this long for one
    pair_failures: int = 2  # failed KV handoffs in a row that quarantine a (prefill, decode) pair
    pair_quarantine_s: float = 5.0  # the first quarantine; doubled at each failed probe
    pair_max_quarantine_s: float = 120.0
    cache_load_tokens: int = 256  # cache_aware: what one request in flight costs, in tokens
    tokenizer: str | None = None  # HF folder or builtin:NAME: how cache_aware reads prompts
    cluster_key_file: str | None = None  # else $BATON_CLUSTER_KEY: room tickets are signed
    ticket_ttl_s: float = 60.0  # how long a worker accepts a room ticket after it was signed
    api_key: tuple[str, ...] = ()  # required of clients, and presented to the workers
    api_key_file: str | None = None
    protect_metrics: bool = False
    admin_api_key: str | None = None  # with API keys on, /debug/ needs it (else: nobody)
    max_body_bytes: int = MAX_BODY_BYTES  # a larger request body gets 413, as on the workers
    planner_window_s: float = 60.0  # GET /debug/planner: the figures of the last this many s
    log_level: str = "info"
