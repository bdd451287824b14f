"""The KV canary in `baton serve` (a real server on loopback, the tiny Llama, the token oracle
sampler so every request's tokens are known from its rid): every fault kind the runner injects,
mixed, under `raise` — each hit request's answer is the canary's error, every other one is its
oracle sequence, injected == caught in /metrics, the server keeps serving and its KV comes back.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from runtime.canary.identity import rid_to_int64
from runtime.canary.oracle import oracle_sequence
from tests.server.server_process import ServerProcess, start_server
from tests.server.test_concurrency import _wait_idle
from tests.server.test_metrics import metric

KINDS = ("kv_after_forward", "req_to_token", "wrong_slots", "next_token_swap")
MAX_NEW = 16


@pytest.fixture(scope="module")
def perturbed(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = start_server(
        "--served-model-name", "tiny", "--sampler-backend", "token_oracle", "--page-size", "4",
        "--max-running-requests", "16", "--kv-canary", "raise", "--kv-canary-bytes", "all",
        "--perturb", ",".join(f"{k}=0.015" for k in KINDS), "--perturb-seed", "5",
        model=str(tiny_path), log_path=tmp_path_factory.mktemp("canary") / "server.log")
    yield srv
    assert srv.stop() == 0, srv.log()


def injections(text: str) -> dict[str, float]:
    found = re.findall(r'^baton_perturb_injections_total\{kind="(\w+)"\} (\S+)$', text, re.M)
    return {kind: float(n) for kind, n in found}


def generate(client: httpx.Client, rid: str, prompt: list[int]) -> dict[str, Any]:
    body = {"rid": rid, "input_ids": prompt,
            "sampling_params": {"max_new_tokens": MAX_NEW, "ignore_eos": True}}
    resp = client.post("/generate", json=body)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def test_every_fault_is_caught_and_the_rest_is_exact(perturbed: ServerProcess, tiny_path: Path) -> None:
    rng = random.Random(9)
    prompts = {f"req-{i}": [rng.randrange(100, 40000) for _ in range(rng.randrange(3, 40))]
               for i in range(96)}
    vocab = json.loads((tiny_path / "config.json").read_text())["vocab_size"]
    with httpx.Client(base_url=perturbed.url, timeout=120) as client, ThreadPoolExecutor(16) as pool:
        results = dict(zip(prompts, pool.map(lambda rid: generate(client, rid, prompts[rid]),
                                             prompts), strict=True))
        _wait_idle(client)
        text = client.get("/metrics").text
        hit = {rid for rid, r in results.items() if r["meta_info"]["finish_reason"]["type"] == "abort"}
        for rid, r in results.items():
            reason = r["meta_info"]["finish_reason"]
            if rid in hit:
                assert reason["message"].startswith("KV canary:"), reason
            else:
                want = oracle_sequence(rid_to_int64(rid), len(prompts[rid]), MAX_NEW, vocab)
                assert r["output_ids"] == want and reason["type"] == "length", rid
        injected = injections(text)
        assert sum(injected.values()) == len(hit) >= 20, (injected, len(hit))
        assert set(injected) == set(KINDS), injected
        assert metric(text, "baton_kv_canary_checks_total") > len(prompts) * MAX_NEW / 2
        assert metric(text, "baton_kv_canary_violations_total", '{kind="tag"}') > 0
        assert metric(text, "baton_kv_canary_violations_total", '{kind="bytes"}') > 0
        assert metric(text, "baton_kv_canary_violations_total", '{kind="token"}') > 0
        # still serving, and nothing left held
        after = generate(client, "after", prompts["req-0"])
        assert after["meta_info"]["finish_reason"]["type"] in ("length", "abort")
        stats = _wait_idle(client)
        assert stats["kv_all_free"]
