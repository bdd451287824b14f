"""Every family beyond Llama, end to end: tiny checkpoints written by HF transformers from the
family's own config class (2 layers, sharp random weights so greedy has margins, the builtin
tokenizer) give HF's greedy tokens and logprobs through the engine, cold and from the prefix
cache, and through PD over tcp (and nixl, for the MoE family) with the KV canary on, its checks
counted and no violation (near-ties reported, not hidden). Logprobs are held to HF's too, up to
any first divergence: on random weights they, more than the tokens, show a wrong attention.
"""

from __future__ import annotations

import asyncio
import json
import warnings
from pathlib import Path

import httpx
import pytest

from runtime import Engine
from tests.disagg.pd import pd_call, start_pair
from tests.engine.hf_reference import MAX_NEW, PROMPTS, Reference, compare, hf_greedy
from tests.models.checkpoints import FAMILIES, write_family
from tests.server.test_metrics import metric


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
