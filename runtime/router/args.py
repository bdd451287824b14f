"""`baton router` argument parsing (docs/architecture.md "CLI contract"); defaults from `RouterConfig`.

Each role's workers come from exactly one source: static URLs (`--prefill URL[,BOOTSTRAP_PORT]`
repeated, `--decode URL` repeated) or a DNS name re-resolved every `--dns-refresh-s`
(`--prefill-dns HOST:PORT:BOOTSTRAP_PORT`, `--decode-dns HOST:PORT`); or, with
`--discovery kubernetes`, the Ready pods that `--prefill-selector` / `--decode-selector` pick
(in `--namespace`). Bad values are argparse errors (exit 2) that name the flag.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from urllib.parse import urlsplit

from runtime.auth.api_keys import ApiKeys
from runtime.auth.key import load_cluster_key
from runtime.router.config import (
    DEFAULT_BOOTSTRAP_PORT,
    DISCOVERY_MODES,
    FALLBACKS,
    POLICIES,
    ROLES,
    DnsName,
    RouterConfig,
    WorkerAddress,
)

DEFAULT = RouterConfig()
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="baton router",
                                description="prefill/decode-aware gateway in front of baton workers")
    p.add_argument("--host", default=DEFAULT.host, help=f"(default: {DEFAULT.host})")
    p.add_argument("--port", type=_port, default=DEFAULT.port, help=f"(default: {DEFAULT.port})")
    _worker_flags(p)
    _tuning_flags(p)
    return p


def _worker_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", action="append", default=[], metavar="URL[,BOOTSTRAP_PORT]",
                   help=f"a prefill worker (repeatable; bootstrap port {DEFAULT_BOOTSTRAP_PORT} "
                   "unless given)")
    p.add_argument("--decode", action="append", default=[], metavar="URL",
                   help="a decode worker (repeatable)")
    p.add_argument("--prefill-dns", metavar="HOST:PORT:BOOTSTRAP_PORT",
                   help="every A/AAAA record of HOST is a prefill worker (re-resolved)")
    p.add_argument("--decode-dns", metavar="HOST:PORT",
                   help="every A/AAAA record of HOST is a decode worker (re-resolved)")
    p.add_argument("--discovery", choices=DISCOVERY_MODES, default=DEFAULT.discovery,
                   help="where workers come from: the flags above, or the Kubernetes API "
                   f"(Ready pods by label selector) (default: {DEFAULT.discovery})")
    p.add_argument("--prefill-selector", default="", metavar="K=V,...",
                   help="kubernetes: label selector of the prefill pods")
    p.add_argument("--decode-selector", default="", metavar="K=V,...",
                   help="kubernetes: label selector of the decode pods")
    p.add_argument("--namespace", default=None,
                   help="kubernetes: the pods' namespace (default: the service account's, "
                   "else the kubeconfig context's)")


def _tuning_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policy", choices=POLICIES, default=DEFAULT.policy,
                   help="how a (prefill, decode) pair is picked: own cursor per role | fewest "
                   "requests in flight | the prefill with the least to compute: prompt tokens "
                   "its prefix cache lacks (from its KV events) + --cache-load-tokens per "
                   "request in flight (prefix: an alias of cache_aware) "
                   f"(default: {DEFAULT.policy})")
    _seconds(p, "--request-timeout-s", DEFAULT.request_timeout_s,
             "longest a worker may stay silent during a request")
    _seconds(p, "--connect-timeout-s", DEFAULT.connect_timeout_s, "connecting to a worker")
    _seconds(p, "--abort-timeout-s", DEFAULT.abort_timeout_s, "a POST /abort to a worker")
    _seconds(p, "--health-interval-s", DEFAULT.health_interval_s, "between GET /ready polls")
    _seconds(p, "--health-timeout-s", DEFAULT.health_timeout_s, "one GET /ready poll")
    p.add_argument("--health-failures", type=_positive_int, default=DEFAULT.health_failures,
                   help="polls in a row without an answer that take a worker out; an answer "
                   f"other than 200 or a refused connection does at once "
                   f"(default: {DEFAULT.health_failures})")
    _seconds(p, "--dns-refresh-s", DEFAULT.dns_refresh_s, "between DNS re-resolutions")
    _seconds(p, "--shutdown-grace-s", DEFAULT.shutdown_grace_s,
             "on SIGTERM, requests in flight get this long to finish")
    p.add_argument("--fallback", choices=FALLBACKS, default=DEFAULT.fallback,
                   help="when no prefill can take a request: fail (503 naming the cause) or "
                   "colocated (a ready decode started with --allow-local-prefill prefills it "
                   "itself; counted in baton_router_pd_fallback_total) "
                   f"(default: {DEFAULT.fallback})")
    p.add_argument("--max-retries", type=_count, default=DEFAULT.max_retries,
                   help="a request that fails before anything reached the client (a worker "
                   "unreachable, a 5xx, a failed KV handoff) is tried again on another pair this "
                   f"many times (default: {DEFAULT.max_retries})")
    p.add_argument("--max-migrations", type=_count, default=DEFAULT.max_migrations,
                   help="a one-choice stream whose decode fails after its first byte goes on "
                   "on another pair, from the tokens its client has, this many times (0: it "
                   f"ends with an in-band error) (default: {DEFAULT.max_migrations})")
    _seconds(p, "--retry-backoff-s", DEFAULT.retry_backoff_s,
             "the wait before the first retry, doubled for each next one")
    _seconds(p, "--retry-wait-s", DEFAULT.retry_wait_s,
             "a retry that finds no ready pair (its only prefill died and starts again, a worker "
             "not seen ready yet) polls the workers that are out and waits this long for one "
             "before the client gets the last failure")
    p.add_argument("--pair-failures", type=_positive_int, default=DEFAULT.pair_failures,
                   help="failed KV handoffs in a row that quarantine a (prefill, decode) pair "
                   f"(default: {DEFAULT.pair_failures})")
    _seconds(p, "--pair-quarantine-s", DEFAULT.pair_quarantine_s,
             "a quarantined pair's first wait before a request probes it; doubled when the "
             "probe fails")
    _seconds(p, "--pair-max-quarantine-s", DEFAULT.pair_max_quarantine_s,
             "the longest quarantine")
    p.add_argument("--cache-load-tokens", type=_positive_int, default=DEFAULT.cache_load_tokens,
                   help="cache_aware: a request in flight on a prefill counts as this many "
                   f"prompt tokens to compute (default: {DEFAULT.cache_load_tokens})")
    p.add_argument("--tokenizer", default=None, metavar="MODEL",
                   help="cache_aware: the model's folder or builtin:NAME, to tokenize text "
                   "prompts and chats as the workers do; `workers`: the tokenizer files a "
                   "ready worker serves (GET /tokenizer), for a model only the workers have "
                   "(without either, only input_ids and token-id prompts are matched; the rest "
                   "go by least_load)")
    p.add_argument("--cluster-key-file", default=None, metavar="PATH",
                   help="the deployment's shared cluster key (else $BATON_CLUSTER_KEY): each "
                   "request's rooms go to its workers with a signed room ticket")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="require `Authorization: Bearer KEY` of clients (repeatable; also "
                   "$BATON_API_KEY); the first key is presented to the workers")
    p.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="keys to require, one per line; read again when it changes")
    p.add_argument("--protect-metrics", action="store_true",
                   help="require a key for /metrics and /debug/planner too (/health and /ready "
                   "stay open)")
    p.add_argument("--admin-api-key", default=None, metavar="KEY",
                   help="with API keys on, /debug/pairs and /debug/kv_index need "
                   "this key (also $BATON_ADMIN_API_KEY; without one nobody reads them)")
    _seconds(p, "--planner-window-s", DEFAULT.planner_window_s,
             "GET /debug/planner shows what the workers computed over this last stretch")
    p.add_argument("--max-body-bytes", type=_positive_int, default=DEFAULT.max_body_bytes,
                   help="a larger request body gets 413 before the rest is read (default: "
                   f"{DEFAULT.max_body_bytes}, as the workers')")
    p.add_argument("--log-level", type=str.lower, choices=LOG_LEVELS, default=DEFAULT.log_level,
                   help=f"(default: {DEFAULT.log_level})")


def parse_router_args(argv: list[str]) -> RouterConfig:
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        prefill = tuple(parse_prefill_url(v) for v in ns.prefill)
        decode = tuple(parse_worker_url(v, "--decode") for v in ns.decode)
        prefill_dns = None if ns.prefill_dns is None else parse_dns(ns.prefill_dns, "prefill")
        decode_dns = None if ns.decode_dns is None else parse_dns(ns.decode_dns, "decode")
    except ValueError as e:
        parser.error(str(e))
    if ns.discovery == "kubernetes":
        _check_kubernetes_flags(parser, ns)
    try:
        load_cluster_key(ns.cluster_key_file)
        ApiKeys.load(ns.api_key, ns.api_key_file, admin=ns.admin_api_key)
    except ValueError as e:  # (KeyProblem too)
        parser.error(str(e))
    for role, static, dns in zip(ROLES, (prefill, decode), (prefill_dns, decode_dns),
                                 strict=True):
        if ns.discovery == "kubernetes":
            continue
        if static and dns is not None:
            parser.error(f"give --{role} or --{role}-dns, not both")
        if not static and dns is None:
            parser.error(f"no {role} workers: give --{role} URL (repeatable) or --{role}-dns")
    return RouterConfig(
        host=ns.host, port=ns.port, prefill=prefill, decode=decode, prefill_dns=prefill_dns,
        decode_dns=decode_dns, discovery=ns.discovery, prefill_selector=ns.prefill_selector,
        decode_selector=ns.decode_selector, namespace=ns.namespace, policy=ns.policy, request_timeout_s=ns.request_timeout_s,
        connect_timeout_s=ns.connect_timeout_s, abort_timeout_s=ns.abort_timeout_s,
        health_interval_s=ns.health_interval_s, health_timeout_s=ns.health_timeout_s,
        health_failures=ns.health_failures,
        dns_refresh_s=ns.dns_refresh_s, shutdown_grace_s=ns.shutdown_grace_s,
        fallback=ns.fallback, max_retries=ns.max_retries, max_migrations=ns.max_migrations,
        retry_backoff_s=ns.retry_backoff_s, retry_wait_s=ns.retry_wait_s,
        pair_failures=ns.pair_failures, pair_quarantine_s=ns.pair_quarantine_s,
        pair_max_quarantine_s=ns.pair_max_quarantine_s,
        cache_load_tokens=ns.cache_load_tokens, tokenizer=ns.tokenizer, log_level=ns.log_level,
        cluster_key_file=ns.cluster_key_file, api_key=tuple(ns.api_key),
        api_key_file=ns.api_key_file, protect_metrics=ns.protect_metrics,
        admin_api_key=ns.admin_api_key,
        max_body_bytes=ns.max_body_bytes, planner_window_s=ns.planner_window_s,
    )


def _check_kubernetes_flags(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    for role in ROLES:
        if getattr(ns, role) or getattr(ns, f"{role}_dns") is not None:
            parser.error(f"--discovery kubernetes finds the {role} workers itself: drop "
                         f"--{role} / --{role}-dns")
        selector = getattr(ns, f"{role}_selector")
        terms = [t.strip() for t in selector.split(",")]
        if not selector or not all(terms):
            parser.error(f"--discovery kubernetes needs --{role}-selector K=V[,K=V...]")


def parse_worker_url(value: str, flag: str) -> WorkerAddress:
    """`http://host:port` (https too); the path, query and trailing slash are not allowed."""
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError as e:
        raise ValueError(f"{flag} {value!r}: {e}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{flag} {value!r}: expected http://HOST:PORT")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"{flag} {value!r}: give the worker's base URL, without a path")
    if port == 0:
        raise ValueError(f"{flag} {value!r}: port must be 1-65535")
    return WorkerAddress(url=f"{parts.scheme}://{parts.netloc}")


def parse_prefill_url(value: str) -> WorkerAddress:
    """`URL[,BOOTSTRAP_PORT]`."""
    url, sep, bootstrap = value.partition(",")
    address = parse_worker_url(url, "--prefill")
    port = DEFAULT_BOOTSTRAP_PORT
    if sep:
        port = _port_value(bootstrap, f"--prefill {value!r}: bootstrap port")
    return WorkerAddress(url=address.url, bootstrap_port=port)


def parse_dns(value: str, role: str) -> DnsName:
    """`HOST:PORT:BOOTSTRAP_PORT` for prefill, `HOST:PORT` for decode (HOST may be [IPv6])."""
    flag = f"--{role}-dns"
    fields = 2 if role == "prefill" else 1
    parts = value.rsplit(":", fields)
    if len(parts) != fields + 1:
        shape = "HOST:PORT:BOOTSTRAP_PORT" if role == "prefill" else "HOST:PORT"
        raise ValueError(f"{flag} {value!r}: expected {shape}")
    host = parts[0].removeprefix("[").removesuffix("]")
    if not host:
        raise ValueError(f"{flag} {value!r}: empty host")
    port = _port_value(parts[1], f"{flag} {value!r}: port")
    bootstrap = _port_value(parts[2], f"{flag} {value!r}: bootstrap port") if fields == 2 else None
    return DnsName(host=host, port=port, bootstrap_port=bootstrap)


def _port_value(text: str, what: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise ValueError(f"{what} {text!r} is not a number") from None
    if not 1 <= port <= 65535:
        raise ValueError(f"{what} {port} is not in 1-65535")
    return port


def _port(text: str) -> int:
    try:
        return _port_value(text, "port")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _int_at_least(least: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"{value} must be >= {least}")
        return value

    return parse


_positive_int = _int_at_least(1)
_count = _int_at_least(0)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number > 0")
    return value


def _seconds(p: argparse.ArgumentParser, flag: str, default: float, help_text: str) -> None:
    p.add_argument(flag, type=_positive_float, default=default,
                   help=f"{help_text} (default: {default})")
