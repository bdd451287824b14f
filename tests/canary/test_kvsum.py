"""Byte checksums of KV slots (`--kv-canary-bytes`), what each mode reads and so guarantees:
`all` catches a changed element in any layer, `partial` in the first or the last layer only (a
change in a layer between goes unseen, by design: that is what makes it cheaper). On a model of
one or two layers the first and last are every layer, and `partial` is `all`. The same holds on
arrival of a PD transfer (HandoffCanary)."""

from __future__ import annotations

import pytest
import torch

from runtime.canary.chain import ReqChain
from runtime.canary.guard import build_guard
from runtime.canary.handoff import HandoffCanary, slots_of
from runtime.canary.kvsum import SlotSums
from runtime.canary.monitor import CanaryMonitor
from runtime.config import CanaryConfig
from runtime.kvcache.pool import KVPool

PS = 4
LAYERS = 4


def pool_of(num_layers: int, dtype: torch.dtype = torch.float32) -> KVPool:
    pool = KVPool(num_layers=num_layers, num_pages=6, page_size=PS, num_kv_heads=2, head_dim=4,
                  dtype=dtype)
    torch.manual_seed(0)
    pool.buffer.copy_(torch.randn(pool.buffer.shape))
    return pool


def flip(pool: KVPool, slot: int, layer: int, kv: int, head: int = 1, dim: int = 2) -> None:
    """Negate one element of `slot`'s K (kv 0) or V (kv 1) in `layer`."""
    pool.buffer[slot // PS, layer, kv, slot % PS, head, dim].neg_()


def test_partial_reads_the_first_and_last_layers_and_all_reads_every_one() -> None:
    pool = pool_of(LAYERS)
    assert SlotSums(pool, "partial").layers == [0, LAYERS - 1]
    assert SlotSums(pool, "all").layers == list(range(LAYERS))
    assert SlotSums(pool_of(2), "partial").layers == [0, 1]  # the tiny Llama's: every layer
    assert SlotSums(pool_of(1), "partial").layers == [0]
    with pytest.raises(ValueError):
        SlotSums(pool, "none")


@pytest.mark.parametrize("layer", range(LAYERS))
@pytest.mark.parametrize("kv", [0, 1], ids=["K", "V"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_changed_element_is_caught_where_the_mode_reads(layer: int, kv: int,
                                                            dtype: torch.dtype) -> None:
    pool = pool_of(LAYERS, dtype)
    partial, every = SlotSums(pool, "partial"), SlotSums(pool, "all")
    slots = torch.arange(pool.num_slots)
    before = {"partial": partial.of(slots), "all": every.of(slots)}
    flip(pool, 9, layer, kv)
    after = {"partial": partial.of(slots), "all": every.of(slots)}
    for mode in ("partial", "all"):
        changed = (after[mode] != before[mode]).nonzero().flatten().tolist()
        read = mode == "all" or layer in (0, LAYERS - 1)
        assert changed == ([9] if read else []), (mode, layer)  # that slot's sum, no other


def test_moving_bits_between_elements_of_a_slot_is_caught() -> None:
    pool = pool_of(2)
    sums = SlotSums(pool, "partial")
    slot = torch.tensor([5])
    before = sums.of(slot)
    k = pool.buffer[1, 0, 0, 1]  # slot 5's K in layer 0: [heads, dim]
    k[0, 0], k[1, 3] = k[1, 3].clone(), k[0, 0].clone()
    assert bool(sums.of(slot) != before)


def handoff(pool: KVPool, mode: str) -> HandoffCanary:
    config = CanaryConfig(kv_canary="raise", kv_canary_bytes=mode)  # type: ignore[arg-type]
    table = torch.zeros((2, 64), dtype=torch.int64)
    guard = build_guard(config, table, pool, pool.num_slots, 1000, oracle=False)
    assert guard is not None
    return HandoffCanary(guard, CanaryMonitor(config, 64), PS)


@pytest.mark.parametrize("layer", range(LAYERS))
@pytest.mark.parametrize("mode", ["partial", "all"])
def test_on_arrival_a_fault_is_caught_where_the_mode_reads(layer: int, mode: str) -> None:
    """What a prefill sends, with one element changed in transfer: `partial` catches it in the
    first or last layer only."""
    prompt, pages = list(range(100, 110)), [4, 1, 3]
    src = pool_of(LAYERS)
    sums = SlotSums(src, mode).of(slots_of(pages, len(prompt), PS)).tolist()  # type: ignore[arg-type]
    tags = ReqChain().cover(prompt, []).tolist()
    dst = pool_of(LAYERS)
    dst.buffer[pages] = src.buffer[pages]
    flip(dst, pages[2] * PS + 1, layer, 1)  # position 9's V
    canary = handoff(dst, mode)
    problem = canary.arrival_problem("r", prompt, pages, tags, sums)
    if mode == "all" or layer in (0, LAYERS - 1):
        assert problem is not None and "bytes changed in transfer" in problem, problem
        assert canary.monitor.stats.violations == {"bytes": 1}
    else:  # unseen by design: the request is adopted as if nothing happened
        assert problem is None
        assert canary.monitor.stats.violations == {}
