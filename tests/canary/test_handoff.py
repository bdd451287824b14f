"""The canary's PD handoff without servers: what a prefill sends checks out on a decode whose
pool holds the same bytes, and a changed byte, other tokens or missing tags are each caught;
the layout refuses to pair a side with the canary with one without; the aux record's lists
must cover the prompt."""

from __future__ import annotations

import pytest
import torch

from runtime.canary.guard import build_guard
from runtime.canary.handoff import HandoffCanary, slots_of
from runtime.canary.monitor import CanaryMonitor
from runtime.config import CanaryConfig
from runtime.disagg.wire import AuxRecord, KVLayout
from runtime.kvcache.pool import KVPool

PS = 4
CONFIG = CanaryConfig(kv_canary="raise", kv_canary_bytes="all")


def side(seed: int) -> tuple[KVPool, HandoffCanary]:
    pool = KVPool(num_layers=2, num_pages=8, page_size=PS, num_kv_heads=2, head_dim=4,
                  dtype=torch.float32)
    torch.manual_seed(seed)
    pool.buffer.normal_()
    table = torch.zeros((2, 64), dtype=torch.int64)
    guard = build_guard(CONFIG, table, pool, pool.num_slots, 1000, oracle=False)
    assert guard is not None
    return pool, HandoffCanary(guard, CanaryMonitor(CONFIG, 64), PS)


def sent(prompt: list[int], pages: list[int]) -> tuple[KVPool, list[int], list[int] | None]:
    """A prefill's pool whose `pages` hold `prompt`'s KV, tagged as its forward would."""
    from runtime.canary.chain import ReqChain

    pool, canary = side(0)
    st = canary.guard.tags
    slots = slots_of(pages, len(prompt), PS)
    st.tags[slots] = ReqChain().cover(prompt, [])
    assert st.sums is not None and st.slot_sums is not None
    st.slot_sums[slots] = st.sums.of(slots)
    tags, sums, undo = canary.outgoing("r", pages, len(prompt))
    assert undo is None  # no perturbation configured
    return pool, tags, sums


def landed(src: KVPool, src_pages: list[int], dst_pages: list[int]) -> tuple[KVPool, HandoffCanary]:
    pool, canary = side(1)
    pool.buffer[dst_pages] = src.buffer[src_pages]  # the transfer: whole pages
    return pool, canary


def test_what_was_sent_checks_out_and_is_adopted() -> None:
    prompt = list(range(100, 110))
    src, tags, sums = sent(prompt, [5, 2, 7])
    _, canary = landed(src, [5, 2, 7], [0, 3, 4])
    assert canary.arrival_problem("r", prompt, [0, 3, 4], tags, sums) is None
    st = canary.guard.tags
    assert st.tags[slots_of([0, 3, 4], 10, PS)].tolist() == tags
    assert canary.monitor.stats.violations == {}


@pytest.mark.parametrize("fault", ["byte", "tokens", "no_tags", "wrong_pages"])
def test_each_fault_is_caught_on_arrival(fault: str) -> None:
    prompt = list(range(100, 110))
    src, tags, sums = sent(prompt, [5, 2, 7])
    dst, canary = landed(src, [5, 2, 7], [0, 3, 4])
    pages = [0, 3, 4]
    if fault == "byte":
        dst.buffer[3, 1, 0, 2, 1, 3].neg_()
    elif fault == "tokens":
        prompt = [*prompt[:4], 1, *prompt[5:]]
    elif fault == "no_tags":
        tags = None  # type: ignore[assignment]
    else:
        pages = [0, 4, 3]
    problem = canary.arrival_problem("r", prompt, pages, tags, sums)
    assert problem is not None and problem.startswith("KV canary:"), problem
    assert sum(canary.monitor.stats.violations.values()) == 1


def test_the_layout_says_whether_the_canary_travels() -> None:
    plain = KVLayout(2, PS, 2, 4, "float32")
    tagged = KVLayout(2, PS, 2, 4, "float32", canary_tags=True, canary_bytes="all")
    assert plain.mismatch(tagged) is not None and tagged.mismatch(tagged) is None
    with pytest.raises(ValueError):
        KVLayout(2, PS, 2, 4, "float32", canary_bytes="some")
    with pytest.raises(ValueError):
        AuxRecord(room=1, rid="r", prompt_len=3, token=5, slot_tags=[1, 2])
    assert AuxRecord(room=1, rid="r", prompt_len=2, token=5, slot_tags=[1, 2], slot_sums=[3, 4])
