"""Gemma 3, text only (`Gemma3ForCausalLM`): the Llama layer's matmuls and KV, rearranged.

What sets it apart, each as HF transformers computes it (modeling_gemma3.py):
- RMSNorm scales by (1 + w), in float32, rounded to the model's dtype once at the end; the
  checkpoint's w is stored, so the 1 is added here, once, at load.
- Four norms per layer: before attention, on the attention's output before the residual add,
  before the MLP and on the MLP's output before the residual add; q and k normed per head too.
- The embedding is scaled by sqrt(hidden) (rounded to the model's dtype), the tied lm_head not.
- The MLP is GeGLU (`gelu_pytorch_tanh`); attention scales by `query_pre_attn_scalar` ** -1/2.
- Layers alternate between sliding-window and global attention (`layer_types`, or every 6th
  layer global in older configs; ModelConfig.sliding_windows). The two kinds rotate by RoPEs of
  their own bases (`rope_local_base_freq` for the sliding layers; the config's rope scaling is
  the global layers'). The window is the attention backend's (base.py): every position's KV stays
  in the pool, sliding layers included, so the prefix cache and PD move pages as for any model.
- `final_logit_softcapping`, where set, caps the logits (cap * tanh(logits / cap)). Attention
  logit soft-capping (`attn_logit_softcapping`, set by no Gemma 3 checkpoint) is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from runtime.attention.base import AttentionBackend
from runtime.forward_batch import ForwardBatch
from runtime.model_config import ModelConfig
from runtime.models.llama import LayerWeights, LlamaModel
from runtime.models.mlp import FeedForward, GeGLU
from runtime.models.parallel import TensorParallel
from runtime.models.rope import RotaryEmbedding
from runtime.models.weights import Weights


class UnsupportedGemmaConfig(ValueError):
    pass


@dataclass
class Gemma3LayerWeights(LayerWeights):
    # every norm weight here is 1 + the checkpoint's, float32 (input_norm and post_norm too)
    q_norm: torch.Tensor  # [head_dim]
    k_norm: torch.Tensor  # [head_dim]
    pre_mlp_norm: torch.Tensor  # [hidden]
    post_mlp_norm: torch.Tensor  # [hidden]
    sliding: bool  # a sliding-window layer (its own RoPE)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., n] normed and scaled by `weight` (1 + w, float32) in float32, then rounded."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)


def _one_plus(w: torch.Tensor) -> torch.Tensor:
    return 1.0 + w.float()


class Gemma3Model(LlamaModel):
    def __init__(
        self, config: ModelConfig, path: Path, dtype: torch.dtype, device: str, onednn: bool = False,
        tp: TensorParallel | None = None, fp8_gemm: bool = False,
    ) -> None:
        if config.attn_logit_softcap is not None:
            raise UnsupportedGemmaConfig(
                f"attention logit soft-capping (attn_logit_softcapping={config.attn_logit_softcap}"
                ") is not supported: no attention backend here caps scores")
        if config.hidden_act != "gelu_pytorch_tanh":
            raise UnsupportedGemmaConfig(f"Gemma 3 with hidden_activation {config.hidden_act!r} "
                                         "is not supported (gelu_pytorch_tanh is)")
        super().__init__(config, path, dtype, device, onednn, tp, fp8_gemm)
        self.final_norm = _one_plus(self.final_norm)
        self.embed_scale = torch.tensor(config.hidden_size**0.5, dtype=dtype, device=device)
        self.local_rope = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings,
            config.local_rope_theta or config.rope_theta, config.local_rope_scaling,
        ).to(device, dtype)

    def _layer(self, w: Weights, i: int) -> LayerWeights:
        p = f"model.layers.{i}."
        base = super()._layer(w, i)
        norms = {"input_norm": _one_plus(base.input_norm), "post_norm": _one_plus(base.post_norm)}
        windows = self.config.sliding_windows
        return Gemma3LayerWeights(
            **{**vars(base), **norms},
            q_norm=_one_plus(w.pop(f"{p}self_attn.q_norm.weight")),
            k_norm=_one_plus(w.pop(f"{p}self_attn.k_norm.weight")),
            pre_mlp_norm=_one_plus(w.pop(f"{p}pre_feedforward_layernorm.weight")),
            post_mlp_norm=_one_plus(w.pop(f"{p}post_feedforward_layernorm.weight")),
            sliding=i < len(windows) and windows[i] is not None,
        )

    def _mlp(self, w: Weights, i: int) -> FeedForward:
        mlp = self.gated_mlp(w, f"model.layers.{i}.mlp.")
        return GeGLU(mlp.gate_up, mlp.down)

    def qkv(self, lw: LayerWeights, h: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        assert isinstance(lw, Gemma3LayerWeights)
        q, k, v = self.split_heads(lw.qkv(h))
        eps = self.config.rms_norm_eps
        q, k = gemma_rms_norm(q, lw.q_norm, eps), gemma_rms_norm(k, lw.k_norm, eps)  # per head
        return *self.ops.rope_qk(q, k, cos_sin), v

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return super().embed_tokens(ids) * self.embed_scale

    @torch.inference_mode()
    def forward(
        self, batch: ForwardBatch, attn: AttentionBackend, logits_rows: torch.Tensor | None
    ) -> torch.Tensor:
        eps, tp = self.config.rms_norm_eps, self.tp
        x = self.embed_tokens(batch.input_ids)  # [T, hidden]: the residual stream
        attn.begin(batch)
        ropes = {False: self.rope.lookup(batch.positions), True: self.local_rope.lookup(batch.positions)}
        for i, lw in enumerate(self.layers):
            assert isinstance(lw, Gemma3LayerWeights)
            q, k, v = self.qkv(lw, gemma_rms_norm(x, lw.input_norm, eps), ropes[lw.sliding])
            o = tp.all_reduce(lw.o(attn.forward(i, q, k, v, batch)))
            x = x + gemma_rms_norm(o, lw.post_norm, eps)
            delta = tp.all_reduce(lw.mlp(gemma_rms_norm(x, lw.pre_mlp_norm, eps), self.ops))
            x = x + gemma_rms_norm(delta, lw.post_mlp_norm, eps)
        if logits_rows is not None:
            x = x[logits_rows]
        logits = self.lm_head(gemma_rms_norm(x, self.final_norm, eps))  # [R, this rank's vocab]
        cap = self.config.final_logit_softcap
        if cap is not None:  # in the model's dtype, as HF
            logits = torch.tanh(logits / cap) * cap
        return tp.gather_vocab(logits.float(), self.config.vocab_size)  # [R, vocab]
