"""KV pool sizing: --max-total-tokens, or --mem-fraction-static of the GPU (sglang's rule)."""

from __future__ import annotations

import pytest
import torch

from runtime.engine.memory import GiB, NoRoomForKV, kv_pages, out_of_memory, pages_from_memory
from runtime.kvcache.fp8 import FP8, KVScales
from runtime.kvcache.pool import KVPool, page_nbytes


def test_the_fraction_leaves_the_rest_for_activations() -> None:
    # 80 GiB GPU, 2 GiB taken by weights and context: 0.5 * 80 - 2 = 38 GiB for the pool.
    page = 1 << 20
    assert pages_from_memory(78 * GiB, 80 * GiB, 0.5, page) == 38 * 1024
    assert pages_from_memory(78 * GiB, 80 * GiB, 0.9, page) == 70 * 1024


def test_the_same_memory_holds_twice_bf16s_tokens_in_fp8_and_four_times_float32s() -> None:
    """--kv-cache-dtype fp8_e4m3 under --mem-fraction-static: the pool's tokens for one budget
    (38 GiB), on llama-8b's KV shape (32 layers, 8 KV heads x 128) and the builtin model's (30
    layers, 3 x 64); the sizing's page bytes are the pool's own."""
    for layers, kv_heads, head_dim in ((32, 8, 128), (30, 3, 64)):
        fp8, bf16, fp32 = (
            pages_from_memory(78 * GiB, 80 * GiB, 0.5, page_nbytes(layers, 16, kv_heads, head_dim, d))
            for d in (FP8, torch.bfloat16, torch.float32))
        # in pages of 16 tokens: equal up to the last page each rounds away
        assert fp8 - 2 * bf16 in (0, 1) and fp8 - 4 * fp32 in range(4)
        assert 16 * fp8 == 38 * GiB // (layers * 2 * kv_heads * head_dim * 16) * 16
    pool = KVPool(30, 2, 16, 3, 64, torch.float32, scales=KVScales.default(30))
    assert pool.page_bytes == page_nbytes(30, 16, 3, 64, FP8) == page_nbytes(30, 16, 3, 64, torch.float32) // 4


def test_weights_over_the_fraction_is_a_clear_error() -> None:
    with pytest.raises(NoRoomForKV, match=r"raise --mem-fraction-static") as e:
        pages_from_memory(10 * GiB, 80 * GiB, 0.8, 1 << 20)  # 70 GiB taken > 64 GiB allowed
    assert "70.00 GiB of the GPU's 80.00 GiB" in str(e.value)


def test_without_the_fraction_max_total_tokens_decides() -> None:
    cpu = torch.device("cpu")
    assert kv_pages(cpu, 4096, None, 16, 1 << 20) == (256, "--max-total-tokens 4096")
    assert kv_pages(cpu, 8, None, 16, 1 << 20)[0] == 1  # never an empty pool
    with pytest.raises(ValueError, match="use --max-total-tokens"):
        kv_pages(cpu, 4096, 0.8, 16, 1 << 20)


def test_an_allocation_failure_names_the_flags_to_lower() -> None:
    error = out_of_memory("a KV pool of 10000000 tokens", torch.OutOfMemoryError("CUDA out of memory.\nmore"))
    assert "lower --mem-fraction-static or --max-total-tokens" in str(error)
    assert str(error).endswith("(CUDA out of memory.)")
