"""KV pool sizing: --max-total-tokens, or --mem-fraction-static of the GPU (sglang's rule)."""

from __future__ import annotations

import pytest
import torch

from runtime.engine.memory import GiB, NoRoomForKV, kv_pages, out_of_memory, pages_from_memory


def test_the_fraction_leaves_the_rest_for_activations() -> None:
    # 80 GiB GPU, 2 GiB taken by weights and context: 0.5 * 80 - 2 = 38 GiB for the pool.
    page = 1 << 20
    assert pages_from_memory(78 * GiB, 80 * GiB, 0.5, page) == 38 * 1024
    assert pages_from_memory(78 * GiB, 80 * GiB, 0.9, page) == 70 * 1024


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
