"""customized_info through the server (seeds 000/001): a sampler backend registered by a plugin
mirrors each step's sampled ids into customized_info["mirror"]. Streamed chunks carry only the
new values, the concatenation equals the streamed output_ids, and both equal the non-streaming
result — for stream_interval 1, a per-request stream_interval > 1, and a server-wide one."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.server_process import start_server

PROMPTS = ["Once upon a time", "Tell me about 🍕 in Italian:", "数学是"]
MAX = 14


@pytest.fixture(scope="module")
def mirror(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    srv = start_server(
        "--plugin", "tests.server.mirror_sampler", "--sampler-backend", "mirror",
        "--forced-stream-interval", "4", "--stream-interval", "2",
        log_path=Path(tmp_path_factory.mktemp("mirror")) / "server.log",
    )
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        yield c
    assert srv.stop() == 0, srv.log()


def _params(interval: int | None) -> dict[str, Any]:
    params: dict[str, Any] = {"max_new_tokens": MAX, "temperature": 0, "ignore_eos": True}
    if interval is not None:
        params["stream_interval"] = interval
    return params


def _stream(client: httpx.Client, prompt: str, interval: int | None) -> list[dict[str, Any]]:
    body = {"text": prompt, "sampling_params": _params(interval), "stream": True}
    chunks = []
    with client.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
    return chunks


def _whole(client: httpx.Client, prompt: str) -> dict[str, Any]:
    r = client.post("/generate", json={"text": prompt, "sampling_params": _params(None)})
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


@pytest.mark.parametrize("interval", [1, 3, None], ids=["interval1", "interval3", "server-interval2"])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_streamed_customized_info_matches_output_ids(mirror: httpx.Client, prompt: str, interval: int | None) -> None:
    whole = _whole(mirror, prompt)
    assert whole["meta_info"]["customized_info"]["mirror"] == whole["output_ids"]
    assert len(whole["output_ids"]) == MAX

    chunks = _stream(mirror, prompt, interval)
    ids = [t for c in chunks for t in c["output_ids"]]
    mirrored = [t for c in chunks for t in c["meta_info"].get("customized_info", {}).get("mirror", [])]
    assert mirrored == ids == whole["output_ids"]
    for c in chunks:  # each chunk carries only its own tokens' values
        assert c["meta_info"].get("customized_info", {}).get("mirror", []) == c["output_ids"]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    sizes = [len(c["output_ids"]) for c in chunks]
    step = interval or 2
    # first token alone (TTFT), then about one chunk per interval (more per chunk if coalesced)
    assert sizes[0] == 1 and len(chunks) <= 1 + -(-(MAX - 1) // step) + 1
    if step > 1:
        assert max(sizes) > 1


def test_non_streaming_logprobs_and_customized_info_align(mirror: httpx.Client) -> None:
    r = mirror.post("/generate", json={
        "text": PROMPTS[0], "sampling_params": _params(None), "return_logprob": True,
        "top_logprobs_num": 2,
    }).json()
    meta = r["meta_info"]
    assert [tid for _, tid in meta["output_token_logprobs"]] == r["output_ids"]
    assert len(meta["output_top_logprobs"]) == MAX
    assert meta["customized_info"]["mirror"] == r["output_ids"]
