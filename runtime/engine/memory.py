"""How big the KV pool is: `--max-total-tokens`, or on a GPU `--mem-fraction-static` of its memory.

sglang's rule: the weights and the KV pool together take `mem_fraction_static` of the GPU's
memory; the rest is left for activations, the sampler and CUDA graphs. The pool gets what the
fraction leaves after everything already on the GPU (weights, the CUDA context, other tenants);
memory torch has cached but no tensor uses counts as free.
"""

from __future__ import annotations

import torch

GiB = 1 << 30


class NoRoomForKV(RuntimeError):
    """The pool cannot be sized or allocated; the message names the flag to change."""


def pages_from_memory(free: int, total: int, fraction: float, page_bytes: int) -> int:
    """KV pages that fit in `fraction` of `total` bytes, `total - free` of which are taken."""
    taken = total - free
    budget = fraction * total - taken
    pages = int(budget // page_bytes)
    if pages < 1:
        raise NoRoomForKV(
            f"--mem-fraction-static {fraction} leaves no room for the KV pool: "
            f"{taken / GiB:.2f} GiB of the GPU's {total / GiB:.2f} GiB are in use already "
            f"(weights, CUDA context, other processes); raise --mem-fraction-static"
        )
    return pages


def kv_pages(
    device: torch.device, max_total_tokens: int, fraction: float | None, page_size: int, page_bytes: int
) -> tuple[int, str]:
    """The pool's size in pages, and how it was chosen (for the start-up log)."""
    if fraction is None:
        return max(1, max_total_tokens // page_size), f"--max-total-tokens {max_total_tokens}"
    if device.type != "cuda":
        raise ValueError(
            f"--mem-fraction-static sizes the KV pool from GPU memory; on {device.type} "
            "use --max-total-tokens"
        )
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"--mem-fraction-static must be in (0, 1), got {fraction}")
    free, total = torch.cuda.mem_get_info(device)
    # What torch's caching allocator holds but no tensor uses (an earlier engine's, say) is ours
    # to take: the driver counts it as used.
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    pages = pages_from_memory(free, total, fraction, page_bytes)
    return pages, (
        f"--mem-fraction-static {fraction} of {total / GiB:.1f} GiB "
        f"({(total - free) / GiB:.2f} GiB in use before the pool)"
    )


def out_of_memory(what: str, error: BaseException) -> NoRoomForKV:
    """A clear start-up error for a device allocation that failed."""
    return NoRoomForKV(
        f"out of GPU memory while allocating {what}: lower --mem-fraction-static or "
        f"--max-total-tokens (or --max-running-requests) ({str(error).splitlines()[0]})"
    )
