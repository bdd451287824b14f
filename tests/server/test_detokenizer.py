"""IncrementalDetokenizer: deltas never end mid-character and concatenate to the full text."""

from __future__ import annotations

from typing import Any

import pytest

from runtime.messages import FinishReason
from runtime.server.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello world, plain ASCII with  double  spaces.",
    "Emoji: 😀🎉👍🏽 family 👨‍👩‍👧 and flags 🇫🇷🇯🇵",
    "中文测试：你好，世界！日本語のテキスト。한국어 텍스트",  # noqa: RUF001
    "Mixed: café naïve — “quotes” 🤖 数学 ∑∫√ end",
    "<|im_start|>special tokens inside<|im_end|> text",
]


def _stream(tok: Any, ids: list[int], sizes: list[int], **kw: Any) -> list[str]:
    detok = IncrementalDetokenizer(tok, **kw)
    deltas, i, k = [], 0, 0
    while i < len(ids):
        n = sizes[k % len(sizes)]
        chunk, i, k = ids[i : i + n], i + n, k + 1
        deltas.append(detok.finish(chunk) if i >= len(ids) else detok.push(chunk))
    return deltas


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("sizes", [[1], [2, 1, 3]], ids=["one", "mixed"])
@pytest.mark.parametrize("skip", [True, False])
def test_concatenation_equals_full_decode(tokenizer: Any, text: str, sizes: list[int], skip: bool) -> None:
    ids = tokenizer.encode(text)
    deltas = _stream(tokenizer, ids, sizes, skip_special_tokens=skip)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip)
    assert not any("\ufffd" in d for d in deltas)


def test_partial_character_is_held_back(tokenizer: Any) -> None:
    ids = tokenizer.encode("😀")
    assert len(ids) > 1  # byte-level BPE splits the emoji
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.push(ids[:1]) == ""
    assert detok.finish(ids[1:]) == "😀"


def test_stop_string_is_never_streamed(tokenizer: Any) -> None:
    text = "one two three STOP four"
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, stop=("STOP",))
    out = "".join(detok.push([t]) for t in ids[:-2])
    assert "STOP" not in out and "ST" not in out
    out += detok.finish(ids[-2:], FinishReason("stop", matched="STOP"))
    assert out == "one two three "


def test_token_bytes_rebuild_multibyte_characters(tokenizer: Any) -> None:
    from runtime.server.openai_format import token_bytes

    for text in ["😀 emoji", "你好", " plain words", "<|im_end|>"]:
        ids = tokenizer.encode(text)
        assert b"".join(token_bytes(tokenizer, t) for t in ids).decode("utf-8") == text
