"""Every family beyond Llama, end to end: tiny checkpoints written by HF transformers from the
family's own config class (2 layers, sharp random weights so greedy has margins, the builtin
tokenizer) give HF's greedy tokens and logprobs through the engine, cold and from the prefix
cache, and through PD over tcp (and nixl, for the MoE family) with the KV canary on, its checks
counted and no violation (near-ties reported, not hidden). The MoE family and Gemma 3 also as
`baton up` serves them: router, prefill and decode processes, through the router's OpenAI API. Logprobs are held to HF's too, up to
any first divergence: on random weights they, more than the tokens, show a wrong attention.
"""

from __future__ import annotations

import asyncio
import json
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from runtime import Engine
from tests.disagg.pd import pd_call, start_pair
from tests.engine.hf_reference import MAX_NEW, PROMPTS, Reference, compare, hf_greedy
from tests.models.checkpoints import FAMILIES, write_family
from tests.server.test_metrics import metric
from tests.up_process import Up


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest, model_path: Path,
           tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, list[Reference]]:
    """(name, checkpoint, HF's greedy references for PROMPTS)."""
    name = request.param
    dest = write_family(name, tmp_path_factory.mktemp(name), model_path)
    return name, dest, hf_greedy(dest, _prompts(dest), MAX_NEW)


def _prompts(path: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    return [tok.encode(p) for p in PROMPTS]


def _check(name: str, outs: list[list[int]], logprobs: list[list[float]],
           refs: list[Reference]) -> None:
    notes = [compare(o, r, lp) for o, r, lp in zip(outs, refs, logprobs, strict=True)]
    for note in filter(None, notes):
        warnings.warn(f"{name}: {note}", stacklevel=2)
    assert sum(n is not None for n in notes) <= 1, notes  # near-ties are rare, not routine


def test_engine_equals_hf_cold_and_cached(family: tuple[str, Path, list[Reference]]) -> None:
    name, path, refs = family
    engine = Engine(model=str(path), max_total_tokens=8192)
    try:
        ids = _prompts(path)
        params = {"temperature": 0, "max_new_tokens": MAX_NEW}
        for round_ in ("cold", "cached"):
            results = engine.generate(ids, params, return_logprob=True)
            outs = [r["output_ids"] for r in results]
            lps = [[lp for lp, _ in r["meta_info"]["output_token_logprobs"]] for r in results]
            _check(f"{name} {round_}", outs, lps, refs)
            cached = sum(r["meta_info"]["cached_tokens"] for r in results)
            assert (cached > 0) == (round_ == "cached"), (round_, cached)
        assert engine.runner.kv.is_all_free(), "a page is held after every request ended"
    finally:
        engine.shutdown()


@pytest.mark.parametrize("transport", ["tcp", "nixl"])
def test_pd_equals_hf_with_the_canary_on(family: tuple[str, Path, list[Reference]],
                                         transport: str, tmp_path: Path) -> None:
    name, path, refs = family
    if transport == "nixl" and name != "qwen3-moe":  # (bytes are bytes: one family suffices)
        pytest.skip("nixl runs with one family; tcp with each")
    pair = start_pair(tmp_path, transport, "--kv-canary", "raise", "--kv-canary-bytes", "all",
                      model=str(path))
    try:
        async def run() -> tuple[list[list[int]], list[list[float]]]:
            async with httpx.AsyncClient(timeout=120) as http:
                calls = []
                for i, ids in enumerate(_prompts(path)):
                    body = {"input_ids": ids, "stream": i % 2 == 1, "return_logprob": True,
                            **pair.fields(prompt={"input_ids": ids}),
                            "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW}}
                    calls.append(pd_call(http, pair, "/generate", body))
                outs, logprobs = [], []
                for prefill, decoded in await asyncio.gather(*calls):
                    assert prefill.status_code == 200, prefill.text
                    assert not isinstance(decoded, httpx.Response), decoded.text
                    chunks = decoded if isinstance(decoded, list) else [decoded]  # streamed or not
                    outs.append([t for c in chunks for t in c.get("output_ids", [])])
                    logprobs.append([lp for c in chunks for lp, _ in
                                     c.get("meta_info", {}).get("output_token_logprobs", [])])
                return outs, logprobs

        _check(f"{name} PD {transport}", *asyncio.run(run()), refs)
        arch = json.loads((path / "config.json").read_text())["architectures"][0]
        for srv, role in ((pair.prefill, "prefill"), (pair.decode, "decode")):
            info = httpx.get(f"{srv.url}/server_info").json()
            assert (info["architecture"], info["role"], info["dtype"]) == (arch, role, "float32")
            assert info["kv_capacity_tokens"] > 0 and info["kv_transfer"]["backend"] == transport
            # the canary looked, and found nothing
            text = httpx.get(f"{srv.url}/metrics").text
            assert metric(text, "baton_kv_canary_checks_total") > 0, srv.url
            assert "baton_kv_canary_violations_total{" not in text, srv.url
    finally:
        pair.stop()


# Through the router, as deployed: `baton up` (a router, a prefill and a decode as processes)
# serving the MoE family, and Gemma 3 (a window of 8, shorter than every prompt), over nixl (the
# default of `baton up`), each request through the router's OpenAI API.
ROUTED = ("gemma3", "qwen3-moe")
ROUTED_TRANSPORT = "nixl"
ROUTED_PROMPTS = [PROMPTS[0], PROMPTS[3], PROMPTS[7]]
ROUTED_NEW = 16


@dataclass
class Routed:
    name: str
    path: Path
    up: Up
    prompts: list[list[int]]
    refs: list[Reference]


@pytest.fixture(scope="module", params=ROUTED)
def routed(request: pytest.FixtureRequest, model_path: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Routed]:
    """`baton up` on the family's checkpoint with the KV canary raising on both workers, and
    HF's greedy for ROUTED_PROMPTS (computed while the processes load)."""
    name = request.param
    path = write_family(name, tmp_path_factory.mktemp(f"{name}-ckpt"), model_path)
    up = Up(path, tmp_path_factory.mktemp(f"{name}-up"), "--kv-transfer", ROUTED_TRANSPORT, "--",
            "--kv-canary", "raise", "--kv-canary-bytes", "all", "--max-total-tokens", "4096")
    try:
        prompts = [ids for p, ids in zip(PROMPTS, _prompts(path), strict=True)
                   if p in ROUTED_PROMPTS]
        refs = hf_greedy(path, prompts, ROUTED_NEW)
        up.wait_up()
        yield Routed(name, path, up, prompts, refs)
    finally:
        up.close()


def _completion(http: httpx.Client, url: str, body: dict[str, Any]) -> tuple[list[str], list[float], str]:
    """(token strings, their logprobs, text) of one /v1/completions choice, streamed or not."""
    if not body.get("stream"):
        r = http.post(f"{url}/v1/completions", json=body)
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
    else:
        with http.stream("POST", f"{url}/v1/completions", json=body) as s:
            assert s.status_code == 200, s.read()
            lines = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
        # SSE events, then [DONE]; how many events depends on how fast the client reads: the
        # deltas of steps it has not read yet go out as one event (a loaded machine gives one)
        assert lines[-1] == "data: [DONE]" and len(lines) >= 2, lines
        choices = [c for ln in lines[:-1] for c in json.loads(ln[6:])["choices"]]
    assert choices and all("token_ids" not in c for c in choices)  # the router keeps its own
    assert choices[-1]["finish_reason"] == "length", choices[-1]
    tokens = [t for c in choices if c["logprobs"] for t in c["logprobs"]["tokens"]]
    lps = [lp for c in choices if c["logprobs"] for lp in c["logprobs"]["token_logprobs"]]
    return tokens, lps, "".join(c["text"] for c in choices)


def _ids(tok: Any, tokens: list[str], hf: list[int]) -> list[int]:
    """The ids of the API's `tokens` (it names them by their text): HF's at each step where the
    text is that of HF's token, else the first id of that text (-1: none)."""
    same = [k < len(hf) and t == tok.decode([hf[k]]) for k, t in enumerate(tokens)]
    if all(same):
        return hf[:len(tokens)]
    vocab = {tok.decode([i]): i for i in reversed(range(len(tok)))}  # only on a divergence
    return [hf[k] if ok else vocab.get(t, -1) for k, (t, ok) in enumerate(zip(tokens, same, strict=True))]


def test_baton_up_through_the_router_equals_hf_with_the_canary_on(routed: Routed) -> None:
    """Greedy /v1/completions through the router (the last prompt streamed over SSE) give HF's
    tokens, logprobs and text; each worker names the family's architecture, and its KV canary
    (tags and bytes, raising) checked and found nothing."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(routed.path)
    url = routed.up.url
    with httpx.Client(timeout=120) as http:
        model = http.get(f"{url}/v1/models").json()["data"][0]["id"]
        outs, lps = [], []
        for i, ids in enumerate(routed.prompts):
            stream = i == len(routed.prompts) - 1
            tokens, logprobs, text = _completion(http, url, {
                "model": model, "prompt": ids, "max_tokens": ROUTED_NEW, "temperature": 0,
                "logprobs": 0, "stream": stream})
            ref = routed.refs[i]
            outs.append(_ids(tok, tokens, ref.ids))
            lps.append(logprobs)
            if outs[-1] == ref.ids:
                assert text == tok.decode(ref.ids), (text, tok.decode(ref.ids))
        _check(f"{routed.name} via the router", outs, lps, routed.refs)
    arch = json.loads((routed.path / "config.json").read_text())["architectures"][0]
    workers = re.findall(r"\] (prefill|decode)-\d ready at (http://\S+)", routed.up.text())
    assert sorted(role for role, _ in workers) == ["decode", "prefill"], routed.up.text()
    for role, worker in workers:
        info = httpx.get(f"{worker}/server_info").json()
        assert (info["architecture"], info["role"]) == (arch, role)
        assert info["kv_transfer"]["backend"] == ROUTED_TRANSPORT
        text = httpx.get(f"{worker}/metrics").text
        assert metric(text, "baton_kv_canary_checks_total") > 0, (role, worker)
        assert "baton_kv_canary_violations_total{" not in text, (role, worker)
