"""A sparse mixture of experts (Qwen3-MoE, Mixtral): each token goes to its top-k experts.

Routing follows HF: softmax over every expert's router logit in float32, the top k, rescaled to
sum to 1 where the config says so (`MoEConfig.renormalize`), cast to the activations' dtype.
Each expert is a gated MLP; a token's output is the weighted sum of its experts', added up in
expert order.

Two ways to run the experts, the same numbers:
- per expert (the CPU's): the (token, slot) pairs sorted by expert, then one matmul pair per
  active expert over its tokens: no Python loop over tokens, and the counts are read on the host
  (free on a CPU).
- grouped (CUDA, bf16/fp16): the same sorted rows through `torch._grouped_mm` with the group
  offsets computed on the device, so a step makes no host sync and can be captured in a CUDA
  graph. tests/models/test_moe.py checks it on the CPU, where `torch._grouped_mm` also runs,
  against the per-expert path; tests/gpu/test_gpu_families.py on an H100 (passed 2026-11-27:
  HF's tokens in bf16 under decode graphs, no host sync). Not yet measured for speed there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.model_config import MoEConfig
from runtime.models.mlp import GatedMLP, SmallOps
from runtime.models.weights import Weights


class SparseMoE:
    def __init__(self, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                 top_k: int, renormalize: bool, grouped: bool | None = None) -> None:
        """router [E, hidden]; gate_up [E, 2 * inter, hidden] (gate rows first); down
        [E, hidden, inter]. grouped None: on CUDA in bf16/fp16."""
        self.router, self.gate_up, self.down = router, gate_up, down
        self.num_experts, self.top_k, self.renormalize = router.shape[0], top_k, renormalize
        if grouped is None:
            grouped = gate_up.is_cuda and gate_up.dtype in (torch.bfloat16, torch.float16)
        self.grouped = grouped
        self.cuda_graph_safe = grouped  # the per-expert path reads its counts on the host
        # [E, K, N] operands for torch._grouped_mm (views, no copy)
        self.gate_up_t, self.down_t = gate_up.transpose(1, 2), down.transpose(1, 2)

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts [T, k] (int64) and their weights [T, k] (h's dtype)."""
        probs = torch.softmax(F.linear(h, self.router).float(), dim=-1)  # [T, E]
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(h.dtype)

    def __call__(self, h: torch.Tensor, ops: SmallOps) -> torch.Tensor:
        experts, weights = self.route(h)
        flat = experts.flatten()  # [T * k]: slot j of token t at t * k + j
        order = flat.argsort(stable=True)  # the pairs, grouped by expert (token order within)
        rows = order // self.top_k  # the token of each sorted pair
        scale = weights.flatten()[order, None]  # [T * k, 1]
        run = self._grouped if self.grouped else self._per_expert
        y = run(h[rows], flat, ops) * scale  # [T * k, hidden], sorted
        return torch.zeros_like(h).index_add_(0, rows, y)

    def _per_expert(self, x: torch.Tensor, flat: torch.Tensor, ops: SmallOps) -> torch.Tensor:
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # host: a CPU's
        out, start = torch.empty_like(x), 0
        for e, n in enumerate(counts):
            if n:
                part = x[start:start + n]
                act = ops.silu_mul(F.linear(part, self.gate_up[e]))
                out[start:start + n] = F.linear(act, self.down[e])
                start += n
        return out

    def _grouped(self, x: torch.Tensor, flat: torch.Tensor, ops: SmallOps) -> torch.Tensor:
        ids = torch.arange(self.num_experts, device=flat.device)
        counts = (flat[:, None] == ids).sum(dim=0)  # [E], no host sync (bincount would)
        offsets = counts.cumsum(0).to(torch.int32)  # each group's end row
        act = ops.silu_mul(torch._grouped_mm(x, self.gate_up_t, offs=offsets))
        return torch._grouped_mm(act, self.down_t, offs=offsets)


def load_qwen_moe(w: Weights, prefix: str, moe: MoEConfig) -> SparseMoE:
    """Qwen-MoE's routed experts under `prefix` (its `gate` router, `experts.j.*_proj`)."""
    return load_moe(w, f"{prefix}gate.weight", f"{prefix}experts.",
                    ("gate_proj", "up_proj", "down_proj"), moe)


def load_moe(w: Weights, router: str, experts: str, names: tuple[str, str, str],
             moe: MoEConfig) -> SparseMoE:
    """A SparseMoE from a checkpoint's per-expert weights (this rank's share of each expert's
    intermediate size: TP-MoE), taken from `w`: the router's weight
    is named `router`, expert j's `{experts}{j}.{name}.weight` for the (gate, up, down) names
    (Qwen3-MoE: mlp.experts.j.gate_proj...; Mixtral: block_sparse_moe.experts.j.w1, w3, w2)."""
    gate, up, down = names
    each = [[w.split_rows(f"{experts}{j}.{gate}.weight"), w.split_rows(f"{experts}{j}.{up}.weight"),
             w.split_cols(f"{experts}{j}.{down}.weight")] for j in range(moe.num_experts)]
    gate_up = torch.stack([torch.cat([g, u]) for g, u, _ in each])  # [E, 2 * inter, hidden]
    return SparseMoE(w.pop(router), gate_up, torch.stack([d for _, _, d in each]), moe.top_k,
                     moe.renormalize)


class SharedExpertMoE:
    """Qwen2-MoE's block: the routed experts plus a shared expert that every token takes,
    scaled by a sigmoid gate of its own: routed(h) + sigmoid(h @ gate.T) * shared(h)."""

    def __init__(self, routed: SparseMoE, shared: GatedMLP, gate: torch.Tensor) -> None:
        self.routed, self.shared, self.gate = routed, shared, gate  # gate [1, hidden]
        self.cuda_graph_safe = routed.cuda_graph_safe

    def __call__(self, h: torch.Tensor, ops: SmallOps) -> torch.Tensor:
        return self.routed(h, ops) + torch.sigmoid(F.linear(h, self.gate)) * self.shared(h, ops)
