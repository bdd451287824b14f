"""The KV pool: one buffer, allocated once at start-up, page-major.

    buffer [num_pages, num_layers, 2 (K, V), page_size, num_kv_heads, head_dim]

A page holds K and V of every layer for `page_size` positions in one contiguous block, so a
transfer moves a page as one block (docs/architecture.md "KV cache layout": one buffer holding all layers).
One layer's K (or V) is a strided view [num_pages, page_size, num_kv_heads, head_dim]. Slot s is
position s % page_size of page s // page_size, and a request's position i always lives in slot
`pages[i // page_size] * page_size + i % page_size` (KVCacheManager.grow).
Nothing may reallocate or resize the buffer while serving: transfer backends register it once
and address it by page index. In host memory the buffer sits on transparent huge pages
(`huge_page_zeros`): UCX's cma path copies a page run twice as fast into and out of it
(bench/pd.py: 3.8 -> 7.5 GB/s for a 256-token prompt), as the kernel pins 2 MiB pages, not
4 KiB ones.
With `scales` (`--kv-cache-dtype fp8_e4m3`) the buffer holds float8_e4m3fn, quantized on `write`
and dequantized to the model's dtype on `read` and `gather_pages` (runtime/kvcache/fp8.py);
`dtype` is then the stored dtype and `compute_dtype` the model's. Byte-level users (transfers,
the canary's checksums) see one byte an element and need nothing else.
"""

from __future__ import annotations

import math
import mmap

import torch

from runtime.kvcache.fp8 import FP8, KVScales, dequantize, quantize

Loc = tuple[torch.Tensor, torch.Tensor]  # (page, offset in the page) of some slots: [T] each


class KVPool:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        scales: KVScales | None = None,
    ) -> None:
        """`dtype`: the model's, what K and V come in and are read back as; `scales`: store
        float8_e4m3fn under these per-layer scales instead of `dtype`."""
        if scales is not None and len(scales.k) != num_layers:
            raise ValueError(f"KV scales for {len(scales.k)} layers, the pool has {num_layers}")
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_slots = num_pages * page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        # [num_pages, num_layers, 2, page_size, num_kv_heads, head_dim]
        shape = (num_pages, num_layers, 2, page_size, num_kv_heads, head_dim)
        self.scales, self.compute_dtype = scales, dtype
        if scales is not None:
            dtype = FP8
        if torch.device(device).type == "cpu":
            self.buffer = huge_page_zeros(shape, dtype)
        else:
            self.buffer = torch.zeros(shape, dtype=dtype, device=device)
        self.dtype, self.device = dtype, self.buffer.device

    def pages(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer as [num_pages, page_size, num_kv_heads, head_dim] strided views."""
        return self.buffer[:, layer, 0], self.buffer[:, layer, 1]

    def locate(self, slots: torch.Tensor) -> Loc:
        """Where slots [T] live; computed once per batch, used by every layer."""
        return slots // self.page_size, slots % self.page_size

    def write(self, layer: int, loc: Loc, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' K/V at `loc`. k, v: [T, num_kv_heads, head_dim]."""
        k_pages, v_pages = self.pages(layer)
        if self.scales is not None:
            k, v = quantize(k, self.scales.k[layer]), quantize(v, self.scales.v[layer])
        k_pages[loc] = k
        v_pages[loc] = v

    def read(self, layer: int, loc: Loc) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at `loc`, gathered: [T, num_kv_heads, head_dim] each."""
        k_pages, v_pages = self.pages(layer)
        return self._load(layer, k_pages[loc], v_pages[loc])

    def gather_pages(self, layer: int,
                     page_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of whole pages [N] of one layer: [N, page_size, num_kv_heads, head_dim] each."""
        k_pages, v_pages = self.pages(layer)
        return self._load(layer, k_pages.index_select(0, page_ids),
                          v_pages.index_select(0, page_ids))

    def as_stored(self, layer: int, k: torch.Tensor,
                  v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [T, num_kv_heads, head_dim] as a read of them after a write would give them
        back: rounded through fp8 for an fp8 pool, else unchanged."""
        if self.scales is None:
            return k, v
        ks, vs, dtype = self.scales.k[layer], self.scales.v[layer], self.compute_dtype
        return dequantize(quantize(k, ks), ks, dtype), dequantize(quantize(v, vs), vs, dtype)

    def _load(self, layer: int, k: torch.Tensor,
              v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored K and V as the model's dtype."""
        if self.scales is None:
            return k, v
        return (dequantize(k, self.scales.k[layer], self.compute_dtype),
                dequantize(v, self.scales.v[layer], self.compute_dtype))

    def row_offsets(self, slots: torch.Tensor) -> torch.Tensor:
        """Where each slot's row starts in a layer's K (or V) view, in elements from its first
        element (the same for every layer): for kernels that address the pool directly."""
        k_pages = self.buffer[:, 0, 0]
        return (slots // self.page_size) * k_pages.stride(0) + (slots % self.page_size) * k_pages.stride(1)

    def page_rows(self) -> torch.Tensor:
        """The buffer as raw bytes, one row per page: [num_pages, page_bytes] uint8."""
        return self.buffer.view(torch.uint8).view(self.num_pages, -1)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page: K and V of every layer."""
        return self.buffer[0].numel() * self.buffer.element_size()

    @property
    def bytes_per_slot(self) -> int:
        return self.page_bytes // self.page_size


def page_nbytes(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one page (K and V of every layer) before a pool exists: for sizing one."""
    return num_layers * 2 * page_size * num_kv_heads * head_dim * dtype.itemsize


HUGE_PAGE = 2 << 20


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed host tensor on 2 MiB-aligned memory advised for transparent huge pages (torch's
    own allocator gives 4 KiB pages unless THP_MEM_ALLOC_ENABLE is set before it first runs).
    Every page is touched here, as torch.zeros would: the memory is committed at start-up."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    area = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(area, dtype=torch.uint8)  # holds `area` for the tensor's lifetime
    skip = -raw.data_ptr() % HUGE_PAGE
    if hasattr(mmap, "MADV_HUGEPAGE") and nbytes >= HUGE_PAGE:
        area.madvise(mmap.MADV_HUGEPAGE, skip, nbytes - nbytes % HUGE_PAGE)
    buffer = raw[skip : skip + nbytes].view(dtype).view(shape)
    buffer.zero_()
    return buffer
