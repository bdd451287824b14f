"""OpenAI response bodies from Deltas: choices, chunks, logprobs, usage."""

from __future__ import annotations

import time
from typing import Any

from runtime.server.generation import Delta


def finish_reason(d: Delta) -> str | None:
    return None if d.finish_reason is None else str(d.finish_reason.get("type"))


def usage(prompt_tokens: int, deltas: list[Delta]) -> dict[str, int]:
    completion = sum(d.completion_tokens for d in deltas)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }


def envelope(kind: str, rid: str, model: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model, "choices": choices}


def _token(tokenizer: Any, token_id: int) -> str:
    return str(tokenizer.decode([token_id], skip_special_tokens=False))


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
    tok = _token(tokenizer, token_id)
    return {"token": tok, "logprob": logprob, "bytes": list(tok.encode("utf-8"))}


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
