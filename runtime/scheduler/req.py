"""Req: one generation request's state as the scheduler sees it."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from runtime.messages import Bootstrap, FinishKind, FinishReason, KVOffer
from runtime.sampling_params import SamplingParams


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
    # KV state (owned by KVCacheManager): table row, pages, and tokens whose KV is (being) written.
    req_pool_idx: int | None = None
    kv_pages: list[int] = field(default_factory=list)
    kv_len: int = 0
    computed_len: int = 0  # of kv_len, the positions a finished forward wrote (cacheable)
    cache_node: Any = None  # the prefix-cache node it reads from (locked), if any
    cache_salt: str | None = None  # the prefix cache's namespace it reads and fills
    cached_tokens: int = 0  # prompt tokens found in the prefix cache at its first admission
    canary_chain: Any = None  # KV canary: the tags its tokens give their slots (ReqChain)
    # Set when the scheduler evicts the request to free KV; results of batches that were already
    # in flight for it are dropped, and it re-prefills prompt + output later.
    is_retracted: bool = False
    # Per-token outputs beyond the ids.
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    customized_info: dict[str, list[Any]] = field(default_factory=dict)
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
            self.output_logprobs.append(logprob)
            if self.top_logprobs_num and top_logprobs is not None:
                self.output_top_logprobs.append(top_logprobs)
        for key, value in (info or {}).items():
            self.customized_info.setdefault(key, []).append(value)

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
            # its KV, which this one gives up below
            req_pool_idx=self.req_pool_idx, kv_pages=self.kv_pages, kv_len=self.kv_len,
            computed_len=self.computed_len, cache_node=self.cache_node,
        )
        token = self.output_ids.pop()
        logprob = self.output_logprobs.pop() if self.return_logprob and self.output_logprobs else None
        top = self.output_top_logprobs.pop() if logprob is not None and self.top_logprobs_num \
            and self.output_top_logprobs else None
        info = {key: values.pop() for key, values in self.customized_info.items() if values}
        moved.append_token(token, logprob, top, info)
        self.req_pool_idx, self.kv_pages, self.cache_node = None, [], None
        self.kv_len = self.computed_len = 0
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
        self.kv_len = 0
