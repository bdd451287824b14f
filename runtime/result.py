"""The native result shape, one builder for `offline.Engine.generate` and `POST /generate`:
{"text", "output_ids", "meta_info"} (sglang's). The finish reason travels typed
(`FinishReason`) until here, the edge, where it becomes JSON; text ends before a matched stop
string (`cut_at_stop`, also the detokenizer's last step)."""

from __future__ import annotations

from typing import Any

from runtime.messages import FinishReason


def cut_at_stop(text: str, reason: FinishReason | None) -> str:
    """`text` up to the stop string the request ended on (unchanged otherwise)."""
    matched = reason.matched if reason is not None else None
    if isinstance(matched, str) and matched and matched in text:
        return text[: text.index(matched)]
    return text


def generate_result(
    rid: str, text: str, output_ids: list[int], prompt_tokens: int, completion_tokens: int,
    reason: FinishReason | None, logprobs: list[float] | None = None,
    top_logprobs: list[list[tuple[int, float]]] | None = None,
    customized_info: dict[str, list[Any]] | None = None, cached_tokens: int = 0,
) -> dict[str, Any]:
    """The result (for a stream chunk: only what is new) with its meta_info."""
    meta: dict[str, Any] = {
        "id": rid,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "cached_tokens": cached_tokens,
        "finish_reason": reason.to_dict() if reason is not None else None,
    }
    if customized_info:
        meta["customized_info"] = customized_info
    if logprobs is not None:
        meta["output_token_logprobs"] = [[lp, tid] for lp, tid in zip(logprobs, output_ids,
                                                                      strict=True)]
        if top_logprobs is not None:
            meta["output_top_logprobs"] = [[list(x) for x in row] for row in top_logprobs]
    return {"text": text, "output_ids": list(output_ids), "meta_info": meta}
