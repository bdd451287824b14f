"""Req: one generation request's state as the scheduler sees it."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from runtime.kvcache.manager import KVSlots
from runtime.messages import Bootstrap, FinishKind, FinishReason, KVOffer
from runtime.sampling_params import SamplingParams


@dataclass
class TokenLog:
    """What a request asked for beside its output tokens, one entry per token: logprobs, top
    logprobs (each only when asked for), and custom per-token info from the sampler."""

    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    info: dict[str, list[Any]] = field(default_factory=dict)

    def at(self, i: int) -> tuple[float | None, list[tuple[int, float]] | None, dict[str, Any]]:
        """Token `i`'s entries (None / {} where nothing was logged)."""
        return (self.logprobs[i] if self.logprobs else None,
                self.top_logprobs[i] if self.top_logprobs else None,
                {key: values[i] for key, values in self.info.items() if values})

    def pop(self) -> tuple[float | None, list[tuple[int, float]] | None, dict[str, Any]]:
        """The newest token's entries, taken out."""
        return (self.logprobs.pop() if self.logprobs else None,
                self.top_logprobs.pop() if self.top_logprobs else None,
                {key: values.pop() for key, values in self.info.items() if values})


@dataclass(eq=False)
class Req:
    rid: str
    origin_input_ids: list[int]
    sampling_params: SamplingParams
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    bootstrap: Bootstrap | None = None  # PD: its room, its prefill, the router's ticket
    output_ids: list[int] = field(default_factory=list)
    finished_reason: FinishReason | None = None
    kv: KVSlots = field(default_factory=KVSlots)  # its KV pages and table row (KVCacheManager)
    cache_salt: str | None = None  # the prefix cache's namespace it reads and fills
    cached_tokens: int = 0  # prompt tokens found in the prefix cache at its first admission
    canary_chain: Any = None  # KV canary: the tags its tokens give their slots (ReqChain)
    # Set when the scheduler evicts the request to free KV; results of batches that were already
    # in flight for it are dropped, and it re-prefills prompt + output later.
    is_retracted: bool = False
    log: TokenLog = field(default_factory=TokenLog)  # per-token outputs beyond the ids
    # How many output tokens have been sent out (OutputStreamer's cursor).
    sent_len: int = 0
    # Decode role: penalty rows start at its first decode step (its prompt was prefilled elsewhere).
    needs_penalty_reset: bool = False
    # Prefill role: once its first token is sampled the scheduler hands it (and its KV) over to
    # the role (`Handoffs.take_handed_off`) instead of decoding it. A draining decode sets it on
    # a running request to move it: its next token is the hand-over's (`split_off`).
    hand_off: bool = False
    movable: bool = False  # decode role: its client (the router) can follow it to another decode
    # a resumed stream (runtime/server/resume.py): how many of the prompt's last tokens are
    # outputs it generated before it moved, which penalties count as outputs
    resumed_outputs: int = 0
    seed: int = field(default_factory=lambda: random.getrandbits(63))

    def __post_init__(self) -> None:
        if self.sampling_params.seed is not None:
            self.seed = self.sampling_params.seed

    @property
    def bootstrap_room(self) -> int | None:
        return self.bootstrap.room if self.bootstrap is not None else None

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def fill_ids(self) -> list[int]:
        """Every token whose KV must be cached before the next token is sampled."""
        return self.origin_input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    def append_token(
        self,
        token: int,
        logprob: float | None = None,
        top_logprobs: list[tuple[int, float]] | None = None,
        info: dict[str, Any] | None = None,
    ) -> None:
        """Record one sampled token with what was asked for alongside it."""
        self.output_ids.append(token)
        if self.return_logprob and logprob is not None:
            self.log.logprobs.append(logprob)
            if self.top_logprobs_num and top_logprobs is not None:
                self.log.top_logprobs.append(top_logprobs)
        for key, value in (info or {}).items():
            self.log.info.setdefault(key, []).append(value)

    def finish(self, kind: FinishKind, message: str | None = None) -> None:
        self.finished_reason = FinishReason(kind, message=message)

    def hand_off_after_prompt(self) -> None:
        """Prefill role: this server prefills the prompt and samples the first token only (the
        decode server samples the rest); then the scheduler hands it over (`hand_off`)."""
        self.sampling_params = dataclasses.replace(self.sampling_params, max_new_tokens=1)
        self.hand_off = True

    def split_off(self, rid: str, room: int, offer: KVOffer) -> Req:
        """Decode role, draining: this request goes on on another decode (runtime/disagg/
        move.py). The new request `rid` holds this one's KV and seed; its prompt is the prompt
        and every output token but the newest (the tokens whose KV is written), and the newest
        token is its first, as a prefill hands a request over. This one keeps the tokens its
        client has or is due, and ends "moved", with the `offer` that says where it went."""
        moved = Req(
            rid, self.fill_ids[:-1], self.sampling_params, self.stream, self.return_logprob,
            self.top_logprobs_num, bootstrap=Bootstrap(room), hand_off=True, seed=self.seed,
            cache_salt=self.cache_salt,
            resumed_outputs=self.resumed_outputs + len(self.output_ids) - 1,
            cached_tokens=self.cached_tokens,  # (the prefill's, which its usage reports)
            kv=self.kv.give_up(),  # its KV, which this one gives up
        )
        moved.append_token(self.output_ids.pop(), *self.log.pop())
        self.finished_reason = FinishReason("moved", offer=offer)
        return moved

    def penalty_history(self, outputs: list[int]) -> tuple[list[int], list[int]]:
        """(prompt, outputs) as penalties see them, `outputs` being the output tokens counted
        so far: a resumed stream's outputs from before it moved are outputs too."""
        cut = len(self.origin_input_ids) - self.resumed_outputs
        return self.origin_input_ids[:cut], self.origin_input_ids[cut:] + outputs

    def check_finished(
        self,
        eos_ids: tuple[int, ...],
        context_len: int,
        decode_tail: Callable[[list[int]], str] | None,
    ) -> None:
        """Set finished_reason after the newest output token, if it ends the request."""
        if self.finished:
            return
        sp, last = self.sampling_params, self.output_ids[-1]
        if last in sp.stop_token_ids or (not sp.ignore_eos and last in eos_ids):
            self.finished_reason = FinishReason("stop", matched=last)
        elif sp.stop and decode_tail is not None and (hit := self._stop_string(decode_tail)):
            self.finished_reason = FinishReason("stop", matched=hit)
        elif len(self.output_ids) >= sp.max_new_tokens or self.seq_len >= context_len:
            self.finished_reason = FinishReason("length")

    def _stop_string(self, decode_tail: Callable[[list[int]], str]) -> str | None:
        longest = max(len(s) for s in self.sampling_params.stop)
        # Tokens decode to >= 1 character except pieces of a multi-byte character: the margin
        # keeps the window wide enough to hold the longest stop string.
        tail = decode_tail(self.output_ids[-(longest + 8) :])
        return next((s for s in self.sampling_params.stop if s in tail), None)

    def reset_for_retract(self) -> None:
        self.is_retracted = True
        self.kv.length = 0
