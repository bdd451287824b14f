"""Host <-> device copies for one forward: each way, every tensor travels in one packed copy.

The scheduler builds a forward's index and sampling tensors on the host (small Python lists).
On a GPU, copying them one by one costs a launch and, from pageable memory, a wait each; so
`to_device` packs them as bytes into one pinned host buffer, copies it with `non_blocking=True`
and hands back typed views of the device copy. `to_host` does the same the other way for a
forward's results and records an event, so the scheduler waits for this forward only, not for
work queued after it (overlap). On the CPU both are the identity: nothing is copied.

Tensors are packed by element size, largest first, so every view starts aligned to its dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def serving_device(name: str, rank: int = 0) -> torch.device:
    """The device to serve on, with its index ("cuda" is the current GPU; under tensor
    parallelism rank r's is GPU r, or the current one when there are fewer GPUs than ranks)."""
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        count = torch.cuda.device_count()
        return torch.device("cuda", rank if 0 < rank < count else torch.cuda.current_device())
    return device


def bind_thread(device: torch.device) -> None:
    """Make `device` this thread's current GPU. torch ops follow their tensors, but Triton
    launches and CUDA events go to the current device, which a new thread starts at GPU 0."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def is_on(actual: torch.device, wanted: torch.device) -> bool:
    """Does a tensor on `actual` sit where `wanted` points? A device spelled without an index
    ("cuda", as `--device cuda` gives) matches its type on any index (one process serves on one
    GPU); torch itself compares "cuda" unequal to "cuda:0"."""
    return actual.type == wanted.type and wanted.index in (None, actual.index)


def to_device(tensors: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """`tensors` (on the host) on `device`, through one copy. Identity on the CPU."""
    if device.type == "cpu" or not tensors:
        return list(tensors)
    packed, layout = _pack(tensors, pinned=device.type == "cuda")
    return _unpack(packed.to(device, non_blocking=True), layout)


class HostCopy:
    """Tensors on their way to the host, started after everything queued so far on the current
    stream. `wait()` returns them once they have landed."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.event: Any = None  # torch.cuda.Event once a copy is in flight
        if not tensors or tensors[0].device.type == "cpu":
            self.tensors = list(tensors)
            return
        packed, layout = _pack(tensors, pinned=False)  # packed on the device
        if packed.device.type == "cuda":
            host = torch.empty(packed.shape, dtype=torch.uint8, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:  # another device (meta in tests): a plain copy
            host = packed.to("cpu")
        self.tensors = _unpack(host, layout)

    def wait(self) -> list[torch.Tensor]:
        # NOTE: until the event has passed, the host tensors are still being written.
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        return self.tensors


Layout = list[tuple[int, torch.dtype, torch.Size, int]]  # (index in the input, dtype, shape, bytes)


def _pack(tensors: Sequence[torch.Tensor], pinned: bool) -> tuple[torch.Tensor, Layout]:
    """One uint8 buffer holding every tensor's bytes, largest element size first."""
    order = sorted(range(len(tensors)), key=lambda i: -tensors[i].element_size())
    parts = [_bytes(tensors[i]) for i in order]
    layout = [(i, tensors[i].dtype, tensors[i].shape, p.numel()) for i, p in zip(order, parts, strict=True)]
    device = tensors[0].device
    if len(parts) == 1 and not pinned:  # one tensor (greedy results): its bytes, as they are
        return parts[0], layout
    out = torch.empty(sum(p.numel() for p in parts), dtype=torch.uint8, device=device, pin_memory=pinned)
    torch.cat(parts, out=out)
    return out, layout


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """t's elements as a flat uint8 tensor (a copy only if t is not contiguous)."""
    if t.numel() == 0:  # may carry any strides, which view() refuses
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    return t.contiguous().view(-1).view(torch.uint8)


def _unpack(packed: torch.Tensor, layout: Layout) -> list[torch.Tensor]:
    out: list[torch.Tensor] = [packed] * len(layout)
    offset = 0
    for i, dtype, shape, nbytes in layout:
        out[i] = packed[offset : offset + nbytes].view(dtype).view(shape)
        offset += nbytes
    return out
