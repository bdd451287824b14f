"""The prefix cache over HTTP: usage.prompt_tokens_details.cached_tokens (streamed too),
meta_info.cached_tokens, the Prometheus counters, /debug/prefix_cache's block hashes (the names
the router's index will use) and POST /flush_cache."""

from __future__ import annotations

import json
from typing import Any

import httpx

from runtime.kvcache.radix import block_hashes
from tests.server.server_process import ServerProcess
from tests.server.test_concurrency import _wait_idle
from tests.server.test_metrics import metric

PAGE = 16  # the server's default page size
SYSTEM = ("You answer questions about the solar system in one sentence. Distances are in "
          "astronomical units, masses in Earth masses, and you never guess a number you do not "
          "know. Planets: Mercury, Venus, Earth, Mars, Jupiter, Saturn, Uranus and Neptune.")


def chat(client: httpx.Client, question: str, **extra: Any) -> dict[str, Any]:
    body = {"model": "smollm2", "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": question}], **extra}
    resp = client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    if not extra.get("stream"):
        return dict(resp.json())
    events = [json.loads(line[6:]) for line in resp.text.splitlines()
              if line.startswith("data: {")]
    return {"usage": events[-1]["usage"], "choices": events[:-1]}


def test_cached_tokens_reach_usage_metrics_and_the_debug_view(
        server: ServerProcess, client: httpx.Client) -> None:
    _wait_idle(client)
    assert client.post("/flush_cache").json()["enabled"] is True
    before = client.get("/metrics").text
    first = chat(client, "Which planet is largest?")
    prompt = first["usage"]["prompt_tokens"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    again = chat(client, "Which planet is largest?")
    assert again["choices"] == first["choices"], "the cached answer differs"
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == (prompt - 1) // PAGE * PAGE
    other = chat(client, "Which planet is smallest?", stream=True,
                 stream_options={"include_usage": True})
    shared = other["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert PAGE <= shared < prompt, "the system prompt's pages, not the question's"
    _wait_idle(client)
    after = client.get("/metrics").text
    hits = metric(after, "baton_prefix_cache_hit_tokens_total") - \
        metric(before, "baton_prefix_cache_hit_tokens_total")
    assert hits == (prompt - 1) // PAGE * PAGE + shared
    assert metric(after, "baton_prefix_cache_query_tokens_total") > \
        metric(before, "baton_prefix_cache_query_tokens_total")
    assert metric(after, "baton_prefix_cache_tokens") > 0

    view = client.get("/debug/prefix_cache").json()
    assert view["enabled"] and view["page_size"] == PAGE
    assert view["cached_tokens"] == len(view["block_hashes"]) * PAGE


def test_generate_reports_cached_tokens_and_the_hashes_name_the_prompt_pages(
        server: ServerProcess, client: httpx.Client) -> None:
    _wait_idle(client)
    client.post("/flush_cache")
    ids = list(range(1000, 1000 + 3 * PAGE + 5))
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 4}}
    first = client.post("/generate", json=body).json()
    second = client.post("/generate", json=body).json()
    assert first["meta_info"]["cached_tokens"] == 0
    assert second["meta_info"]["cached_tokens"] == 3 * PAGE
    assert second["output_ids"] == first["output_ids"]
    _wait_idle(client)
    view = client.get("/debug/prefix_cache").json()
    sequence = ids + first["output_ids"]
    computed = sequence[: len(sequence) - 1]  # the last token's KV is never computed
    assert sorted(block_hashes(computed, PAGE)) == view["block_hashes"]


def test_flush_frees_what_no_request_reads(server: ServerProcess, client: httpx.Client) -> None:
    _wait_idle(client)
    chat(client, "How far is Mars?")
    flushed = client.post("/flush_cache").json()
    assert flushed["freed_tokens"] > 0 and flushed["cached_tokens"] == 0
    assert client.get("/debug/prefix_cache").json()["block_hashes"] == []
    assert chat(client, "How far is Mars?")["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    stats = client.get("/debug/stats").json()
    assert stats["kv_all_free"] and stats["kv_used_pages"] == 0
