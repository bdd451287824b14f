"""Through `baton up --prefill 2 --decode 2` (router + real processes, builtin model, nixl):
greedy output equals colocated `baton serve` and HF, 8 prompts at once, streamed and not; the
OpenAI endpoints (chat streamed, completions) give the colocated text."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import pytest

from tests.disagg.pd import read_stream, stream_ids
from tests.engine.hf_reference import MAX_NEW, Reference, compare
from tests.server.server_process import ServerProcess
from tests.up_process import Up


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    u = Up("builtin:smollm2-135m", tmp_path_factory.mktemp("up2x2"), "--prefill", "2",
           "--decode", "2", "--kv-transfer", "nixl", "--", "--max-total-tokens", "4096")
    try:
        u.wait_up()
        yield u
    finally:
        u.close()


async def generate_all(url: str, prompt_ids: list[list[int]]) -> list[list[int]]:
    async def one(http: httpx.AsyncClient, i: int, ids: list[int]) -> list[int]:
        body = {"input_ids": ids, "stream": i % 2 == 1,
                "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW}}
        if not body["stream"]:
            r = await http.post(f"{url}/generate", json=body)
            assert r.status_code == 200, r.text
            return list(r.json()["output_ids"])
        async with http.stream("POST", f"{url}/generate", json=body) as resp:
            assert resp.status_code == 200
            return stream_ids(await read_stream(resp))

    async with httpx.AsyncClient(timeout=300) as http:
        return list(await asyncio.gather(*(one(http, i, ids) for i, ids in enumerate(prompt_ids))))


def test_2x2_greedy_equals_colocated_and_hf(
    up: Up, server: ServerProcess, prompt_ids: list[list[int]], hf_refs: list[Reference]
) -> None:
    pd = asyncio.run(generate_all(up.url, prompt_ids))
    colocated = asyncio.run(generate_all(server.url, prompt_ids))
    for i, (ours, co, ref) in enumerate(zip(pd, colocated, hf_refs, strict=True)):
        assert ours == co, f"prompt {i}: PD {ours} != colocated {co}"
        note = compare(ours, ref)
        if note:
            print(f"prompt {i}: {note}")


def openai_texts(url: str, model: str) -> tuple[str, str]:
    chat = {"model": model, "messages": [{"role": "user", "content": "Name three rivers."}],
            "max_tokens": 20, "temperature": 0, "stream": True}
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", f"{url}/v1/chat/completions", json=chat) as s:
            chunks = [json.loads(ln[6:]) for ln in s.iter_lines()
                      if ln.startswith("data: {")]
        chat_text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        r = http.post(f"{url}/v1/completions", json={
            "model": model, "prompt": "The three primary colors are", "max_tokens": 16,
            "temperature": 0})
        assert r.status_code == 200, r.text
    return chat_text, r.json()["choices"][0]["text"]


def test_openai_endpoints_through_the_router_match_colocated(up: Up, server: ServerProcess) -> None:
    pd = openai_texts(up.url, "smollm2-135m")  # the builtin model's one name, as in a cluster
    assert pd == openai_texts(server.url, "smollm2")
    assert all(pd)
    models = httpx.get(f"{up.url}/v1/models", timeout=30).json()["data"]
    assert [m["id"] for m in models] == ["smollm2-135m"]
    assert openai_texts(up.url, "builtin:smollm2-135m") == pd  # its spelling as --model: an alias
