"""The model's tokenizer without transformers: tokenizer.json through `tokenizers`, the chat
template through jinja2.

`transformers.AutoTokenizer` costs every process that loads it 3-5 s of imports (the HTTP
process and the scheduler both do, for every server, pod and test); this reads the same files
and does what transformers does with them for the calls baton makes (encode, decode,
convert_ids_to_tokens, apply_chat_template). tests/test_tokenizer.py holds it equal to
AutoTokenizer on the builtin model. A folder this does not understand (no tokenizer.json, or
tokenizer_config.json flags that change the post-processor) is loaded with transformers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _Backend

# tokenizer_config.json keys that make transformers rewrite tokenizer.json's post-processor
_REWRITES = ("add_bos_token", "add_eos_token")
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
                 "mask_token")
# transformers' clean_up_tokenization: spaces before punctuation and English contractions
_CLEANUPS = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
             (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


LONG_TEXT = 1 << 14  # characters: tokenized without holding the GIL (Tokenizer.encode)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", "lstrip": ..., ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    def __init__(self, folder: Path, config: dict[str, Any]) -> None:
        """`config`: the folder's tokenizer_config.json ({} when it has none)."""
        self.backend = _Backend.from_file(str(folder / "tokenizer.json"))
        self.clean_up_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        self.special_tokens = {k: t for k in _SPECIAL_KEYS if (t := _token_text(config.get(k)))}
        template_file = folder / "chat_template.jinja"
        self.chat_template: str | None = (
            template_file.read_text() if template_file.exists() else config.get("chat_template")
        )
        self._render: Callable[..., str] | None = None

    @property
    def eos_token_id(self) -> int | None:
        eos = self.special_tokens.get("eos_token")
        return None if eos is None else self.backend.token_to_id(eos)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) < LONG_TEXT:
            return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)
        # tokenizers holds the GIL through `encode` but lets it go in `encode_batch`: a long
        # prompt tokenized in a thread then leaves the event loop's thread running
        [encoding] = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)
        return list(encoding.ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        text = str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))
        if self.clean_up_spaces:
            for before, after in _CLEANUPS:
                text = text.replace(before, after)
        return text

    def convert_ids_to_tokens(self, token_id: int) -> str | None:
        token: str | None = self.backend.id_to_token(token_id)
        return token

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tokenize: bool = False,
        add_generation_prompt: bool = False, **extra: Any,
    ) -> str | list[int]:
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        if self._render is None:
            self._render = _compile(self.chat_template)
        text = self._render(messages=messages, add_generation_prompt=add_generation_prompt,
                            **self.special_tokens, **extra)
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _compile(template: str) -> Callable[..., str]:
    """A chat template in the sandboxed jinja2 environment transformers renders them in."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        from jinja2.exceptions import TemplateError

        raise TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template).render


# what a tokenizer is read from: a router without the model gets these from a worker
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json")


def tokenizer_files(path: os.PathLike[str] | str) -> dict[str, str]:
    """The model folder's tokenizer files (those it has), as text (a worker's GET /tokenizer)."""
    folder = Path(path)
    return {name: (folder / name).read_text() for name in TOKENIZER_FILES
            if (folder / name).is_file()}


def tokenizer_from_files(files: dict[str, str]) -> Any:
    """The tokenizer `tokenizer_files` describes (only those file names are written)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="baton-tokenizer-") as folder:
        for name in TOKENIZER_FILES:
            if isinstance(files.get(name), str):
                (Path(folder) / name).write_text(files[name])
        return load_tokenizer(folder)


def load_tokenizer(path: os.PathLike[str] | str) -> Any:
    folder = Path(path)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.exists() else {}
    if (folder / "tokenizer.json").exists() and not any(k in config for k in _REWRITES):
        return Tokenizer(folder, config)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """The prompt of a chat request: the template rendered with the generation prompt, then
    encoded without adding special tokens (the template wrote them). The one place both the
    workers and the router's cache-aware policy tokenize chats, so their block hashes agree."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


def tail_decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    """The text of a few output ids, special tokens kept: what stop strings are matched on."""

    def decode_tail(ids: list[int]) -> str:
        return str(tokenizer.decode(ids, skip_special_tokens=False))

    return decode_tail
