"""The engine with fp8 KV pages (`kv_cache_dtype="fp8_e4m3"`). fp8 KV is lossy against full
precision (the quality gate measures how much: docs/performance.md), so HF equality does not
apply; what does is fp8 against fp8: with the prefix cache on, prompts in small prefill chunks,
sent twice (the second round reads its prefixes from cached fp8 pages), greedy output equals a
cache-off, one-chunk run token for token, on the tiny Llama whose tokens hang on attention."""

from __future__ import annotations

import random
from pathlib import Path

from runtime import Engine


def test_cached_and_chunked_output_equals_uncached_output_token_for_token(
        sharp_tiny_path: Path) -> None:
    rng = random.Random(3)
    stems = [[rng.randrange(100, 40000) for _ in range(rng.randrange(20, 60))] for _ in range(3)]
    prompts = [rng.choice(stems) + [rng.randrange(100, 40000) for _ in range(rng.randrange(1, 9))]
               for _ in range(8)]
    params = {"temperature": 0, "max_new_tokens": 8}
    common = {"model": str(sharp_tiny_path), "kv_cache_dtype": "fp8_e4m3", "page_size": 4}
    reference = Engine(**common, disable_prefix_cache=True)
    try:
        assert reference.runner.pool.buffer.dtype.itemsize == 1
        want = [r["output_ids"] for r in reference.generate(prompts, params)]
    finally:
        reference.shutdown()
    engine = Engine(**common, chunked_prefill_size=16)
    try:
        first = engine.generate(prompts, params)
        second = engine.generate(prompts, params)
        assert [r["output_ids"] for r in first] == want
        assert [r["output_ids"] for r in second] == want
        assert sum(r["meta_info"]["cached_tokens"] for r in second) > sum(map(len, prompts)) // 2
    finally:
        engine.shutdown()
