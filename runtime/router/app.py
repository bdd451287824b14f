"""The router's HTTP app.

`POST /generate`, `/v1/completions`, `/v1/chat/completions`: pick a (prefill, decode) pair of
ready workers by policy and forward (`proxy.py`). `GET /health` 200 while up; `GET /ready` 200
when at least one prefill and one decode worker are ready; `GET /metrics` (Prometheus);
`GET /v1/models` from a ready decode worker; `POST /abort {"rid"}` to every worker;
`GET /debug/planner`: the P:D planner's figures over the last `--planner-window-s`;
`POST /debug/probe`: the rollout gate's probes through a named pair (`probe.py`). Errors
are JSON `{"error": {"message", "type", "code", "param"}}`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from runtime.auth.api_keys import ApiKeyGate, ApiKeys
from runtime.auth.key import load_cluster_key, warn_if_open
from runtime.body_limit import BodyLimit
from runtime.router.config import ROLES, DnsName, Role, RouterConfig
from runtime.router.discovery import (
    Discovery,
    DnsDiscovery,
    Resolver,
    StaticDiscovery,
    getaddrinfo_resolver,
    run_discovery,
)
from runtime.router.errors import RouterError, UpstreamFailure, unavailable
from runtime.router.exchange import Exchange
from runtime.router.figures import PlannerFigures
from runtime.router.health import HealthChecker
from runtime.router.kv_index import KVIndex, follow
from runtime.router.metrics import RouterMetrics
from runtime.router.pairing import Pairing
from runtime.router.pairs import PairTable
from runtime.router.policy import build_policy, load
from runtime.router.probe import ProbeBody, run_probes
from runtime.router.proxy import Proxy
from runtime.router.request import (
    ENDPOINTS,
    RoutedRequest,
    parse_abort,
    parse_model,
    parse_request,
)
from runtime.router.tenants import TenantSalts
from runtime.router.tokenizer import RouterTokenizer
from runtime.router.workers import Worker, Workers
from runtime.sse import CLIENT_GONE

log = logging.getLogger("baton.router")


class Router:
    """The router's state: built once per app, shared by every request."""

    def __init__(self, config: RouterConfig, discovery: Discovery):
        self.config, self.discovery = config, discovery
        self.workers = Workers()
        self.metrics = RouterMetrics()
        self.index = KVIndex()  # cache_aware: what each prefill's prefix cache holds
        self.pairs = PairTable(config.pair_failures, config.pair_quarantine_s,
                               config.pair_max_quarantine_s)
        self.exchanges: dict[str, Exchange] = {}  # in flight, by the rid the client knows
        self.policy = build_policy(config.policy, config, self.index)
        self.tokenizer = RouterTokenizer(config.tokenizer)
        self.followers: dict[str, asyncio.Task[None]] = {}  # prefill URL -> its KV events
        self.api_keys = ApiKeys.load(config.api_key, config.api_key_file,
                                     admin=config.admin_api_key)
        self.client = httpx.AsyncClient(
            trust_env=False,  # workers are reached directly, never through an env proxy
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
            timeout=httpx.Timeout(config.request_timeout_s, connect=config.connect_timeout_s),
            auth=self._present_key)
        self.proxy = Proxy(self.client, self.metrics, config)
        self.planner = PlannerFigures(config.planner_window_s)  # fed by the health checks
        self.health = HealthChecker(self.client, self.workers, self.metrics,
                                    config.health_interval_s, config.health_timeout_s,
                                    config.health_failures, self.planner)
        self.key = load_cluster_key(config.cluster_key_file)
        warn_if_open(self.key, "the router (its workers take unsigned rooms)")
        self.api_keys.operator = self.key.operator_token()  # the operator's gate probes
        self.pairing = Pairing(config, self.workers, self.pairs, self.policy, self.tokenizer,
                               self.key, self.metrics)
        self.salts = TenantSalts(self.api_keys, self.key)

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Discovery and health checks in the background while the app serves."""
        tasks = [asyncio.create_task(run_discovery(self.discovery, self.workers,
                                                   self._membership_changed)),
                 asyncio.create_task(self.health.run()),
                 asyncio.create_task(self.discovery.watch())]
        if self.tokenizer.from_workers:
            tasks.append(asyncio.create_task(self.tokenizer.learn(self.client, self.workers)))
        try:
            yield
        finally:
            tasks += self.followers.values()
            if self.health.rechecking is not None:  # a retry's poll of the workers that are out
                tasks.append(self.health.rechecking)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.proxy.drain(self.config.abort_timeout_s)
            await self.client.aclose()
            await self.discovery.close()

    def _present_key(self, request: httpx.Request) -> httpx.Request:
        """Every call to a worker carries this deployment's API key (when it has one)."""
        request.headers.update(self.api_keys.presented())
        return request

    async def _membership_changed(self, joined: list[Worker], left: list[Worker]) -> None:
        for worker in left:
            self.metrics.forget_worker(worker.role, worker.url)
            self.pairs.forget(worker)
            self.planner.forget(worker.url)
            follower = self.followers.pop(worker.url, None)
            if follower is not None:
                follower.cancel()  # and its view goes with it
                self.index.drop(worker.url)
        if self.policy.wants_ids:
            for worker in joined:
                if worker.role == "prefill" and worker.url not in self.followers:
                    self.followers[worker.url] = asyncio.create_task(
                        follow(self.client, self.index, worker.url))
        await self.health.check(joined)  # newcomers serve as soon as they are ready

    async def generate(self, request: Request, endpoint: str) -> Response:
        try:
            req = await asyncio.to_thread(self._parse, endpoint, await request.body(),
                                          request.headers.get("content-type"),
                                          request.headers.get("authorization"))
            if req.rid in self.exchanges:  # the original keeps running, untouched
                raise RouterError(409, f"request id {req.rid!r} is already running",
                                  code="rid_in_use", param="rid")
            req, prefill, decode = self.pairing.route(req)
        except RouterError as e:
            self.metrics.on_request(endpoint, e.status)
            return e.response()
        except ClientDisconnect:
            self.metrics.on_request(endpoint, CLIENT_GONE)
            return Response(status_code=CLIENT_GONE)
        exchange = Exchange(self.proxy, self.pairs, self.pairing.route, req, prefill, decode,
                            self.pairing.move, self.health.recheck)
        self.exchanges[req.rid] = exchange
        exchange.on_close = lambda: self.exchanges.__delitem__(req.rid)
        return await exchange.respond(request)

    def _parse(self, endpoint: str, raw: bytes, content_type: str | None,
               authorization: str | None) -> RoutedRequest:
        """In a worker thread, off the event loop: JSON, the request model, the prompt's hash,
        its tenant's cache salt and, for a policy that reads them, its token ids (a long prompt
        takes seconds to tokenize: on the loop, every stream would stall that long;
        runtime/tokenizer.py lets the GIL go while it tokenizes)."""
        req = parse_request(endpoint, raw, content_type)
        salt = self.salts.salt(authorization, req.parsed.cache_salt)
        if salt is not None:
            req.body["cache_salt"] = salt
        return self.pairing.prepare(req)

    async def abort(self, request: Request) -> JSONResponse:
        """`POST /abort {"rid"}`: a request of this router's is aborted on its pair (under the
        rid its current try has there); any other rid goes to every known worker (a rid lives
        on one pair; the others answer that they do not know it)."""
        rid = parse_abort(await request.body(), request.headers.get("content-type"))
        exchange = self.exchanges.get(rid)
        if exchange is not None:
            exchange.cancel()
            return JSONResponse({"rid": rid, "sent_to": 2})
        targets = self.workers.all()
        for worker in targets:
            self.proxy.abort(worker, rid)
        return JSONResponse({"rid": rid, "sent_to": len(targets)})

    async def models(self) -> Response:
        ready = sorted(self.workers.decode.ready(), key=load)
        if not ready:
            raise unavailable("no ready decode worker to list the models")
        failure: Response | None = None
        for worker in ready:  # the least loaded first; one that just died is no answer
            try:
                r = await self.client.get(f"{worker.url}/v1/models",
                                          timeout=self.config.health_timeout_s)
            except httpx.HTTPError as e:
                failure = self.proxy.failed(worker, e).response()
                continue
            return Response(r.content, r.status_code,
                            media_type=r.headers.get("content-type", "application/json"))
        assert failure is not None
        return failure

    def readiness(self) -> JSONResponse:
        counts = {role: len(self.workers.pool(role).ready()) for role in ("prefill", "decode")}
        degraded = self.pairing.degraded()
        if degraded is not None:  # serving, without disaggregation
            return JSONResponse({"status": "ready", "ready_workers": counts,
                                 "degraded": f"decodes prefill locally: {degraded}"})
        reason = self.workers.unready_reason()
        if reason is not None:
            err = unavailable(f"not ready: {reason}", code="not_ready")
            return JSONResponse({**err.body(), "ready_workers": counts}, err.status)
        return JSONResponse({"status": "ready", "ready_workers": counts})


def build_discovery(config: RouterConfig, resolver: Resolver | None = None) -> Discovery:
    if config.discovery == "kubernetes":
        from runtime.router.kubernetes import KubeApi, KubernetesDiscovery

        selectors: dict[Role, str] = {"prefill": config.prefill_selector,
                                      "decode": config.decode_selector}
        return KubernetesDiscovery(KubeApi(), config.namespace, selectors,
                                   interval=config.discovery_sync_s)
    static = StaticDiscovery(config.prefill, config.decode)
    names: dict[Role, DnsName] = {}
    if config.prefill_dns is not None:
        names["prefill"] = config.prefill_dns
    if config.decode_dns is not None:
        names["decode"] = config.decode_dns
    if not names:
        return static
    return DnsDiscovery(names, static, config.dns_refresh_s, resolver or getaddrinfo_resolver)


def create_app(config: RouterConfig, discovery: Discovery | None = None,
               resolver: Resolver | None = None) -> FastAPI:
    """The app; `discovery` (or a DNS `resolver`) can be injected by tests."""
    router = Router(config, discovery or build_discovery(config, resolver))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async with router.running():
            yield

    app = FastAPI(title="baton router", lifespan=lifespan)
    app.state.router = router
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    app.add_middleware(ApiKeyGate, keys=router.api_keys, protect_metrics=config.protect_metrics,
                       metrics=frozenset({"/metrics", "/debug/planner"}),
                       admin_only=frozenset({"/debug/probe"}))
    _add_routes(app, router)
    _add_error_handlers(app)
    return app


def _add_routes(app: FastAPI, router: Router) -> None:
    for endpoint in ENDPOINTS:
        app.add_api_route(endpoint, _generation_route(router, endpoint), methods=["POST"])

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        return router.readiness()

    @app.get("/metrics")
    async def metrics() -> Response:
        router.metrics.set_pairs(router.pairs.states())
        return Response(router.metrics.render(), media_type=router.metrics.content_type)

    @app.get("/v1/models")
    async def models() -> Response:
        return await router.models()

    @app.post("/abort")
    async def abort(request: Request) -> JSONResponse:
        return await router.abort(request)

    @app.get("/debug/pairs", include_in_schema=False)
    async def pairs() -> dict[str, Any]:
        """Health per (prefill, decode) pair: state, counts, quarantine, latency."""
        return {"pairs": router.pairs.view({w.url: w for w in router.workers.all()})}

    @app.get("/debug/planner", include_in_schema=False)
    async def planner() -> dict[str, Any]:
        """The P:D planner's figures, measured (runtime/router/figures.py)."""
        ready = {role: len(router.workers.pool(role).ready()) for role in ROLES}
        return router.planner.view(ready, time.monotonic())

    @app.post("/debug/probe", include_in_schema=False)
    async def probe(request: Request) -> dict[str, Any]:
        """The rollout gate's probes through the pair the body names (runtime/router/probe.py;
        the admin key's alone, also without API keys: ApiKeyGate's `admin_only`)."""
        body = parse_model(ProbeBody, await request.body(), request.headers.get("content-type"))
        try:
            verdict = await run_probes(router.client, router.proxy, router.key,
                                       router.config.ticket_ttl_s, body)
        finally:  # a probed server outside the pools leaves no series behind
            members = {w.url for w in router.workers.all()}
            probed: list[tuple[Role, str]] = [("prefill", body.prefill), ("decode", body.decode)]
            for role, url in probed:
                if url not in members:
                    router.metrics.forget_worker(role, url)
        return verdict.body()

    @app.get("/debug/kv_index", include_in_schema=False)
    async def kv_index() -> dict[str, Any]:
        """cache_aware: the block hashes each prefill's KV events say its cache holds."""
        return {"policy": router.config.policy, "workers": router.index.view()}


def _generation_route(router: Router, endpoint: str) -> Any:
    async def route(request: Request) -> Response:
        return await router.generate(request, endpoint)

    route.__name__ = "post_" + endpoint.strip("/").replace("/", "_").replace(".", "_")
    return route


def _add_error_handlers(app: FastAPI) -> None:
    async def on_router_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, RouterError | UpstreamFailure)
        return exc.response()

    async def on_http(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return RouterError(exc.status_code, str(exc.detail), code=code).response()

    async def on_crash(_: Request, exc: Exception) -> Response:
        log.exception("unhandled error", exc_info=exc)
        return RouterError(500, f"internal error: {exc}", "server_error", "internal").response()

    app.add_exception_handler(RouterError, on_router_error)
    app.add_exception_handler(UpstreamFailure, on_router_error)
    app.add_exception_handler(HTTPException, on_http)
    app.add_exception_handler(Exception, on_crash)
