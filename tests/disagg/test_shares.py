"""KV across different TP on the two sides, without processes: which prefill rank writes which
heads where (runtime/disagg/shares.py), the fence of a rank that several prefill ranks write
(runtime/disagg/fence.py), and decode rank 0's fence over its followers' reports
(runtime/disagg/ranks_plane.py LeaderFence, against fake ranks). Over real processes and links:
test_pd_tp.py."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import asdict
from typing import Any

import numpy as np
import pytest
import torch

from runtime.disagg.fence import WriteFence
from runtime.disagg.ranks_plane import LeaderFence, close_links_everywhere
from runtime.disagg.shares import Share, Split, head_rows, head_slice, plan, sources, whole
from runtime.disagg.transfer.base import TransferError
from runtime.disagg.wire import AuxRecord, KVLayout, PagesFrame, PeerRegistration
from runtime.model_config import ModelConfig
from runtime.models.parallel import TensorParallel

P = "baton-prefill-P"


def test_ranks_hold_the_heads_the_model_split_gives_them() -> None:
    for kv in (1, 2, 3, 4, 8):
        config = ModelConfig.from_hf_dict({
            "vocab_size": 100, "hidden_size": 8 * 16, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 8, "num_key_value_heads": kv})
        for tp in (1, 2, 4, 8):
            if (kv % tp and tp % kv) or 8 % tp:
                continue
            assert [Split(tp, kv).held(r) for r in range(tp)] == \
                [TensorParallel(r, tp).kv_heads(config) for r in range(tp)], (kv, tp)


@pytest.mark.parametrize(("kv", "p", "d"), [(2, 1, 1), (2, 2, 1), (2, 1, 2), (2, 2, 2), (2, 4, 2),
                                            (2, 1, 4), (8, 2, 4), (8, 4, 2), (3, 3, 1), (2, 4, 4)])
def test_every_head_of_every_decode_rank_is_written_once_by_a_rank_that_holds_it(
        kv: int, p: int, d: int) -> None:
    src, dst = Split(p, kv), Split(d, kv)
    shares = plan(src, dst)
    for rank in range(d):
        lo, hi = dst.held(rank)
        written = [h for s in shares if s.dst == rank for h in range(s.lo, s.hi)]
        assert sorted(written) == list(range(lo, hi)), (rank, shares)
    for s in shares:
        held = src.held(s.src)
        assert held[0] <= s.lo < s.hi <= held[1]
    assert 0 in sources(shares, 0)  # rank 0's share rides the link its RoomDone follows


def test_the_named_cases() -> None:
    assert plan(Split(2, 2), Split(1, 2)) == [Share(0, 0, 0, 1), Share(1, 0, 1, 2)]  # halves
    assert plan(Split(1, 2), Split(2, 2)) == [Share(0, 0, 0, 1), Share(0, 1, 1, 2)]  # split
    # 2 KV heads over 4 prefill ranks (each copied twice): only ranks 0 and 2 send
    assert plan(Split(4, 2), Split(2, 2)) == [Share(0, 0, 0, 1), Share(2, 1, 1, 2)]
    assert plan(Split(1, 2), Split(4, 2)) == [Share(0, r, r // 2, r // 2 + 1) for r in range(4)]
    with pytest.raises(ValueError, match="2 KV heads on one side, 4 on the other"):
        plan(Split(1, 2), Split(1, 4))


def test_a_head_slice_is_the_shares_heads_of_a_ranks_pages() -> None:
    pages = torch.arange(2 * 3 * 2 * 4 * 2 * 5).view(2, 3, 2, 4, 2, 5)  # a rank holding heads 2, 3
    assert torch.equal(head_slice(pages, (2, 4), Share(0, 0, 3, 4)), pages[..., 1:2, :])


def test_the_wire_names_the_split() -> None:
    layout = KVLayout(2, 16, 2, 64, "float32", tp_size=2)
    assert layout.mismatch(KVLayout(2, 16, 2, 64, "float32")) is None  # any TP pairs
    assert "num_kv_heads 2 vs 4" in str(layout.mismatch(KVLayout(2, 16, 4, 64, "float32")))
    assert "tp_size" not in layout.pairing()
    assert layout.page_bytes == 2 * layout.head_bytes == 2 * 2 * 2 * 16 * 64 * 4
    reg = dict(decode_id="d", receiver_host="h", receiver_port=1, layout=asdict(layout),
               backend="tcp")
    with pytest.raises(ValueError, match="0 receivers for 2 ranks"):
        PeerRegistration(**reg)
    assert PeerRegistration(**reg, ranks=[["h", 2]]).receiver(1) == ("h", 2)
    with pytest.raises(ValueError, match="share"):
        PagesFrame(1, [0], 8, [0, 2, 2])  # an empty head range


def aux(room: int) -> AuxRecord:
    return AuxRecord(room, f"r{room}", 3, 42)


def test_a_room_written_by_two_prefill_ranks_arrives_once_both_landed() -> None:
    woken: list[int] = []
    fence = WriteFence(lambda: woken.append(1))
    fence.expect(1, [3, 4], P)
    assert fence.bind_peer(1, P, plan(Split(2, 2), Split(1, 2)))
    assert not fence.admit(1, [3, 4], P, source=2)  # not a rank that writes here
    assert fence.admit(1, [3, 4], P, 0) and fence.admit(1, [3, 4], P, 1)  # on two links at once
    assert not fence.admit(1, [3, 4], P, 1)  # one write per rank at a time
    fence.landed(1, True, 0)
    assert fence.arrive(aux(1), P, written=True)  # rank 0's share came first on its link
    assert fence.arrived(1) is None and not woken  # rank 1's is still landing: the record waits
    fence.landed(1, True, 1)
    assert fence.arrived(1) == aux(1) and woken == [1]


def test_a_roomdone_without_rank_0s_share_or_with_a_broken_share_never_arrives() -> None:
    fence = WriteFence()
    fence.expect(1, [3], P)
    fence.bind_peer(1, P, plan(Split(2, 2), Split(1, 2)))
    assert not fence.arrive(aux(1), P, written=True)  # rank 0's share did not land first
    assert fence.admit(1, [3], P, 0) and fence.admit(1, [3], P, 1)
    fence.landed(1, True, 0)
    assert fence.arrive(aux(1), P, written=True)
    fence.landed(1, False, 1)  # broken off: the room waits (and times out) rather than arrive
    assert fence.arrived(1) is None


def test_a_one_sided_roomdone_waits_for_every_shares_notification() -> None:
    """nixl: the RoomDone comes once every rank's WRITE is over, but maybe before the shares'
    notifications; a revoked room's is the proof its writes are over."""
    woken: list[int] = []
    fence = WriteFence(lambda: woken.append(1))
    fence.expect(1, [3], P)
    fence.bind_peer(1, P, plan(Split(2, 2), Split(1, 2)))
    assert fence.arrive(aux(1), P) and fence.arrived(1) is None  # no share has landed yet
    for src in (1, 0):
        assert fence.admit(1, [3], P, src)
        fence.landed(1, True, src)
    assert fence.arrived(1) == aux(1) and woken == [1]
    fence.expect(2, [4], P)
    fence.bind_peer(2, P, plan(Split(2, 2), Split(1, 2)))
    fence.revoke(2)
    assert fence.arrive(aux(2), P) and fence.arrived(2) == aux(2)
    fence.expect(3, [5], P)  # one rank each side: the record is the WRITE's own notification
    fence.bind_peer(3, P)
    assert fence.arrive(aux(3), P) and fence.arrived(3) == aux(3)


class FakeRanks:
    """Followers that answer at once, recording each call."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.log: list[tuple[int, str, tuple[Any, ...]]] = []
        self.answers: dict[str, Any] = {"expect": None, "revoke": True, "discard": None,
                                        "close_links": None}
        self.on_event: Any = None

    @property
    def followers(self) -> range:
        return range(1, self.size)

    def call(self, rank: int, op: str, *args: Any) -> Future[Any]:
        self.log.append((rank, op, args))
        future: Future[Any] = Future()
        answer = self.answers[op]
        if isinstance(answer, Exception):
            future.set_exception(answer)
        else:
            future.set_result(answer)
        return future


def test_decode_rank_0_takes_a_room_once_every_rank_reported_its_shares() -> None:
    woken: list[int] = []
    ranks = FakeRanks(2)
    fence = LeaderFence(lambda: woken.append(1), ranks)
    fence.expect(7, [5, 6], P)
    shares = plan(Split(1, 2), Split(2, 2))
    assert fence.bind_peer(7, P, shares)
    assert ranks.log == [(1, "expect", (7, [5, 6], P, shares))]  # before the prefill knows them
    assert fence.admit(7, [5, 6], P, 0)
    fence.landed(7, True, 0)
    assert fence.arrive(aux(7), P, written=True) and fence.arrived(7) is None
    ranks.on_event(1, "written", (7,))
    assert fence.arrived(7) == aux(7) and woken == [1]
    fence.discard(7)
    assert ranks.log[-1] == (1, "discard", (7,))


def test_a_revoked_room_is_closed_only_when_every_rank_says_nothing_lands() -> None:
    woken: list[int] = []
    ranks = FakeRanks(3)
    ranks.answers["revoke"] = False  # rank 1 and 2: a share is landing there
    fence = LeaderFence(lambda: woken.append(1), ranks)
    fence.expect(7, [5], P)
    fence.bind_peer(7, P, plan(Split(1, 3), Split(3, 3)))
    assert fence.revoke(7) is False
    assert [c[1] for c in ranks.log].count("revoke") == 2
    assert fence.revoke(7) is False and [c[1] for c in ranks.log].count("revoke") == 2  # once
    ranks.on_event(1, "closed", (7,))
    assert fence.revoke(7) is False and not woken
    ranks.on_event(2, "closed", (7,))
    assert woken == [1] and fence.revoke(7) is True


def test_a_follower_that_cannot_take_the_room_fails_the_binding_by_name() -> None:
    ranks = FakeRanks(2)
    ranks.answers["expect"] = RuntimeError("TP rank 1: boom")
    fence = LeaderFence(lambda: None, ranks)
    fence.expect(7, [5], P)
    with pytest.raises(TransferError, match="TP rank 1 could not take room 7"):
        fence.bind_peer(7, P, plan(Split(1, 2), Split(2, 2)))


def test_a_prefill_declared_gone_loses_its_links_to_every_decode_rank() -> None:
    ranks = FakeRanks(3)
    close_links_everywhere(ranks)(P)
    assert ranks.log == [(1, "close_links", (P,)), (2, "close_links", (P,))]


def test_head_rows_are_each_page_layer_kv_and_token_row_of_the_shares_heads() -> None:
    """nixl's descriptors for a head range (runtime/disagg/transfer/nixl.py), against a hand
    computation and against the pool's own view of those heads."""
    layout = KVLayout(2, 2, 4, 3, "float32", tp_size=2)  # 2 layers, 2-token pages, head_dim 3
    held, share = (2, 4), Share(1, 0, 3, 4)  # a rank holding heads 2 and 3 sends head 3
    offsets, size = head_rows(np.array([5, 1]), held, share, layout)
    row, page = 2 * 3 * 4, 2 * 2 * 2 * (2 * 3 * 4)  # bytes of a row of both heads; of a page
    assert size == 3 * 4  # one head's head_dim floats
    assert offsets.tolist() == [p * page + i * row + 3 * 4 for p in (5, 1) for i in range(8)]
    pool = torch.arange(6 * 2 * 2 * 2 * 2 * 3, dtype=torch.float32).view(6, 2, 2, 2, 2, 3)
    raw = pool.view(-1).view(torch.uint8).numpy()
    rows = np.stack([raw[o:o + size].view(np.float32) for o in offsets])
    assert np.array_equal(rows, head_slice(pool[[5, 1]], held, share).reshape(-1, 3).numpy())
    # every head a rank holds: rows back to back, a page each (nixl then sends page runs)
    full, size = head_rows(np.array([4]), (0, 2), Share(0, 0, 0, 2), layout)
    assert np.array_equal(full, 4 * page + np.arange(8) * size) and 8 * size == page
    assert whole(Share(0, 0, 0, 2), (0, 2), (0, 2)) and not whole(share, held, (3, 4))


def test_a_follower_s_write_in_doubt_is_told_by_its_kind_not_its_message() -> None:
    """A follower's failed call comes back as a RankCallError naming the exception's type: the
    sender holds a room in doubt only for a WriteInDoubt there (or no answer in time)."""
    from runtime.disagg.sender import _in_doubt
    from runtime.scheduler.ranks import RankCallError

    doubt = RankCallError(1, "WriteInDoubt", "nixl WRITE for room 7 not done in 60.0 s")
    assert _in_doubt(doubt) and str(doubt) == (
        "TP rank 1: WriteInDoubt: nixl WRITE for room 7 not done in 60.0 s")
    assert _in_doubt(TimeoutError())
    assert not _in_doubt(RankCallError(2, "TransferError", "peer said: WriteInDoubt: no"))
    assert not _in_doubt(RuntimeError("TP rank 1 is gone"))
