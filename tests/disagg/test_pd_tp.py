"""PD with tensor parallelism on either side, and different TP on each (runtime/disagg/shares.py,
ranks_plane.py): real `baton serve` processes with their follower ranks, over tcp with the
cluster key on, give HF transformers' greedy tokens and logprobs, streamed and not, on the
sharp tiny Llama (4 heads, 2 KV heads: over 4 ranks each KV head is copied on 2). Each prefill
rank writes its KV heads into the decode ranks that hold them, on links of its own; the decode
takes the room only once every rank's share has landed. Every page is freed on every side
after, and a server's followers leave with it."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.disagg.pd import Pair, pd_call, start_pair
from tests.engine.hf_reference import PROMPTS, Reference, compare, hf_greedy
from tests.server.test_metrics import metric
from tests.server.test_tp_serve import ends, followers
from tests.up_process import Up

pytestmark = pytest.mark.timeout(300)
MAX_NEW = 12
# (prefill tp, decode tp): each page split in two by one prefill rank; two KV heads copied over
# 4 prefill ranks, of which ranks 0 and 2 send, rank to rank (equal TP is that case's simplest
# form). Both halves of each decode page from two prefill ranks: through `baton up`, below.
COMBOS = [(1, 2), (4, 2)]


@pytest.fixture(scope="module")
def refs(sharp_tiny_path: Path) -> tuple[list[list[int]], list[Reference]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(sharp_tiny_path)
    ids = [tok.encode(p) for p in PROMPTS[:4]]
    return ids, [r.head(MAX_NEW) for r in hf_greedy(sharp_tiny_path, ids, MAX_NEW)]


@pytest.fixture(scope="module", params=COMBOS, ids=[f"p{p}-d{d}" for p, d in COMBOS])
def pair(request: pytest.FixtureRequest, sharp_tiny_path: Path,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    p_tp, d_tp = request.param
    p = start_pair(tmp_path_factory.mktemp(f"pd-tp-{p_tp}-{d_tp}"), "tcp",
                   "--kv-canary", "raise", model=str(sharp_tiny_path),
                   prefill_extra=("--tp", str(p_tp)), decode_extra=("--tp", str(d_tp)))
    yield p
    p.stop()


def _body(ids: list[int], pair: Pair, stream: bool, max_new: int = MAX_NEW) -> dict[str, Any]:
    return {"input_ids": ids, "stream": stream, "return_logprob": True,
            **pair.fields(prompt={"input_ids": ids}),
            "sampling_params": {"temperature": 0, "max_new_tokens": max_new}}


def test_pd_over_ranks_equals_hf(pair: Pair, refs: tuple[list[list[int]], list[Reference]]) -> None:
    assert_pd_equals_hf(pair, *refs)


def assert_pd_equals_hf(pair: Pair, ids: list[list[int]], want: list[Reference],
                        near_ties: bool = False) -> None:
    """The prompts at once through the pair give HF's tokens and logprobs (`near_ties`: a
    divergence at a genuine near-tie is allowed, on a model whose logits are not sharp), every
    page is freed on both sides after (rank 0's allocator holds every rank's pages), and the
    canary's tags were checked on arrival, all clean."""
    async def run() -> list[tuple[httpx.Response, Any]]:
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(*[pd_call(http, pair, "/generate",
                                                  _body(x, pair, False, len(ref.ids)))
                                          for x, ref in zip(ids, want, strict=True)])

    for (prefill, decoded), ref in zip(asyncio.run(run()), want, strict=True):
        assert prefill.status_code == 200, prefill.text
        assert isinstance(decoded, dict), decoded.text
        logprobs = [lp for lp, _ in decoded["meta_info"]["output_token_logprobs"]]
        note = compare(decoded["output_ids"], ref, logprobs)
        assert near_ties or note is None, note  # the sharp model has margins: no near-tie
    for srv in (pair.prefill, pair.decode):
        stats = httpx.get(f"{srv.url}/debug/stats").json()
        assert stats["kv_all_free"], f"{srv.url} holds KV after all requests finished: {stats}"
    for srv in (pair.prefill, pair.decode):
        text = httpx.get(f"{srv.url}/metrics").text
        assert metric(text, "baton_kv_canary_checks_total") > 0, srv.url
        assert "baton_kv_canary_violations_total{" not in text, srv.url


def test_a_dead_decode_rank_ends_its_server_and_the_prefill_frees_the_room(
        sharp_tiny_path: Path, tmp_path: Path, refs: tuple[list[list[int]], list[Reference]]) -> None:
    """A decode follower SIGKILLed: the decode server and its ranks are gone in bounded time;
    the prefill's room, which no decode asks for now, fails within its bootstrap timeout, its
    pages are freed, and the prefill serves on."""
    pair = start_pair(tmp_path, "tcp", model=str(sharp_tiny_path),
                      prefill_extra=("--bootstrap-timeout-s", "3"), decode_extra=("--tp", "2"))
    try:
        ranks, sched = followers(pair.decode), pair.decode.scheduler_pid()
        assert len(ranks) == 1
        ids = refs[0][0]
        fields = pair.fields(prompt={"input_ids": ids})  # the ticket names the decode, alive
        os.kill(ranks[0], signal.SIGKILL)
        assert ends(pair.decode, [sched, *ranks]) != 0
        resp = httpx.post(f"{pair.prefill.url}/generate", timeout=60, json={
            "input_ids": ids, **fields,
            "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW}})
        assert "no decode server asked for room" in resp.text, resp.text
        stats = httpx.get(f"{pair.prefill.url}/debug/stats").json()
        assert stats["kv_all_free"], stats
        assert httpx.get(f"{pair.prefill.url}/health").status_code == 200
    finally:
        pair.stop()


def test_baton_up_pairs_a_two_rank_prefill_with_a_one_rank_decode(
        sharp_tiny_path: Path, tmp_path: Path, refs: tuple[list[list[int]], list[Reference]]) -> None:
    """`baton up --prefill-tp 2 --decode-tp 1`: the router pairs the two (any TP pairs with any),
    /debug/pairs shows each side's TP, and /generate through it gives HF's tokens and
    logprobs: both halves of each decode page come from the two prefill ranks."""
    up = Up(sharp_tiny_path, tmp_path, "--prefill-tp", "2", "--decode-tp", "1",
            "--kv-transfer", "tcp", "--", "--kv-canary", "raise")
    try:
        up.wait_up()
        ids, want = refs
        for x, ref in zip(ids, want, strict=True):
            out = httpx.post(f"{up.url}/generate", timeout=60, json={
                "input_ids": x, "return_logprob": True,
                "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW}}).json()
            logprobs = [lp for lp, _ in out["meta_info"]["output_token_logprobs"]]
            assert compare(out["output_ids"], ref, logprobs) is None
        (pair,) = httpx.get(f"{up.url}/debug/pairs").json()["pairs"]
        assert (pair["prefill_tp"], pair["decode_tp"], pair["succeeded"]) == (2, 1, len(ids))
    finally:
        up.close()
