"""Fault injection for the KV canary's self-tests (`baton serve --perturb KIND=PROB,...`).

Off by default: nothing here is built, and the runner does one None check a forward. On, the
runner calls `after_write` after each forward wrote its KV and the canary its tags, before the
canary checks; the prefill role calls `before_send` before a KV transfer. Each kind, with its
probability per eligible row (a request the scheduler marks as certain to run more forwards,
ForwardBatch.canary), once the first `warmup_steps` forwards are past:

    kv_after_forward  negate one element of the KV a row just wrote (caught: byte checksums)
    req_to_token      point one req->token entry of the row at another slot (caught: tags)
    wrong_slots       point the row's table at another row's slots (caught: tags)
    next_token_swap   replace a decode row's sampled token (caught: the token oracle check)
    kv_before_send    negate one element of a page about to be sent (PD; caught on arrival)

Every injection is returned as (row, kind) so the scheduler can record which request it hit;
tests assert that injected == caught. A row injected in one forward is left alone in the next:
the scheduler may have ended its request and handed its table row to another meanwhile.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

import torch

from runtime.canary.perturb_kinds import parse_perturb
from runtime.canary.slots import SlotTags
from runtime.forward_batch import ForwardBatch
from runtime.kvcache.pool import KVPool


class Perturber:
    def __init__(self, spec: str, seed: int, warmup_steps: int, tags: SlotTags,
                 pool: KVPool | None, vocab_size: int) -> None:
        self.probs, self.warmup = parse_perturb(spec), warmup_steps
        self.rng = random.Random(seed)
        self.tags, self.pool, self.vocab = tags, pool, vocab_size
        self.steps = 0
        self.recent: set[int] = set()  # table rows injected in the previous forward

    def after_write(self, batch: ForwardBatch, next_ids: torch.Tensor) -> list[tuple[int, str]]:
        """Inject into this forward's KV, table or sampled tokens; returns what it did."""
        self.steps += 1
        if self.steps <= self.warmup or batch.canary is None:
            return []
        done: list[tuple[int, str]] = []
        for row in self._eligible(batch):
            for kind, p in self.probs.items():
                if kind != "kv_before_send" and self.rng.random() < p and \
                        self._inject(kind, batch, row, next_ids):
                    done.append((row, kind))
                    break
        self.recent = {int(batch.req_pool_indices[row]) for row, _ in done}
        return done

    def _eligible(self, batch: ForwardBatch) -> Iterator[int]:
        assert batch.canary is not None
        ok = batch.canary[3].tolist()
        table_rows = batch.req_pool_indices.tolist()
        return (i for i in range(batch.batch_size) if ok[i] and table_rows[i] not in self.recent)

    def _inject(self, kind: str, batch: ForwardBatch, row: int, next_ids: torch.Tensor) -> bool:
        if kind == "kv_after_forward":
            slot = int(batch.out_cache_loc[sum(batch.extend_lens[: row + 1]) - 1])  # its newest
            self._negate_one(slot // self._page_size(), slot % self._page_size())
            return True
        if kind == "req_to_token":
            return self._repoint(batch, row)
        if kind == "wrong_slots":
            return self._swap_rows(batch, row)
        if kind == "next_token_swap" and batch.mode == "decode":
            next_ids[row] = (next_ids[row] + self.rng.randrange(1, self.vocab)) % self.vocab
            return True
        return False

    def _page_size(self) -> int:
        assert self.pool is not None, "KV perturbations need the KV pool"
        return self.pool.page_size

    def _negate_one(self, page: int, slot_in_page: int | None = None) -> Callable[[], None]:
        """Flip the sign bit of one element of `page` (a slot of it, or any); returns the undo
        (flipping it back)."""
        assert self.pool is not None
        pool, r = self.pool, self.rng
        off = r.randrange(pool.page_size) if slot_in_page is None else slot_in_page
        element = pool.buffer[page, r.randrange(pool.num_layers), r.randrange(2), off,
                              r.randrange(pool.num_kv_heads), r.randrange(pool.head_dim)]
        if element.element_size() == 1:  # fp8 has no neg_ on the CPU: flip its sign bit
            element = element.view(torch.uint8)
            element.bitwise_xor_(0x80)
            return lambda: element.bitwise_xor_(0x80)  # type: ignore[return-value]
        element.neg_()

        def undo() -> None:
            element.neg_()
        return undo

    def _repoint(self, batch: ForwardBatch, row: int) -> bool:
        table, tags = self.tags.table, self.tags.tags
        r = int(batch.req_pool_indices[row])
        pos = self.rng.randrange(batch.seq_lens[row])
        for _ in range(8):  # a slot holding other KV than the one it replaces
            slot = self.rng.randrange(len(tags))
            if int(tags[slot]) != int(tags[table[r, pos]]):
                table[r, pos] = slot
                return True
        return False

    def _swap_rows(self, batch: ForwardBatch, row: int) -> bool:
        table, tags = self.tags.table, self.tags.tags
        others = [i for i in range(batch.batch_size) if i != row]
        if not others:
            return False
        other = self.rng.choice(others)
        r, o = int(batch.req_pool_indices[row]), int(batch.req_pool_indices[other])
        n = min(batch.seq_lens[row], batch.seq_lens[other])
        if not bool((tags[table[r, :n]] != tags[table[o, :n]]).any()):
            return False  # the same tokens: the other's slots hold this request's KV too
        table[r, :n] = table[o, :n]
        return True

    def before_send(self, pages: list[int]) -> Callable[[], None] | None:
        """PD prefill: maybe corrupt one of the pages about to be sent to a decode server (the
        prompt's slots only); returns the undo, for once they are sent: the prefix cache may
        keep the page. None: nothing injected."""
        p = self.probs.get("kv_before_send", 0.0)
        if not pages or p == 0.0 or self.rng.random() >= p:
            return None
        return self._negate_one(self.rng.choice(pages), 0)
