"""ForwardBatch and ForwardOutput move between host and device through the field lists in
runtime/forward_batch.py: every tensor field must be named there, or it stays behind."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from runtime import forward_batch as fbm
from runtime.device import HostCopy, is_on, to_device


@pytest.mark.parametrize(("cls", "names"), [
    (fbm.ForwardBatch, fbm.BATCH_TENSORS),
    (fbm.SamplingBatchInfo, fbm.SAMPLING_TENSORS),
    (fbm.ForwardOutput, fbm.RESULT_TENSORS),
])
def test_every_tensor_field_travels(cls: type, names: tuple[str, ...]) -> None:
    typed = {f.name for f in dataclasses.fields(cls)
             if any(t in str(f.type) for t in ("Tensor", "PenaltyResets", "CanaryInputs"))}
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


def test_is_on_matches_a_device_spelled_without_an_index() -> None:
    """The overlap worker stages a batch, then the runner's forward_batch asks for it on
    `--device cuda` again: its tensors are on cuda:0, which torch compares unequal to "cuda".
    Staging it twice would re-pack device tensors into pinned host memory and fail."""
    cuda, cuda0, cuda1 = torch.device("cuda"), torch.device("cuda:0"), torch.device("cuda:1")
    assert cuda != cuda0  # why is_on exists
    assert is_on(cuda0, cuda) and is_on(cuda0, cuda0) and is_on(cuda1, cuda)
    assert not is_on(cuda0, cuda1) and not is_on(torch.device("cpu"), cuda)
