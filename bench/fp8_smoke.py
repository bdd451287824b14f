"""A GPU smoke check of the fp8 GEMMs (runtime/models/fp8_linear.py) against float64, without a
model: `python bench/fp8_smoke.py` on a CUDA machine at sm_89+. Prints one line per case."""

from __future__ import annotations

import torch

from runtime.models.fp8 import FP8Weight
from runtime.models.fp8_linear import FP8Linear, fp8_gemms_run


def main() -> None:
    assert fp8_gemms_run("cuda"), torch.cuda.get_device_capability()
    gen = torch.Generator().manual_seed(0)
    for m, n, k in ((1, 192, 320), (37, 320, 192), (300, 2048, 4096)):
        x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
        for group in (None, 128):
            weight = FP8Weight.quantize(w)
            if group is not None:
                groups = -(-k // 128)
                weight = FP8Weight(weight.data, weight.scale.expand(n, groups).contiguous(), 128)
            lin = FP8Linear(weight.to("cuda"), None)
            for dtype in (torch.bfloat16, torch.float32):
                out = lin(x.to("cuda", dtype)).double().cpu()
                exact = x.double() @ weight.dequantize().double().T
                rel = float((out - exact).norm() / exact.norm())
                print(f"m={m} n={n} k={k} group={group} {dtype}: {lin.gemm.__name__} "
                      f"rel err {rel:.3e}", flush=True)
                assert rel < 0.05


if __name__ == "__main__":
    main()
