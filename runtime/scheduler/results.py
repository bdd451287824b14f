"""ResultProcessor: what a finished forward's tokens do to its requests.

For each request of the forward (the `Launched` snapshot), in order:
- finished, aborted or retracted meanwhile: dropped (the forward was launched before we knew);
- its KV canary check failed: it ends with an abort and its KV is discarded, reused by nobody;
- otherwise its KV is written now (`computed_len`); an extend's prompt pages become reusable,
  and a prompt chunk that is not the last samples nothing; the last one counts the prompt
  tokens it computed in the figures, once per request (a retracted request's re-prefill, after
  its first token, is not a new prompt);
- else it takes its token. A `hand_off` request goes to the Handoffs instead of on here (a
  prefill's after its prompt; a draining decode's unless the token ends it); one that finished
  frees its KV.
`process` returns the requests whose outputs are due, in batch order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runtime.canary.monitor import CanaryMonitor
from runtime.figures import ServingFigures
from runtime.forward_batch import ForwardOutput
from runtime.kvcache.manager import KVCacheManager
from runtime.scheduler.handoff import Handoffs
from runtime.scheduler.req import Req
from runtime.scheduler.runner import Launched, StopCheck


@dataclass
class HostRows:
    """A forward's outputs as host lists; row i belongs to the forward's request i."""

    ids: list[int]
    logprobs: list[float] | None
    top: list[list[list[Any]]] | None  # [values, token ids], each [B][max top-k]
    info: dict[str, list[Any]]

    @classmethod
    def of(cls, out: ForwardOutput) -> HostRows:
        return cls(
            out.next_token_ids.tolist(),
            out.logprobs.tolist() if out.logprobs is not None else None,
            [t.tolist() for t in out.top_logprobs] if out.top_logprobs is not None else None,
            out.customized_info or {},
        )

    def append_to(self, req: Req, i: int) -> None:
        """Row i's token, with what `req` asked for alongside it."""
        k = req.top_logprobs_num
        top = self.top
        req.append_token(
            self.ids[i],
            self.logprobs[i] if self.logprobs is not None else None,
            list(zip(top[1][i][:k], top[0][i][:k], strict=True)) if top and k else None,
            {key: values[i] for key, values in self.info.items()},
        )


class ResultProcessor:
    def __init__(self, kv: KVCacheManager, stop: StopCheck, handoffs: Handoffs,
                 canary: CanaryMonitor | None, figures: ServingFigures) -> None:
        self.kv = kv
        self.stop = stop
        self.handoffs = handoffs
        self.canary = canary
        self.figures = figures

    def process(self, done: Launched, out: ForwardOutput) -> list[Req]:
        """Apply `out` (on the host) to `done`'s requests; the ones with an output due."""
        rows = HostRows.of(out)
        caught = self._caught(done, out)
        touched = []
        for i, req in enumerate(done.reqs):
            if req.finished or req.is_retracted:
                continue
            if i in caught:  # its KV is not its own: it ends here, and its KV goes to nobody
                req.finish("abort", caught[i])
                self.kv.discard(req)
                touched.append(req)
            elif self._advance(done, i, req, rows):
                touched.append(req)
        return touched

    def _caught(self, done: Launched, out: ForwardOutput) -> dict[int, str]:
        """The KV canary's verdicts: row -> why its KV is not its own (when the canary is on)."""
        if self.canary is None:
            return {}
        live = [not (r.finished or r.is_retracted) for r in done.reqs]
        return self.canary.verdicts(done.reqs, out, live)

    def _advance(self, done: Launched, i: int, req: Req, rows: HostRows) -> bool:
        """Request i's KV is written and, unless it was a prompt's earlier chunk, its token
        sampled; True if it has an output due here."""
        req.kv.computed = max(req.kv.computed, done.kv_lens[i])  # its KV is written now
        if done.mode == "extend":  # its prompt's pages are reusable from now on
            self.kv.cache_progress(req)
            if not done.is_last_chunk[i]:
                return False
            if not req.output_ids:  # its prompt is prefilled
                self.figures.prompts.add(len(req.origin_input_ids) - req.cached_tokens)
        rows.append_to(req, i)
        if req.hand_off and done.mode == "extend":  # prefill role: KV and first token
            self.handoffs.add(req)  # are here, the request is the role's now
            return False
        self.stop(req)
        if req.finished:
            self.kv.release(req)
        elif req.hand_off:  # a draining decode moves it, with this token (`hand_off_running`)
            self.handoffs.add(req)
            return False
        return True
