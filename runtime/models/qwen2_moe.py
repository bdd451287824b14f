"""Qwen2-MoE: the Llama forward (with Qwen2's q/k/v biases) whose sparse layers are routed
experts plus a shared expert every token takes, behind a sigmoid gate (moe.SharedExpertMoE).
Which layers are sparse, and whether the top-k weights are rescaled, comes from the config as
for Qwen3-MoE (`decoder_sparse_step`, `mlp_only_layers`, `norm_topk_prob`)."""

from __future__ import annotations

from runtime.models.llama import LlamaModel
from runtime.models.mlp import FeedForward
from runtime.models.moe import SharedExpertMoE, load_qwen_moe
from runtime.models.weights import Weights


class Qwen2MoeModel(LlamaModel):
    def _mlp(self, w: Weights, i: int) -> FeedForward:
        moe = self.config.moe
        if moe is None or i not in moe.sparse_layers:
            return super()._mlp(w, i)
        p = f"model.layers.{i}.mlp."
        return SharedExpertMoE(load_qwen_moe(w, p, moe), self.gated_mlp(w, f"{p}shared_expert."),
                               w.pop(f"{p}shared_expert_gate.weight"))
