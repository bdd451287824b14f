"""Req.split_off: a draining decode's request goes on elsewhere holding this one's KV."""

from __future__ import annotations

from runtime.handover import KVOffer
from runtime.sampling_params import SamplingParams
from runtime.scheduler.req import Req


def test_split_off_moves_the_kv_and_the_newest_token() -> None:
    req = Req("a", [1, 2, 3], SamplingParams(max_new_tokens=8, seed=5), return_logprob=True,
              top_logprobs_num=1, cache_salt="t", resumed_outputs=1)
    for token in (10, 11, 12):
        req.append_token(token, -0.5 * token, [(token, -0.1)], {"k": token})
    req.kv.row, req.kv.pages, req.kv.length, req.kv.computed = 3, [7, 8], 5, 5
    req.cached_tokens, req.kv.node = 2, "node"
    pages = req.kv.pages

    offer = KVOffer("127.0.0.1", 9000, 99, "decode-a")
    moved = req.split_off("b", 99, offer)

    assert (moved.rid, moved.bootstrap_room, moved.hand_off) == ("b", 99, True)
    assert moved.origin_input_ids == [1, 2, 3, 10, 11] and moved.output_ids == [12]
    assert moved.log.logprobs == [-6.0] and moved.log.top_logprobs == [[(12, -0.1)]]
    assert moved.log.info == {"k": [12]}
    assert moved.resumed_outputs == 3 and moved.seed == 5 and moved.cache_salt == "t"
    assert (moved.kv.row, moved.kv.pages, moved.kv.length, moved.kv.computed) == (3, pages, 5, 5)
    assert moved.cached_tokens == 2 and moved.kv.node == "node"
    # this one keeps what its client has, holds no KV, and says where the rest went
    assert req.output_ids == [10, 11] and req.log.logprobs == [-5.0, -5.5]
    assert req.log.info == {"k": [10, 11]}
    assert (req.kv.row, req.kv.pages, req.kv.length, req.kv.computed) == (None, [], 0, 0)
    assert req.kv.node is None
    assert req.finished_reason is not None
    assert (req.finished_reason.kind, req.finished_reason.offer) == ("moved", offer)
