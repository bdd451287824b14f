"""runtime.tokenizer equals transformers' AutoTokenizer on the builtin model, call for call."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from runtime.tokenizer import (
    Tokenizer,
    chat_prompt_ids,
    load_tokenizer,
    tokenizer_files,
    tokenizer_from_files,
)

TEXTS = [
    "The capital of France is", "", " ", "  leading and trailing  ", "line\nbreaks\n\n\ttabs",
    "naïve café — “quotes” \u2018single\u2019 …", "日本語のテキストと中文", "emoji 👩‍👩‍👧 🚀 and ZWJ",
    "<|im_start|>user\nspecial tokens written as text<|im_end|>", "don't won't I'm you're",
    "code: def f(x):\n    return x ** 2  # comment", "1234567890 3.14159 -2e10", "a" * 300,
    "Hello , world . Is it ? Yes !", "\u00a0non-breaking\u2009thin space",
    # past LONG_TEXT: tokenized with the GIL let go (encode_batch), the same ids
    "naïve café — 日本語 🚀 code: def f(x): return x ** 2\n" * 600,
]
CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, how can I help?"},
     {"role": "user", "content": "Tell me a joke about 🐍."}],
    [{"role": "user", "content": ""}],
]


@pytest.fixture(scope="module")
def ours(model_path: Path) -> Any:
    tok = load_tokenizer(model_path)
    assert isinstance(tok, Tokenizer)  # the builtin model takes the fast path
    return tok


def test_encode_equals_transformers(ours: Any, tokenizer: Any) -> None:
    for text in TEXTS:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == \
                tokenizer.encode(text, add_special_tokens=special), (text, special)


def test_decode_equals_transformers(ours: Any, tokenizer: Any) -> None:
    rng = random.Random(0)
    vocab = len(tokenizer)
    cases = [tokenizer.encode(t) for t in TEXTS] + [[0, 1, 2, 5, 1, 17]]
    cases += [[rng.randrange(vocab) for _ in range(rng.randrange(1, 40))] for _ in range(200)]
    cases += [[rng.choice(range(17)), *c] for c in cases[:50]]  # special tokens first
    for ids in cases:
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == \
                tokenizer.decode(ids, skip_special_tokens=skip), (ids, skip)
    for token_id in [0, 1, 2, 3, 100, 5000, vocab - 1]:
        assert ours.convert_ids_to_tokens(token_id) == tokenizer.convert_ids_to_tokens(token_id)
    assert ours.eos_token_id == tokenizer.eos_token_id


def test_chat_template_equals_transformers(ours: Any, tokenizer: Any) -> None:
    for messages in CHATS:
        for prompt in (True, False):
            assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt) \
                == tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)


def test_a_server_process_never_imports_transformers(model_path: Path) -> None:
    code = ("import sys; from runtime.tokenizer import load_tokenizer; "
            f"t = load_tokenizer({str(model_path)!r}); t.apply_chat_template([{{'role': 'user', "
            "'content': 'x'}], add_generation_prompt=True); print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         check=True)
    assert out.stdout.strip() == "False"


def test_a_folder_without_tokenizer_json_falls_back_to_transformers(
    model_path: Path, tmp_path: Path
) -> None:
    (tmp_path / "tokenizer_config.json").write_text(
        (model_path / "tokenizer_config.json").read_text().replace("{", '{"add_bos_token": true,', 1))
    (tmp_path / "tokenizer.json").write_bytes((model_path / "tokenizer.json").read_bytes())
    tok = load_tokenizer(tmp_path)
    assert not isinstance(tok, Tokenizer)  # a post-processor rewrite: transformers knows how


def test_a_tokenizer_travels_as_its_files(ours: Any, model_path: Path) -> None:
    """What a worker's GET /tokenizer serves rebuilds the same tokenizer in a router that has
    not got the model (`--tokenizer workers`): same ids for every text and chat."""
    files = tokenizer_files(model_path)
    assert "tokenizer.json" in files and set(files) <= {
        "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"}
    copy = tokenizer_from_files({**files, "model.safetensors": "never written"})
    for text in TEXTS:
        assert copy.encode(text) == ours.encode(text), text
    for chat in CHATS:
        assert chat_prompt_ids(copy, chat) == chat_prompt_ids(ours, chat)
