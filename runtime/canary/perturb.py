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

Under tensor parallelism every rank runs a Perturber, seeded alike, and draws in lockstep (the
same forwards, tables and tags): each rank repoints its own table and swaps its own sampled
tokens alike, and a KV strike is drawn on every rank but lands on one, its pool's copy: the
n-th kv_after_forward (from 0) on rank (n + 1) mod tp, so the first strikes a follower and
each rank is struck in turn. kv_before_send is rank 0's alone (the prefill role calls it, with
a generator of its own, so the lockstep draws stay alike): it names the rank to strike, the
n-th on the (n + 1)-th mod k of the k ranks whose pages are sent (HeadSplit.counted), and
runtime/canary/ranks.py flips the element there.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import torch

from runtime.canary.kvsum import HeadSplit
from runtime.canary.perturb_kinds import parse_perturb
from runtime.canary.slots import SlotTags
from runtime.forward_batch import ForwardBatch
from runtime.kvcache.pool import KVPool

Element = tuple[int, int, int, int, int, int]  # an index into KVPool.buffer
Strike = tuple[int, Element]  # the rank whose pool is struck, and where


def flip(buffer: torch.Tensor, element: Element) -> None:
    """Flip the sign bit of one element of a KV pool's buffer (a second flip undoes it)."""
    x = buffer[element]
    if x.element_size() == 1:  # fp8 has no neg_ on the CPU: flip its sign bit
        x.view(torch.uint8).bitwise_xor_(0x80)
    else:
        x.neg_()


class Perturber:
    def __init__(self, spec: str, seed: int, warmup_steps: int, tags: SlotTags,
                 pool: KVPool | None, vocab_size: int, split: HeadSplit | None = None) -> None:
        """`split`: the TP ranks and this one (None: one rank)."""
        self.probs, self.warmup = parse_perturb(spec), warmup_steps
        self.rng = random.Random(seed)
        self.send_rng = random.Random(seed)  # before_send's, drawn on rank 0 only
        self.tags, self.pool, self.vocab = tags, pool, vocab_size
        self.rank, self.size = (split.rank, split.size) if split is not None else (0, 1)
        self.senders = split.counted if split is not None else [0]
        self.steps = 0
        self.strikes = self.sent = 0  # KV strikes so far, after forwards and before sends
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
            element = self._pick(self.rng, slot // self._page_size(), slot % self._page_size())
            self.strikes += 1  # the n-th strike (from 0) lands on rank (n + 1) mod tp
            if self.strikes % self.size == self.rank:
                flip(self.buffer, element)
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

    @property
    def buffer(self) -> torch.Tensor:
        """This rank's KV pool, where its KV strikes land."""
        assert self.pool is not None, "KV perturbations need the KV pool"
        return self.pool.buffer

    def _pick(self, rng: random.Random, page: int, slot_in_page: int | None = None) -> Element:
        """One element of `page` (of a slot of it, or any) of this rank's pool, drawn."""
        assert self.pool is not None
        pool = self.pool
        off = rng.randrange(pool.page_size) if slot_in_page is None else slot_in_page
        return (page, rng.randrange(pool.num_layers), rng.randrange(2), off,
                rng.randrange(pool.num_kv_heads), rng.randrange(pool.head_dim))

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

    def before_send(self, pages: list[int]) -> Strike | None:
        """PD prefill: maybe corrupt one of the pages about to be sent to a decode server (the
        prompt's slots only): which rank's element to flip (None: nothing injected). The
        caller flips it, and flips it back once the pages are sent: the prefix cache may keep
        the page."""
        p = self.probs.get("kv_before_send", 0.0)
        if not pages or p == 0.0 or self.send_rng.random() >= p:
            return None
        element = self._pick(self.send_rng, self.send_rng.choice(pages), 0)
        self.sent += 1  # the n-th (from 0) on the (n + 1)-th sending rank
        return self.senders[self.sent % len(self.senders)], element
