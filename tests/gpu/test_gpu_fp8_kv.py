"""On a GPU, fp8 KV pages (--kv-cache-dtype fp8_e4m3) through the triton kernels and the real
flashinfer (kv_data_type float8_e4m3fn, k_scale/v_scale per layer): a bf16 model's extend and
decode over the scene of tests/attention/test_fp8_backends.py (random fp8 bytes under a K and a
V scale of their own in each layer, a cached prefix, scattered pages) give the torch backend's
outputs within bf16's tolerance, and write the same bytes. The CPU runs the same scene through
the Triton interpreter and a stand-in for flashinfer. Not yet run on a GPU."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.attention.test_fp8_backends import Outputs, run
from tests.gpu.conftest import GPU

pytestmark = GPU
BF16_TOLERANCE = 2e-2  # ||out - torch's|| / ||torch's||, as tests/attention/test_triton_kernels.py


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    err = (got.double() - want.double()).norm() / want.double().norm()
    assert err < BF16_TOLERANCE, f"relative error {err:.2e}"


@pytest.mark.parametrize("name", ["triton", "flashinfer"])
def test_fp8_pages_on_cuda_read_as_the_torch_backend_reads_them(name: str) -> None:
    if importlib.util.find_spec(name) is None:
        pytest.skip(f"{name} is not installed")
    if name == "triton" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("triton reads fp8 KV pages on sm_89 or later (it refuses them before)")
    want: Outputs = run("torch", "cuda", torch.bfloat16)
    got = run(name, "cuda", torch.bfloat16)
    close(got.extended, want.extended)
    close(got.decoded, want.decoded)
    assert torch.equal(got.pool.buffer.view(torch.uint8), want.pool.buffer.view(torch.uint8))
