"""The correctness gate's probes (issue 39; docs/rollouts.md "The gate's probes"): requests through one
named (prefill, decode) pair, outside the router's pools, each checked token by token.

    POST /debug/probe {"prefill": URL, "bootstrap_port": N, "decode": URL,
                       "prompt_tokens": [5, 40, 300], "max_tokens": 8}

Both servers must run the token oracle sampler and the KV canary (a 409 otherwise: such a probe
could prove nothing). The oracle fixes every token from the request's room and the position
alone (runtime/canary/oracle.py), so each probe's output is known before it runs, whatever the
weights; the canary checks every slot of KV the decode reads, the prompt's that came over the
wire included. A probe passes when it answers 200 with exactly the oracle's tokens, and
neither server's canary counted a violation while the probes ran. The answer names each probe
("probe 3: 300 prompt tokens, prefill P -> decode D") and why one failed; `passed` is the
verdict. The prompts are token ids drawn from a seeded generator over the vocabulary: the
oracle does not read them, the canary's tags do.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Annotated, Any

import httpx
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from runtime.auth.key import ClusterKey
from runtime.canary.oracle import oracle_sequence
from runtime.router.attempt import Attempt
from runtime.router.errors import RouterError, UpstreamFailure
from runtime.router.health import json_body, learn
from runtime.router.policy import same_kv
from runtime.router.proxy import Proxy
from runtime.router.request import GENERATE, parse_request
from runtime.router.workers import Worker, kv_difference

ORACLE = "token_oracle"
SEED = 39  # the prompts' generator: the same probes every time
VIOLATIONS = re.compile(r"^baton_kv_canary_violations_total(?:\{[^}]*\})?\s+(\S+)$", re.M)


Url = Annotated[str, Field(pattern=r"^https?://"), AfterValidator(lambda url: url.rstrip("/"))]


class ProbeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prefill: Url
    bootstrap_port: int = Field(ge=1, le=65535)
    decode: Url
    # a page and less, several pages and a partial one, many pages (the builtin's are 16)
    prompt_tokens: list[Annotated[int, Field(ge=1, le=32768)]] = Field(
        default=[5, 40, 300], min_length=1, max_length=16)
    max_tokens: int = Field(default=8, ge=1, le=256)


@dataclass
class ProbeResult:
    name: str
    passed: bool
    why: str = ""  # a failed probe's reason


@dataclass
class Verdict:
    probes: list[ProbeResult] = field(default_factory=list)
    violations: dict[str, float] = field(default_factory=dict)  # canary counts during the probes

    @property
    def failed(self) -> str | None:
        """The first failed probe's name and reason."""
        return next((f"{r.name}: {r.why}" for r in self.probes if not r.passed), None)

    def body(self) -> dict[str, Any]:
        return {"passed": self.failed is None, "failed": self.failed, **asdict(self)}


async def run_probes(client: httpx.AsyncClient, proxy: Proxy, key: ClusterKey, ttl_s: float,
                     body: ProbeBody) -> Verdict:
    """Every probe of `body` on its pair, one after another; a RouterError (409) when the pair
    cannot take probes at all (a server unreachable or not ready, without the oracle or the
    canary, or the two unable to exchange KV)."""
    p = Worker("prefill", body.prefill, body.bootstrap_port)
    d = Worker("decode", body.decode)
    infos = await asyncio.gather(*(_probeable(client, w) for w in (p, d)))
    vocab = int(infos[1]["vocab_size"])
    if not same_kv(p, d):
        raise RouterError(409, f"prefill {p.url} cannot send KV to decode {d.url}: "
                               f"{kv_difference(p.kv_transfer, d.kv_transfer)}", code="not_paired")
    before = await _violations(client, (p, d))
    rng = random.Random(SEED)
    results = []
    for n, length in enumerate(body.prompt_tokens, 1):
        name = f"probe {n}: {length} prompt tokens, prefill {p.url} -> decode {d.url}"
        ids = [rng.randrange(vocab) for _ in range(length)]
        why = await _probe(proxy, key, ttl_s, p, d, ids, body.max_tokens, vocab)
        results.append(ProbeResult(name, why is None, why or ""))
    after = await _violations(client, (p, d))
    counted = {w.url: after[w.url] - before[w.url] for w in (p, d)}
    for url, count in counted.items():
        if count > 0:
            results.append(ProbeResult(f"KV canary of {url}", False,
                                       f"{count:g} violation(s) while the probes ran"))
    return Verdict(results, counted)


async def _probeable(client: httpx.AsyncClient, worker: Worker) -> dict[str, Any]:
    """`worker`'s /server_info, once its /ready said 200 (what the router learns from it set
    on `worker`); a 409 naming what makes it unfit for probes."""
    try:
        ready = await client.get(f"{worker.url}/ready")
        info = await client.get(f"{worker.url}/server_info")
    except httpx.HTTPError as e:
        raise RouterError(409, f"{worker.role} {worker.url} cannot be probed: "
                               f"{type(e).__name__}: {e}", code="not_probeable") from None
    if ready.status_code != 200 or info.status_code != 200:
        raise RouterError(409, f"{worker.role} {worker.url} is not ready (GET /ready "
                               f"{ready.status_code})", code="not_probeable")
    learn(worker, json_body(ready))
    shown = json_body(info)
    if not isinstance(shown.get("vocab_size"), int):
        raise RouterError(409, f"{worker.role} {worker.url} cannot be probed: its /server_info "
                               "shows no vocab_size (not a baton server of this version)",
                          code="not_probeable")
    missing = [what for what, on in (
        (f"the {ORACLE} sampler (--sampler-backend {ORACLE})", shown.get("sampler_backend") == ORACLE),
        ("the KV canary (--kv-canary log|raise)", shown.get("kv_canary") not in (None, "none")),
        (f"the {worker.role} role", shown.get("role") == worker.role)) if not on]
    if missing:
        raise RouterError(409, f"{worker.role} {worker.url} cannot be probed: it does not run "
                               + " or ".join(missing), code="not_probeable")
    return dict(shown)


async def _probe(proxy: Proxy, key: ClusterKey, ttl_s: float, p: Worker, d: Worker,
                 ids: list[int], max_tokens: int, vocab: int) -> str | None:
    """One greedy request through (p, d): None when its output is the oracle's, else why not."""
    raw = json.dumps({"input_ids": ids, "sampling_params": {
        "max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True}}).encode()
    req = parse_request(GENERATE, raw, "application/json")
    req = req.signed(key, p, d, ttl_s)
    attempt = Attempt(proxy, req, p, d)
    try:
        upstream = await attempt.answer(None)
        out = json.loads(await attempt.read(upstream))
        await attempt.prefill_task
    except UpstreamFailure as e:
        attempt.abort(e)
        return f"{e.side} answered {e.status}: {(e.body.get('error') or {}).get('message')}"
    except ValueError as e:
        attempt.abort()
        return f"the decode's answer is not JSON: {e}"
    except BaseException:  # cancelled (the caller left): neither side keeps the request
        attempt.abort()
        raise
    attempt.release()
    return oracle_mismatch(out, oracle_sequence(int(req.body["bootstrap_room"]), len(ids), max_tokens, vocab))


def oracle_mismatch(out: Any, want: Sequence[int]) -> str | None:
    """Why a decode's /generate answer is not the oracle's `want` (None: it is)."""
    got = out.get("output_ids") if isinstance(out, dict) else None
    reason = ((out.get("meta_info") or {}).get("finish_reason") or {}) if isinstance(out, dict) else {}
    if not isinstance(got, list):
        return f"the decode's answer has no output_ids: {str(out)[:200]}"
    if reason.get("type") == "abort":
        return f"aborted: {reason.get('message')}"
    if got != list(want):
        at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
                  min(len(got), len(want)))
        return (f"token {at} is {got[at] if at < len(got) else 'missing'}, the oracle's is "
                f"{want[at] if at < len(want) else 'none'} ({len(got)} tokens, {len(want)} wanted)")
    return None


async def _violations(client: httpx.AsyncClient, workers: Sequence[Worker]) -> dict[str, float]:
    """Each worker's KV canary violations so far (all kinds), from its /metrics."""

    async def count(w: Worker) -> float:
        try:
            text = (await client.get(f"{w.url}/metrics")).text
        except httpx.HTTPError as e:
            raise RouterError(409, f"{w.role} {w.url}: GET /metrics failed: {e}",
                              code="not_probeable") from None
        return sum(float(v) for v in VIOLATIONS.findall(text))

    counts = await asyncio.gather(*(count(w) for w in workers))
    return {w.url: c for w, c in zip(workers, counts, strict=True)}
