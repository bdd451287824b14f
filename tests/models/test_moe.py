"""The sparse MoE layer: its two ways of running the experts agree, its routing is HF's rule,
and MoEConfig reads which layers are sparse from either family's config."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runtime.model_config import MoEConfig
from runtime.models.llama import TORCH_OPS
from runtime.models.moe import SparseMoE


def _moe(experts: int, top_k: int, renormalize: bool, dtype: torch.dtype,
         grouped: bool) -> SparseMoE:
    g = torch.Generator().manual_seed(3)
    hidden, inter = 32, 24

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    return SparseMoE(rand(experts, hidden), rand(experts, 2 * inter, hidden) / 4,
                     rand(experts, hidden, inter) / 4, top_k, renormalize, grouped=grouped)


def _reference(moe: SparseMoE, h: torch.Tensor) -> torch.Tensor:
    """Token by token, expert by expert, straight from the definition."""
    out = torch.zeros_like(h, dtype=torch.float64)
    probs = torch.softmax(h.double() @ moe.router.double().T, dim=-1)
    for t in range(h.shape[0]):
        weights, experts = probs[t].topk(moe.top_k)
        if moe.renormalize:
            weights = weights / weights.sum()
        for w, e in zip(weights, experts.tolist(), strict=True):
            gate, up = (moe.gate_up[e].double() @ h[t].double()).chunk(2)
            out[t] += w * (moe.down[e].double() @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("rows", [1, 5, 40])  # a decode step's few tokens to a prefill's many
def test_both_paths_equal_the_definition(renormalize: bool, rows: int) -> None:
    h = torch.randn(rows, 32, generator=torch.Generator().manual_seed(rows))
    per_expert = _moe(6, 2, renormalize, torch.float32, grouped=False)
    grouped = _moe(6, 2, renormalize, torch.float32, grouped=True)  # torch._grouped_mm, on CPU
    want = _reference(per_expert, h)
    got = per_expert(h, TORCH_OPS)
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(grouped(h, TORCH_OPS), got, atol=1e-5, rtol=1e-5)
    assert grouped.cuda_graph_safe and not per_expert.cuda_graph_safe  # (.tolist() syncs)


def test_grouped_in_bf16_matches_per_expert() -> None:
    h = torch.randn(24, 32, generator=torch.Generator().manual_seed(7)).bfloat16()
    a = _moe(8, 2, True, torch.bfloat16, grouped=True)(h, TORCH_OPS)
    b = _moe(8, 2, True, torch.bfloat16, grouped=False)(h, TORCH_OPS)
    torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)


def test_an_expert_no_token_picks_is_skipped() -> None:
    moe = _moe(4, 1, True, torch.float32, grouped=False)
    h = torch.randn(9, 32, generator=torch.Generator().manual_seed(1)).abs()
    moe.router[2:] = -1.0  # against a positive h: experts 2 and 3 never win
    moe.router[:2] = torch.rand(2, 32, generator=torch.Generator().manual_seed(2))
    experts, _ = moe.route(h)
    assert set(experts.flatten().tolist()) <= {0, 1}
    torch.testing.assert_close(moe(h, TORCH_OPS).double(), _reference(moe, h), atol=1e-4,
                               rtol=1e-4)


def test_moe_config_from_either_family() -> None:
    qwen = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
            "intermediate_size": 256, "norm_topk_prob": False, "decoder_sparse_step": 2,
            "mlp_only_layers": [3]}
    got = MoEConfig.from_hf_dict(qwen, 6)
    assert got == MoEConfig(8, 2, 64, False, (1, 5))  # every 2nd layer, but not layer 3
    mixtral = {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 96}
    assert MoEConfig.from_hf_dict(mixtral, 3) == MoEConfig(4, 2, 96, True, (0, 1, 2))
    assert MoEConfig.from_hf_dict({"intermediate_size": 96}, 3) is None


@pytest.mark.parametrize("grouped", [False, True])
def test_every_token_to_one_expert(grouped: bool) -> None:
    moe = _moe(4, 1, False, torch.float32, grouped=grouped)
    h = torch.randn(7, 32, generator=torch.Generator().manual_seed(4)).abs()
    moe.router[:] = -1.0
    moe.router[3] = 1.0  # expert 3 wins every token; the other groups are empty
    experts, _ = moe.route(h)
    assert experts.flatten().tolist() == [3] * 7
    torch.testing.assert_close(moe(h, TORCH_OPS).double(), _reference(moe, h), atol=1e-4,
                               rtol=1e-4)
