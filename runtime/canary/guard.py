"""CanaryGuard: what the model runner does for the KV canary after each forward.

    tag the slots the forward wrote (SlotTags.write) → inject faults when asked (Perturber) →
    check what the scheduler asked about (SlotTags.check)

Built only when `--kv-canary` is on (`build_guard` returns None otherwise), so a runner without
it pays one None check a forward. Under tensor parallelism every rank has one, over its own
pool, and runs it after the same forwards: each checks its own KV heads' bytes, and the ranks'
violations are joined (`join`: the largest count of each row and kind over the ranks, one
all-reduce of [B, kinds] in each checked forward), so rank 0's ForwardOutput holds a fault
that any rank found. The scheduler sends checks with every forward, so that collective also
means that once rank 0 has a forward's result, every rank has tagged and summed the slots it
wrote (what runtime/canary/ranks.py reads of them at a hand-off).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from runtime.canary.kvsum import HeadSplit
from runtime.canary.perturb import Perturber
from runtime.canary.slots import SlotTags
from runtime.config import CanaryConfig
from runtime.forward_batch import ForwardBatch, ForwardOutput
from runtime.kvcache.pool import KVPool

Join = Callable[[torch.Tensor], torch.Tensor]  # every TP rank's violations, joined in place


class CanaryGuard:
    def __init__(self, tags: SlotTags, perturber: Perturber | None = None,
                 join: Join | None = None) -> None:
        """`join`: the TP group's elementwise max (None: one rank)."""
        self.tags = tags
        self.perturber = perturber
        self.join = join

    def after_forward(self, batch: ForwardBatch, result: ForwardOutput) -> None:
        """`result`: the forward's output, its next tokens still on the device."""
        self.tags.write(batch)
        if batch.canary is None:
            return
        if self.perturber is not None:
            result.injections = self.perturber.after_write(batch, result.next_token_ids)
        found = self.tags.check(batch)
        result.canary_violations = self.join(found) if self.join is not None else found


def build_guard(config: CanaryConfig | None, table: torch.Tensor, pool: KVPool | None,
                num_slots: int, vocab_size: int, oracle: bool, split: HeadSplit | None = None,
                join: Join | None = None) -> CanaryGuard | None:
    """`oracle`: the sampler is the token oracle, so decode inputs can be checked too;
    `split`, `join`: under TP, the ranks' KV heads (this rank's pool holds its own) and the
    group's max."""
    if config is None or not config.enabled:
        return None
    tags = SlotTags(num_slots, table, pool, config.kv_canary_bytes,
                    vocab_size if oracle else None, split)
    perturber = None
    if config.perturb:
        perturber = Perturber(config.perturb, config.perturb_seed, config.perturb_warmup_steps,
                              tags, pool, vocab_size, split)
    return CanaryGuard(tags, perturber, join)
