"""PD with tensor parallelism on either side, and different TP on each (runtime/disagg/shares.py,
ranks_plane.py): real `baton serve` processes with their follower ranks, over tcp with the
cluster key on, give HF transformers' greedy tokens and logprobs, streamed and not, on the
sharp tiny Llama (4 heads, 2 KV heads: over 4 ranks each KV head is copied on 2). Each prefill
rank writes its KV heads into the decode ranks that hold them, on links of its own; the decode
takes the room only once every rank's share has landed. Every page is freed on every side
after, and a server's followers leave with it.

The KV canary runs throughout with every layer's byte checksums (runtime/canary/ranks.py): the
sums that travel are the ranks' partials added up, checked on arrival over every decode rank's
pages and then kept per rank, all clean; a decode follower's pages corrupted after a forward,
and a prefill follower's just before they are sent, are each caught (injected == caught)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.canary.test_pd_canary import canary_error
from tests.disagg.pd import Pair, pd_call, start_pair
from tests.engine.hf_reference import PROMPTS, Reference, compare, hf_greedy
from tests.server.test_metrics import metric
from tests.server.test_tp_serve import ends, followers
from tests.up_process import Up

pytestmark = pytest.mark.timeout(300)
MAX_NEW = 12
# (prefill tp, decode tp): two KV heads copied over 4 prefill ranks, of which ranks 0 and 2
# send, rank to rank. Both halves of each decode page from two prefill ranks: through `baton
# up`, below; every pair of 1 and 2 ranks, and 3 ranks on the builtin model: test_pd_tp_pairs.py.
COMBOS = [(4, 2)]
CANARY = ("--kv-canary", "raise", "--kv-canary-bytes", "all")


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
    p = start_pair(tmp_path_factory.mktemp(f"pd-tp-{p_tp}-{d_tp}"), "tcp", *CANARY,
                   model=str(sharp_tiny_path), prefill_extra=("--tp", str(p_tp)),
                   # strikes only requests certain to run on (ignore_eos): none of HF's
                   decode_extra=("--tp", str(d_tp), "--perturb", "kv_after_forward=0.15",
                                 "--perturb-seed", "1"))
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
    canary's tags and byte sums were checked, on arrival too, all clean."""
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
    canary_clean(pair.prefill.url, pair.decode.url)


def canary_clean(*urls: str) -> None:
    """The canary's tags and byte sums checked on every rank, all clean."""
    for url in urls:
        text = httpx.get(f"{url}/metrics").text
        assert metric(text, "baton_kv_canary_checks_total") > 0, url
        assert "baton_kv_canary_violations_total{" not in text, url


def test_a_decode_follower_s_corrupted_pages_are_caught(
        pair: Pair, refs: tuple[list[list[int]], list[Reference]]) -> None:
    """kv_after_forward strikes the decode's ranks in turn, rank 1 first: each hit request ends
    with the canary's message, the others give HF's tokens."""
    ids, want = refs
    bodies = [dict(_body(x, pair, False), sampling_params={
        "temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}) for x in ids * 2]

    async def run() -> list[tuple[httpx.Response, Any]]:
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(*[pd_call(http, pair, "/generate", b) for b in bodies])

    caught = 0
    for (prefill, decoded), ref in zip(asyncio.run(run()), want * 2, strict=True):
        assert prefill.status_code == 200, prefill.text
        error = canary_error(decoded)
        if error is not None:
            assert error.startswith("KV canary:"), error
            caught += 1
        else:
            assert compare(decoded["output_ids"][:len(ref.ids)], ref) is None
    text = httpx.get(f"{pair.decode.url}/metrics").text
    injected = metric(text, "baton_perturb_injections_total", '{kind="kv_after_forward"}')
    assert injected == caught >= 2  # rank 1's pages and rank 0's
    assert metric(text, "baton_kv_canary_violations_total", '{kind="bytes"}') == caught


def test_a_follower_receiver_s_refusals_count_on_rank_0(pair: Pair) -> None:
    """A link to decode rank 1's KV receiver that cannot prove the cluster key is refused
    there, and counted in the server's own `baton_kv_plane_events_total{kind="bad_link"}`."""
    found = re.search(r"TP rank 1: KV plane open \(tcp, receiver on port (\d+)\)",
                      pair.decode.log())
    assert found, "decode rank 1's receiver port"
    name = 'baton_kv_plane_events_total'
    before = metric(httpx.get(f"{pair.decode.url}/metrics").text, name, '{kind="bad_link"}')
    with socket.create_connection(("127.0.0.1", int(found.group(1))), timeout=5) as raw:
        raw.recv(40)  # its HELLO; an answer that proves nothing
        raw.sendall(b"\0" * 64)
        raw.settimeout(5)
        with contextlib.suppress(OSError):
            assert raw.recv(1) == b""  # closed by the receiver
    deadline = time.monotonic() + 10
    while metric(httpx.get(f"{pair.decode.url}/metrics").text, name,
                 '{kind="bad_link"}') < before + 1:
        assert time.monotonic() < deadline, "rank 1's refusal never counted on rank 0"
        time.sleep(0.1)


def test_a_prefill_follower_s_pages_corrupted_before_sending_are_caught(
        sharp_tiny_path: Path, tmp_path: Path, refs: tuple[list[list[int]], list[Reference]]) -> None:
    """P tp=2 -> D tp=1: kv_before_send flips an element of the pages about to leave on prefill
    rank 1, then 0, in turn (after their sums were taken); the one-rank decode finds the
    whole-model sums of what landed differ, and ends the request before it runs anything."""
    pair = start_pair(tmp_path, "tcp", *CANARY, model=str(sharp_tiny_path),
                      prefill_extra=("--tp", "2", "--perturb", "kv_before_send=0.5",
                                     "--perturb-seed", "3"))
    try:
        ids, want = refs

        async def run() -> list[tuple[httpx.Response, Any]]:
            async with httpx.AsyncClient(timeout=120) as http:
                return await asyncio.gather(*[pd_call(http, pair, "/generate",
                                                      _body(x, pair, False)) for x in ids * 2])

        caught = 0
        for (prefill, decoded), ref in zip(asyncio.run(run()), want * 2, strict=True):
            assert prefill.status_code == 200, prefill.text
            error = canary_error(decoded)
            if error is not None:
                assert "prompt KV bytes changed in transfer" in error, error
                caught += 1
            else:
                assert compare(decoded["output_ids"], ref) is None
        sent = metric(httpx.get(f"{pair.prefill.url}/metrics").text,
                      "baton_perturb_injections_total", '{kind="kv_before_send"}')
        assert sent == caught >= 2  # rank 1's pages and rank 0's
        text = httpx.get(f"{pair.decode.url}/metrics").text
        assert metric(text, "baton_kv_canary_violations_total", '{kind="bytes"}') == caught
        for srv in (pair.prefill, pair.decode):
            assert httpx.get(f"{srv.url}/debug/stats").json()["kv_all_free"], srv.url
    finally:
        pair.stop()


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
            "--kv-transfer", "tcp", "--", *CANARY)
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
        canary_clean(pair["prefill"], pair["decode"])
    finally:
        up.close()
