"""Mixtral: the Llama forward with a sparse mixture of experts in every layer's MLP (top-k of
`num_local_experts`, always renormalized; runtime/models/moe.py). Its checkpoints name the
experts' gate, down and up matmuls w1, w2 and w3 under `block_sparse_moe`."""

from __future__ import annotations

from runtime.models.llama import LlamaModel
from runtime.models.mlp import FeedForward
from runtime.models.moe import load_moe
from runtime.models.weights import Weights


class MixtralModel(LlamaModel):
    def _mlp(self, w: Weights, i: int) -> FeedForward:
        moe = self.config.moe
        assert moe is not None, "a Mixtral config names num_local_experts"
        p = f"model.layers.{i}.block_sparse_moe."
        return load_moe(w, f"{p}gate.weight", f"{p}experts.", ("w1", "w3", "w2"), moe)
