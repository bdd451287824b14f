"""Which (prefill, decode) pair a request goes to: the policy's pick among the pairs that may
take it now, its room ticket signed for that pair; or, with no pair at all, the fallback.

Pairs are taken from the first of these that has one: those neither quarantined (`pairs.py`)
nor avoided by a retry, those not quarantined, any that can exchange KV (a quarantine steers
requests to a pair's other partners; it never refuses a request that only that pair can take).
A pair past its quarantine gets the next request its prefill is picked for, as its probe.
With no ready pair: `--fallback colocated` sends the request to a ready decode that prefills it
itself (no prefill: `None`), else a 503 names the cause.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from runtime.auth.key import ClusterKey
from runtime.handover import KVOffer
from runtime.router.config import RouterConfig
from runtime.router.errors import unavailable
from runtime.router.metrics import RouterMetrics
from runtime.router.pairs import PairTable
from runtime.router.policy import Allowed, Policy, least_loaded, same_kv
from runtime.router.request import RoutedRequest, prompt_ids
from runtime.router.tokenizer import RouterTokenizer
from runtime.router.workers import Worker, Workers

log = logging.getLogger("baton.router")


class Pairing:
    def __init__(self, config: RouterConfig, workers: Workers, pairs: PairTable, policy: Policy,
                 tokenizer: RouterTokenizer, key: ClusterKey, metrics: RouterMetrics) -> None:
        self.config, self.workers, self.pairs, self.policy = config, workers, pairs, policy
        self.tokenizer, self.key, self.metrics = tokenizer, key, metrics

    def route(self, req: RoutedRequest, avoid_workers: set[Worker] | None = None,
              avoid_pairs: set[tuple[Worker, Worker]] | None = None,
              ) -> tuple[RoutedRequest, Worker | None, Worker]:
        """A pair for `req` by policy and `req` signed for it (see the module's order)."""
        prefill, decode = self.workers.pairable()
        avoided, pairs = avoid_workers or set(), avoid_pairs or set()
        if not (prefill and decode):
            return req, None, self._fallback(avoided)

        def healthy(p: Worker, d: Worker) -> bool:
            return same_kv(p, d) and self.pairs.usable(p, d)

        def fresh(p: Worker, d: Worker) -> bool:
            return healthy(p, d) and not ({p, d} & avoided) and (p, d) not in pairs

        allowed: Allowed = next((rule for rule in (fresh, healthy)
                                 if any(rule(p, d) for p in prefill for d in decode)), same_kv)
        p, d = self.policy.pick(prefill, decode, req.ids, allowed, req.body.get("cache_salt"))
        # a pair of p's due for its probe gets this request: else a policy that keeps pairing
        # p with another decode would never find out that the pair works again
        d = next((x for x in decode if allowed(p, x) and self.pairs.probe_due(p, x)), d)
        log.debug("%s %s -> prefill %s, decode %s", req.endpoint, req.rid, p.url, d.url)
        return req.signed(self.key, p, d, self.config.ticket_ttl_s), p, d

    def prepare(self, req: RoutedRequest) -> RoutedRequest:
        """`req` with its prompt's token ids, when the policy reads them: CPU-bound work (a
        tokenizer, a chat template), which the router does off its event loop."""
        if not self.policy.wants_ids:
            return req
        return replace(req, ids=prompt_ids(req.parsed, self.tokenizer.get()))

    def move(self, req: RoutedRequest, source: Worker, offer: KVOffer,
             ) -> tuple[RoutedRequest, Worker] | None:
        """A ready decode to take over `req` from `source`, a draining decode that offers
        the stream's KV where `offer` says (runtime/disagg/move.py), with `req` addressed and
        signed for it; None when no decode can (the stream's tokens are replayed instead)."""
        if not source.instance_id or offer.instance_id != source.instance_id:
            return None
        decodes = [d for d in self.workers.decode.ready()
                   if d is not source and d.kv_transfer == source.kv_transfer]
        if not decodes:
            return None
        decode = least_loaded(decodes)
        moved = req.moved(offer.host, offer.port, offer.room)
        return moved.signed(self.key, source, decode, self.config.ticket_ttl_s), decode

    def _fallback(self, avoided: set[Worker]) -> Worker:
        """`--fallback colocated`: a ready decode that prefills requests itself."""
        reason = self.workers.unready_reason() or "no ready pair of workers"
        if self.config.fallback != "colocated":
            raise unavailable(reason)
        local = [d for d in self.workers.decode.ready() if d.local_prefill]
        if not local:
            raise unavailable(f"{reason}; and no ready decode prefills locally (start them with "
                              "--allow-local-prefill for --fallback colocated)")
        decode = least_loaded([d for d in local if d not in avoided] or local)
        self.metrics.on_fallback()
        log.debug("no prefill to pair (%s): decode %s prefills the request itself", reason,
                 decode.url)
        return decode

    def degraded(self) -> str | None:
        """Why requests go to decodes alone now (None: they are disaggregated)."""
        if self.config.fallback != "colocated" or all(self.workers.pairable()):
            return None
        if not any(d.local_prefill for d in self.workers.decode.ready()):
            return None
        return self.workers.unready_reason()

