"""ForwardBatch and ForwardOutput move between host and device through the field lists in
runtime/forward_batch.py: every tensor field must be named there, or it stays behind."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from runtime import forward_batch as fbm
from runtime.device import HostCopy, to_device


@pytest.mark.parametrize(("cls", "names"), [
    (fbm.ForwardBatch, fbm.BATCH_TENSORS),
    (fbm.SamplingBatchInfo, fbm.SAMPLING_TENSORS),
    (fbm.ForwardOutput, fbm.RESULT_TENSORS),
])
def test_every_tensor_field_travels(cls: type, names: tuple[str, ...]) -> None:
    typed = {f.name for f in dataclasses.fields(cls)
             if "Tensor" in str(f.type) or "PenaltyResets" in str(f.type)}
    assert typed == set(names)


def test_packing_keeps_every_dtype_shape_and_value() -> None:
    """to_device/HostCopy pack by element size; on `meta` the packing runs for real (the copy
    itself needs a GPU), and on the CPU both are the identity."""
    tensors = [torch.arange(5, dtype=torch.int64), torch.tensor([True, False, True]),
               torch.rand(2, 3), torch.zeros(0, dtype=torch.int64).view(0, 2)[:, 0],
               torch.arange(4, dtype=torch.int32), torch.tensor([1.5], dtype=torch.float64)]
    moved = to_device(tensors, torch.device("meta"))
    assert [(t.dtype, t.shape, t.device.type) for t in moved] == [
        (t.dtype, t.shape, "meta") for t in tensors]
    assert to_device(tensors, torch.device("cpu")) == tensors
    from runtime.device import _pack, _unpack

    packed, layout = _pack(tensors, pinned=False)
    assert packed.numel() == sum(t.numel() * t.element_size() for t in tensors)
    for before, after in zip(tensors, _unpack(packed, layout), strict=True):
        assert torch.equal(before, after)
    assert HostCopy(tensors).wait() == tensors
