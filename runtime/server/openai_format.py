"""OpenAI response bodies from Deltas: choices, chunks, logprobs, usage."""

from __future__ import annotations

import re
import time
from typing import Any

from runtime.server.generation import Delta


def finish_reason(d: Delta) -> str | None:
    return None if d.finish_reason is None else d.finish_reason.kind


def usage(prompt_tokens: int, deltas: list[Delta], n: int = 1) -> dict[str, Any]:
    """Usage of a response: each prompt counted once (its `n` choices share it), so its
    cached tokens are those of the choice that found the most in the prefix cache."""
    completion = sum(d.completion_tokens for d in deltas)
    by_prompt: dict[int, int] = {}
    for d in deltas:
        by_prompt[d.index // n] = max(by_prompt.get(d.index // n, 0), d.cached_tokens)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": min(sum(by_prompt.values()), prompt_tokens)},
    }


def envelope(kind: str, rid: str, model: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model, "choices": choices}


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2 byte-level BPE: the printable character standing for each byte."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_OF = _byte_level_alphabet()
_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # sentencepiece byte fallback


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """The token's own bytes (a byte-level token may be part of one UTF-8 character)."""
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if isinstance(piece, str):
        if m := _BYTE_TOKEN.match(piece):
            return bytes([int(m.group(1), 16)])
        if all(c in _BYTE_OF for c in piece):
            return bytes(_BYTE_OF[c] for c in piece)
    return str(tokenizer.decode([token_id], skip_special_tokens=False)).encode("utf-8")


def _token(tokenizer: Any, token_id: int) -> str:
    return token_bytes(tokenizer, token_id).decode("utf-8", errors="replace")


def completion_logprobs(tokenizer: Any, d: Delta, offset: int) -> dict[str, Any] | None:
    """Legacy completions format; `offset` is where this delta's text starts in the choice."""
    if d.logprobs is None:
        return None
    tokens = [_token(tokenizer, t) for t in d.output_ids]
    offsets = []
    for tok in tokens:
        offsets.append(offset)
        offset += len(tok)
    top = None
    if d.top_logprobs is not None:
        top = [{_token(tokenizer, tid): lp for tid, lp in row} for row in d.top_logprobs]
    return {"tokens": tokens, "token_logprobs": d.logprobs, "top_logprobs": top, "text_offset": offsets}


def _chat_entry(tokenizer: Any, token_id: int, logprob: float) -> dict[str, Any]:
    raw = token_bytes(tokenizer, token_id)
    return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}


def chat_logprobs(tokenizer: Any, d: Delta) -> dict[str, Any] | None:
    if d.logprobs is None:
        return None
    content = []
    for i, (tid, lp) in enumerate(zip(d.output_ids, d.logprobs, strict=True)):
        entry = _chat_entry(tokenizer, tid, lp)
        rows = d.top_logprobs[i] if d.top_logprobs is not None else []
        entry["top_logprobs"] = [_chat_entry(tokenizer, t, v) for t, v in rows]
        content.append(entry)
    return {"content": content}


def completion_choice(tokenizer: Any, d: Delta, offset: int = 0) -> dict[str, Any]:
    return {
        "index": d.index,
        "text": d.text,
        "logprobs": completion_logprobs(tokenizer, d, offset),
        "finish_reason": finish_reason(d),
    }


def chat_choice(tokenizer: Any, d: Delta) -> dict[str, Any]:
    return {
        "index": d.index,
        "message": {"role": "assistant", "content": d.text},
        "logprobs": chat_logprobs(tokenizer, d),
        "finish_reason": finish_reason(d),
    }


def chat_chunk_choice(tokenizer: Any, d: Delta, first: bool) -> dict[str, Any]:
    delta: dict[str, Any] = {"content": d.text}
    if first:
        delta["role"] = "assistant"
    return {
        "index": d.index,
        "delta": delta,
        "logprobs": chat_logprobs(tokenizer, d),
        "finish_reason": finish_reason(d),
    }
