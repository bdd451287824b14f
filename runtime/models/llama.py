"""Llama-family forward (Llama, Qwen2, Mistral) over a paged KV cache.

Plain tensors and functional ops, in the spirit of gpt-fast: q/k/v and gate/up are fused into one
matmul each, and every matmul is a `Linear` prepared once for the device's fastest GEMM
(linear.py); everything else follows HF's numerics (fp32 RMSNorm, rotate_half RoPE).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from runtime.attention.base import AttentionBackend
from runtime.forward_batch import ForwardBatch
from runtime.model_config import ModelConfig
from runtime.models.fp8 import FP8Weight
from runtime.models.fp8_linear import build_linear
from runtime.models.linear import Linear, Matmul
from runtime.models.mlp import FeedForward, GatedMLP
from runtime.models.parallel import TensorParallel
from runtime.models.rope import RotaryEmbedding, apply_rope
from runtime.models.weights import Weights

if TYPE_CHECKING:
    from runtime.models.fused import TritonOps


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: Matmul  # hidden -> (H + 2 * KVH) * D, with Qwen2's biases
    o: Matmul  # H * D -> hidden
    post_norm: torch.Tensor  # [hidden]
    mlp: FeedForward  # dense (GatedMLP) or sparse (moe.SparseMoE)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class TorchOps:
    """The small ops between a layer's matmuls, as torch ops (HF's numerics); on CUDA the model
    runs fused.TRITON_OPS instead, one kernel each."""

    @staticmethod
    def add_rms_norm(
        x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + delta), x + delta): the residual add and the next norm."""
        if delta is not None:
            x = x + delta
        return rms_norm(x, weight, eps), x

    @staticmethod
    def rope_qk(
        q: torch.Tensor, k: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rope(q, cos_sin), apply_rope(k, cos_sin)

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


TORCH_OPS = TorchOps()


class LlamaModel:
    def __init__(
        self, config: ModelConfig, path: Path, dtype: torch.dtype, device: str, onednn: bool = False,
        tp: TensorParallel | None = None, fp8_gemm: bool = False,
    ) -> None:
        """onednn: run the matmuls through oneDNN (linear.use_onednn decides where it can).
        tp: this rank's part of the model under tensor parallelism (None: all of it).
        fp8_gemm: an fp8 checkpoint's matmuls keep their fp8 weights and run fp8 GEMMs
        (fp8_linear.py: CUDA, sm_89+); else its weights are dequantized at load."""
        self.config = config
        self.dtype = dtype
        self.onednn = onednn
        self.tp = tp = tp or TensorParallel()
        tp.check(config)
        c = config
        (h0, h1), (k0, k1) = tp.heads(c), tp.kv_heads(c)
        self.num_heads, self.num_kv_heads = h1 - h0, k1 - k0  # this rank's
        self.q_size, self.kv_size = self.num_heads * c.head_dim, self.num_kv_heads * c.head_dim
        w = Weights(path, dtype, device, tp, config.fp8, keep_fp8=fp8_gemm)
        self.vocab_rows = tp.vocab(c.vocab_size)
        self.embed = w.rows("model.embed_tokens.weight", *self.vocab_rows)  # [vocab part, hidden]
        tied = config.tie_word_embeddings or "lm_head.weight" not in w
        head = self.embed if tied else w.rows("lm_head.weight", *self.vocab_rows)
        self.lm_head = Linear(head, None, onednn)
        self.final_norm = w.pop("model.norm.weight")
        self.layers = [self._layer(w, i) for i in range(config.num_layers)]
        self.rope = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
        ).to(device, dtype)
        self.ops: TorchOps | TritonOps = TORCH_OPS
        if torch.device(device).type == "cuda":  # triton is imported only here
            from runtime.models.fused import TRITON_OPS

            self.ops = TRITON_OPS or TORCH_OPS

    @property
    def cuda_graph_safe(self) -> bool:
        """No layer syncs with the host (an MoE on its per-expert path does)."""
        return all(lw.mlp.cuda_graph_safe for lw in self.layers)

    def qkv(self, lw: LayerWeights, h: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A layer's q [T, H, D], k and v [T, KVH, D] for the normed residual `h`, RoPE
        applied: where families differ (Qwen3 norms q and k per head first)."""
        q, k, v = self.split_heads(lw.qkv(h))
        return *self.ops.rope_qk(q, k, cos_sin), v

    def split_heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[T, (H + 2KVH) * D] -> q [T, H, D], k and v [T, KVH, D]."""
        d, t = self.config.head_dim, qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return (q.view(t, self.num_heads, d), k.view(t, self.num_kv_heads, d),
                v.view(t, self.num_kv_heads, d))

    def _layer(self, w: Weights, i: int) -> LayerWeights:
        p, d = f"model.layers.{i}.", self.config.head_dim
        (h0, h1), (k0, k1) = self.tp.heads(self.config), self.tp.kv_heads(self.config)
        spans = {"q": (h0 * d, h1 * d), "k": (k0 * d, k1 * d), "v": (k0 * d, k1 * d)}
        attn = [w.matmul(f"{p}self_attn.{n}_proj.weight", rows=spans[n]) for n in "qkv"]
        biases = [w.rows(f"{p}self_attn.{n}_proj.bias", *spans[n])
                  for n in "qkv" if f"{p}self_attn.{n}_proj.bias" in w]
        return LayerWeights(
            input_norm=w.pop(f"{p}input_layernorm.weight"),
            qkv=self.linear(attn, torch.cat(biases) if biases else None, f"{p}qkv"),
            o=self.linear([w.matmul(f"{p}self_attn.o_proj.weight", cols=(h0 * d, h1 * d))], None,
                          f"{p}o_proj"),
            post_norm=w.pop(f"{p}post_attention_layernorm.weight"),
            mlp=self._mlp(w, i),
        )

    def _mlp(self, w: Weights, i: int) -> FeedForward:
        """Layer i's feed-forward, its weights taken from `w`: where MoE families differ."""
        return self.gated_mlp(w, f"model.layers.{i}.mlp.")

    def gated_mlp(self, w: Weights, p: str) -> GatedMLP:
        """The gated MLP whose gate_proj, up_proj and down_proj weights are under `p` (this
        rank's share of the intermediate size)."""
        gate_up = [w.split_matmul(f"{p}gate_proj.weight", 0), w.split_matmul(f"{p}up_proj.weight", 0)]
        return GatedMLP(self.linear(gate_up, None, f"{p}gate_up"),
                        self.linear([w.split_matmul(f"{p}down_proj.weight", 1)], None, f"{p}down"))

    def linear(self, parts: list[torch.Tensor | FP8Weight], bias: torch.Tensor | None,
               name: str) -> Matmul:
        """One matmul from its weight's parts (rows, in order); an fp8 one where they are fp8."""
        return build_linear(parts, bias, self.onednn, self.dtype, name)

    @torch.inference_mode()
    def forward(
        self, batch: ForwardBatch, attn: AttentionBackend, logits_rows: torch.Tensor | None
    ) -> torch.Tensor:
        """Run the new tokens; return logits [R, vocab] for `logits_rows` (all rows when None)."""
        ops, eps = self.ops, self.config.rms_norm_eps
        x = self.embed_tokens(batch.input_ids)  # [T, hidden]: the residual stream
        attn.begin(batch)
        cos_sin = self.rope.lookup(batch.positions)
        delta = None  # what the last MLP adds to x
        for i, lw in enumerate(self.layers):
            h, x = ops.add_rms_norm(x, delta, lw.input_norm, eps)
            q, k, v = self.qkv(lw, h, cos_sin)
            o = self.tp.all_reduce(lw.o(attn.forward(i, q, k, v, batch)))
            h, x = ops.add_rms_norm(x, o, lw.post_norm, eps)
            delta = self.tp.all_reduce(lw.mlp(h, ops))
        if logits_rows is not None:
            x, delta = x[logits_rows], None if delta is None else delta[logits_rows]
        h, _ = ops.add_rms_norm(x, delta, self.final_norm, eps)
        return self.tp.gather_vocab(self.lm_head(h).float(), self.config.vocab_size)  # [R, vocab]

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """Each token's embedding row [T, hidden]; under TP the rank holding the row gives it
        and the others add zeros (an exact sum)."""
        if self.tp.size == 1:
            return self.embed[ids]
        lo, hi = self.vocab_rows
        mine = (ids >= lo) & (ids < hi)
        x = self.embed[torch.where(mine, ids - lo, 0)] * mine.unsqueeze(-1).to(self.embed.dtype)
        return self.tp.all_reduce(x)
