"""The official openai SDK against `baton serve`: completions and chat, streaming and not."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.server.server_process import ServerProcess

PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three colors:"]
MAX = 12


@pytest.fixture(scope="module")
def oai(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=120, max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def engine_texts(model_path: Any) -> dict[str, str]:
    """Reference: the offline Engine's greedy text for each prompt."""
    from runtime import Engine

    with Engine(model=str(model_path), max_total_tokens=2048) as engine:
        outs = engine.generate(PROMPTS, {"temperature": 0, "max_new_tokens": MAX})
    return {p: o["text"] for p, o in zip(PROMPTS, outs, strict=True)}


def test_models_lists_the_served_name(oai: openai.OpenAI) -> None:
    assert [m.id for m in oai.models.list().data] == ["smollm2"]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_greedy_equals_engine(oai: openai.OpenAI, engine_texts: dict[str, str], prompt: str) -> None:
    r = oai.completions.create(model="smollm2", prompt=prompt, max_tokens=MAX, temperature=0)
    assert r.choices[0].text == engine_texts[prompt]
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == MAX
    assert r.usage.total_tokens == r.usage.prompt_tokens + MAX


def test_streamed_completion_concatenates_to_the_same_text(oai: openai.OpenAI, engine_texts: dict[str, str]) -> None:
    prompt = PROMPTS[0]
    chunks = list(oai.completions.create(
        model="smollm2", prompt=prompt, max_tokens=MAX, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == engine_texts[prompt]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == MAX


def test_completion_logprobs(oai: openai.OpenAI) -> None:
    r = oai.completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and len(lp.tokens) == 5
    assert lp.token_logprobs is not None and all(x <= 0 for x in lp.token_logprobs)
    assert lp.top_logprobs is not None and all(1 <= len(t) <= 3 for t in lp.top_logprobs)
    # greedy: the chosen token is the most likely one
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert max(top.values()) == pytest.approx(val, abs=1e-4)
        assert tok in top
    assert "".join(lp.tokens) == r.choices[0].text


def test_chat_streaming_equals_non_streaming(oai: openai.OpenAI) -> None:
    msgs: Any = [{"role": "user", "content": "What is the capital of France?"}]
    full = oai.chat.completions.create(model="smollm2", messages=msgs, max_tokens=MAX, temperature=0)
    text = full.choices[0].message.content
    assert full.choices[0].message.role == "assistant" and text
    assert full.usage is not None and full.usage.completion_tokens <= MAX
    stream = oai.chat.completions.create(
        model="smollm2", messages=msgs, max_completion_tokens=MAX, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_chat_logprobs(oai: openai.OpenAI) -> None:
    r = oai.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
        temperature=0, logprobs=True, top_logprobs=2,
    )
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == r.usage.completion_tokens  # type: ignore[union-attr]
    for item in content:
        assert len(item.top_logprobs) == 2 and item.logprob == pytest.approx(item.top_logprobs[0].logprob, abs=1e-4)
        assert item.bytes is not None
    joined = b"".join(bytes(item.bytes or []) for item in content).decode("utf-8", "replace")
    assert joined.replace("<|im_end|>", "") == r.choices[0].message.content


def test_n_choices_are_distinct_requests(oai: openai.OpenAI) -> None:
    r = oai.completions.create(model="smollm2", prompt=PROMPTS[2], max_tokens=6, temperature=1.0, seed=7, n=3)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage is not None and r.usage.completion_tokens == 18
    again = oai.completions.create(model="smollm2", prompt=PROMPTS[2], max_tokens=6, temperature=1.0, seed=7, n=3)
    assert [c.text for c in r.choices] == [c.text for c in again.choices]  # seeded: reproducible


def test_stream_n_choices_interleave(oai: openai.OpenAI) -> None:
    chunks = list(oai.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Count"}], max_tokens=5,
        temperature=0, n=2, stream=True,
    ))
    texts: dict[int, str] = {}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
    assert set(texts) == {0, 1} and texts[0] == texts[1]  # greedy: identical


def test_prompt_list_gives_one_choice_per_prompt(oai: openai.OpenAI, engine_texts: dict[str, str]) -> None:
    r = oai.completions.create(model="smollm2", prompt=PROMPTS, max_tokens=MAX, temperature=0)
    by_index = {c.index: c.text for c in r.choices}
    assert by_index == {i: engine_texts[p] for i, p in enumerate(PROMPTS)}
    assert r.usage is not None and r.usage.completion_tokens == MAX * len(PROMPTS)


def test_stop_string(oai: openai.OpenAI, engine_texts: dict[str, str]) -> None:
    prompt = PROMPTS[0]
    ref = engine_texts[prompt]
    stop = ref.strip().split()[1]  # a word the greedy continuation contains
    r = oai.completions.create(model="smollm2", prompt=prompt, max_tokens=MAX, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == ref[: ref.index(stop)]
    streamed = "".join(
        c.choices[0].text for c in oai.completions.create(
            model="smollm2", prompt=prompt, max_tokens=MAX, temperature=0, stop=stop, stream=True
        ) if c.choices
    )
    assert streamed == r.choices[0].text


def test_token_id_prompt(oai: openai.OpenAI, tokenizer: Any, engine_texts: dict[str, str]) -> None:
    ids = tokenizer.encode(PROMPTS[1])
    r = oai.completions.create(model="smollm2", prompt=ids, max_tokens=MAX, temperature=0)
    assert r.choices[0].text == engine_texts[PROMPTS[1]]


def test_the_tokenizer_files_are_served(client: httpx.Client, model_path: Path) -> None:
    """GET /tokenizer: what a router without the model tokenizes with, exactly the files the
    worker loaded."""
    r = client.get("/tokenizer")
    assert r.status_code == 200
    files = r.json()["files"]
    assert files["tokenizer.json"] == (model_path / "tokenizer.json").read_text()
    assert r.json()["model"] == client.get("/v1/models").json()["data"][0]["id"]
