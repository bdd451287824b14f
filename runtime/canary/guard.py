"""CanaryGuard: what the model runner does for the KV canary after each forward.

    tag the slots the forward wrote (SlotTags.write) → inject faults when asked (Perturber) →
    check what the scheduler asked about (SlotTags.check)

Built only when `--kv-canary` is on (`build_guard` returns None otherwise), so a runner without
it pays one None check a forward.
"""

from __future__ import annotations

import torch

from runtime.canary.perturb import Perturber
from runtime.canary.slots import SlotTags
from runtime.config import CanaryConfig
from runtime.forward_batch import ForwardBatch, ForwardOutput
from runtime.kvcache.pool import KVPool


class CanaryGuard:
    def __init__(self, tags: SlotTags, perturber: Perturber | None = None) -> None:
        self.tags = tags
        self.perturber = perturber

    def after_forward(self, batch: ForwardBatch, result: ForwardOutput) -> None:
        """`result`: the forward's output, its next tokens still on the device."""
        self.tags.write(batch)
        if batch.canary is None:
            return
        if self.perturber is not None:
            result.injections = self.perturber.after_write(batch, result.next_token_ids)
        result.canary_violations = self.tags.check(batch)


def build_guard(config: CanaryConfig | None, table: torch.Tensor, pool: KVPool | None,
                num_slots: int, vocab_size: int, oracle: bool) -> CanaryGuard | None:
    """`oracle`: the sampler is the token oracle, so decode inputs can be checked too."""
    if config is None or not config.enabled:
        return None
    tags = SlotTags(num_slots, table, pool, config.kv_canary_bytes,
                    vocab_size if oracle else None)
    perturber = None
    if config.perturb:
        perturber = Perturber(config.perturb, config.perturb_seed, config.perturb_warmup_steps,
                              tags, pool, vocab_size)
    return CanaryGuard(tags, perturber)
