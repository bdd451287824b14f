"""Qwen3, dense and MoE: the Llama forward with each head's q and k RMS-normed before RoPE, and
in Qwen3-MoE a sparse mixture of experts in place of the MLP of the layers its config names
(`decoder_sparse_step`, `mlp_only_layers`; runtime/models/moe.py).

What else sets Qwen3 apart is config, which ModelConfig reads for every family: `head_dim` apart
from hidden / heads (Qwen3-0.6B: 16 heads of 128 over a hidden size of 1024), no q/k/v biases,
tied or untied embeddings. The norms' weights are [head_dim], one per layer for q and one for k.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.models.llama import LayerWeights, LlamaModel, rms_norm
from runtime.models.mlp import FeedForward
from runtime.models.moe import load_qwen_moe
from runtime.models.weights import Weights


@dataclass
class Qwen3LayerWeights(LayerWeights):
    q_norm: torch.Tensor  # [head_dim]
    k_norm: torch.Tensor  # [head_dim]


class Qwen3Model(LlamaModel):
    def _layer(self, w: Weights, i: int) -> LayerWeights:
        p = f"model.layers.{i}.self_attn."
        base = super()._layer(w, i)
        return Qwen3LayerWeights(**vars(base), q_norm=w.pop(f"{p}q_norm.weight"),
                                 k_norm=w.pop(f"{p}k_norm.weight"))

    def _mlp(self, w: Weights, i: int) -> FeedForward:
        moe = self.config.moe
        if moe is None or i not in moe.sparse_layers:
            return super()._mlp(w, i)
        return load_qwen_moe(w, f"model.layers.{i}.mlp.", moe)

    def qkv(self, lw: LayerWeights, h: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        assert isinstance(lw, Qwen3LayerWeights)
        q, k, v = self.split_heads(lw.qkv(h))
        eps = self.config.rms_norm_eps
        q, k = rms_norm(q, lw.q_norm, eps), rms_norm(k, lw.k_norm, eps)  # per head, fp32 inside
        return *self.ops.rope_qk(q, k, cos_sin), v
