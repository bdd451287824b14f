"""The byte checksums over tensor-parallel ranks (runtime/canary/kvsum.py, ranks.py), without
processes: each rank's pool holds its KV heads (TensorParallel.kv_split), and the partial sums
of the ranks that own their heads add up to the one-rank sum of the same KV, whatever the TP,
KV heads copied on several ranks included (a copy's partial equals its owner's). Across PD the
same: what a prefill of one TP sends checks out on a decode of another, and a byte changed on
any rank of either side (a copy included) is caught on arrival. The followers here are real
RankCanary objects answering through `serve`, as a follower's call thread does; the socket
between the processes is tested by tests/disagg/test_pd_tp.py."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import replace
from typing import Any

import pytest
import torch

from runtime.canary.chain import ReqChain
from runtime.canary.guard import CanaryGuard, build_guard
from runtime.canary.handoff import HandoffCanary, slots_of
from runtime.canary.kvsum import HeadSplit, SlotSums
from runtime.canary.monitor import CanaryMonitor
from runtime.canary.ranks import RankCanary, serve
from runtime.config import CanaryConfig
from runtime.kvcache.pool import KVPool
from runtime.model_config import ModelConfig
from runtime.models.parallel import TensorParallel

PS, LAYERS, DIM, PAGES = 4, 3, 4, 6
CONFIG = CanaryConfig(kv_canary="raise", kv_canary_bytes="all")


def split_of(kv_heads: int, tp: int) -> HeadSplit:
    config = ModelConfig.from_hf_dict({
        "vocab_size": 100, "hidden_size": 12 * 16, "intermediate_size": 96,
        "num_hidden_layers": LAYERS, "num_attention_heads": 12, "num_key_value_heads": kv_heads})
    TensorParallel(0, tp).check(config)
    return HeadSplit(TensorParallel(0, tp).kv_split(config))


def whole_pool(kv_heads: int, seed: int = 0) -> KVPool:
    pool = KVPool(LAYERS, PAGES, PS, kv_heads, DIM, torch.float32)
    torch.manual_seed(seed)
    pool.buffer.normal_()
    return pool


def rank_pools(whole: KVPool, split: HeadSplit) -> list[KVPool]:
    """Each rank's pool: its heads of the whole pool's bytes."""
    pools = []
    for lo, hi in split.held:
        pool = KVPool(LAYERS, PAGES, PS, hi - lo, DIM, torch.float32)
        pool.buffer.copy_(whole.buffer[:, :, :, :, lo:hi])
        pools.append(pool)
    return pools


SPLITS = [(6, 1), (6, 2), (6, 3), (3, 3), (2, 4)]  # (KV heads, tp); 2 over 4: each copied twice


@pytest.mark.parametrize("mode", ["partial", "all"])
@pytest.mark.parametrize(("kv_heads", "tp"), SPLITS, ids=[f"{h}kv-tp{t}" for h, t in SPLITS])
def test_the_owners_partial_sums_add_up_to_the_one_rank_sum(kv_heads: int, tp: int,
                                                            mode: str) -> None:
    whole, split = whole_pool(kv_heads), split_of(kv_heads, tp)
    slots = torch.arange(whole.num_slots)
    want = SlotSums(whole, mode).of(slots)  # type: ignore[arg-type]
    parts = [SlotSums(pool, mode, replace(split, rank=r)).of(slots)  # type: ignore[arg-type]
             for r, pool in enumerate(rank_pools(whole, split))]
    assert torch.equal(torch.stack([parts[r] for r in split.counted]).sum(0), want)
    assert len(split.counted) == min(tp, kv_heads)  # each head counted once
    for r in range(tp):  # a copy's partial is its owner's
        assert torch.equal(parts[r], parts[split.owner(r)])


class LocalFollowers:
    """Rank 0's line to followers in this process: each call answered by `serve`."""

    def __init__(self, canaries: list[RankCanary]) -> None:
        self.canaries = canaries  # ranks 1..

    @property
    def followers(self) -> range:
        return range(1, 1 + len(self.canaries))

    def call(self, rank: int, op: str, *args: Any) -> Future[Any]:
        future: Future[Any] = Future()
        future.set_result(serve(self.canaries[rank - 1], op, args))
        return future


def server(whole: KVPool, tp: int, config: CanaryConfig = CONFIG) -> tuple[
        list[KVPool], list[CanaryGuard], HandoffCanary]:
    """A server of `tp` ranks holding `whole`'s bytes, its guards and rank 0's HandoffCanary."""
    split = split_of(whole.num_kv_heads, tp)
    pools, guards = rank_pools(whole, split), []
    for r, pool in enumerate(pools):
        table = torch.zeros((2, 64), dtype=torch.int64)
        guard = build_guard(config, table, pool, pool.num_slots, 1000, oracle=False,
                            split=replace(split, rank=r))
        assert guard is not None
        guards.append(guard)
    followers = LocalFollowers([RankCanary(g) for g in guards[1:]]) if tp > 1 else None
    return pools, guards, HandoffCanary(guards[0], CanaryMonitor(config, 64), PS, followers)


PROMPT, SRC, DST = list(range(100, 110)), [5, 2, 0], [1, 4, 3]


def send(kv_heads: int, tp: int) -> tuple[KVPool, list[int], list[int] | None]:
    """A prefill of `tp` ranks whose pages SRC hold PROMPT's KV, summed as its forwards would."""
    whole = whole_pool(kv_heads)
    _, guards, canary = server(whole, tp)
    slots = slots_of(SRC, len(PROMPT), PS)
    for guard in guards:
        st = guard.tags
        st.tags[slots] = ReqChain().cover(PROMPT, [])
        assert st.sums is not None and st.slot_sums is not None
        st.slot_sums[slots] = st.sums.of(slots)
    tags, sums, undo = canary.outgoing("r", SRC, len(PROMPT))
    assert undo is None
    return whole, tags, sums


PAIRS = [(2, 1), (1, 2), (3, 1), (1, 3), (4, 2), (2, 4), (2, 2)]  # (prefill tp, decode tp)


@pytest.mark.parametrize(("p_tp", "d_tp"), PAIRS, ids=[f"p{p}-d{d}" for p, d in PAIRS])
def test_what_a_prefill_sends_checks_out_on_a_decode_of_any_tp(p_tp: int, d_tp: int) -> None:
    kv_heads = 3 if 3 in (p_tp, d_tp) else 2
    src, tags, sums = send(kv_heads, p_tp)
    whole = whole_pool(kv_heads, seed=1)
    whole.buffer[DST] = src.buffer[SRC]  # the transfer, every head of every page
    _, guards, canary = server(whole, d_tp)
    assert canary.arrival_problem("r", PROMPT, DST, tags, sums) is None
    slots = slots_of(DST, len(PROMPT), PS)
    for guard in guards:  # every rank adopted the tags and its own partial sums
        st = guard.tags
        assert st.sums is not None and st.slot_sums is not None
        assert st.tags[slots].tolist() == tags
        assert torch.equal(st.slot_sums[slots], st.sums.of(slots))


STRUCK = [(1, 0), (2, 0), (2, 1), (4, 0), (4, 1), (4, 3)]  # (decode tp, the rank struck)


@pytest.mark.parametrize(("d_tp", "rank"), STRUCK, ids=[f"d{d}-rank{r}" for d, r in STRUCK])
def test_a_byte_changed_on_any_decode_rank_is_caught(d_tp: int, rank: int) -> None:
    """2 KV heads: over 4 decode ranks rank 1 holds a copy of rank 0's head, rank 3 of rank 2's."""
    src, tags, sums = send(2, 2)
    whole = whole_pool(2, seed=1)
    whole.buffer[DST] = src.buffer[SRC]
    pools, _, canary = server(whole, d_tp)
    pools[rank].buffer[DST[2], 1, 0, 1, 0, 2].neg_()  # position 9's K in layer 1
    problem = canary.arrival_problem("r", PROMPT, DST, tags, sums)
    assert problem is not None and "bytes changed in transfer" in problem, problem
    assert canary.monitor.stats.violations == {"bytes": 1}


def test_kv_before_send_strikes_the_sending_ranks_in_turn_and_undoes() -> None:
    """P tp=4 over 2 KV heads: ranks 0 and 2 send, so the strikes land on 2, 0, 2, ..."""
    config = replace(CONFIG, perturb="kv_before_send=1.0")
    whole = whole_pool(2)
    pools, guards, canary = server(whole, 4, config)
    slots = slots_of(SRC, len(PROMPT), PS)
    for guard in guards:
        assert guard.tags.sums is not None and guard.tags.slot_sums is not None
        guard.tags.slot_sums[slots] = guard.tags.sums.of(slots)
    before = [p.buffer.clone() for p in pools]
    for struck in (2, 0, 2):
        _, _, undo = canary.outgoing("r", SRC, len(PROMPT))
        changed = [r for r in range(4) if not torch.equal(pools[r].buffer, before[r])]
        assert changed == [struck]
        assert undo is not None
        undo()
        assert all(torch.equal(p.buffer, b) for p, b in zip(pools, before, strict=True))
