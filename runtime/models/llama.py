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
from safetensors import safe_open

from runtime.attention.base import AttentionBackend
from runtime.config import ModelConfig
from runtime.forward_batch import ForwardBatch
from runtime.models.linear import Linear
from runtime.models.mlp import FeedForward, GatedMLP
from runtime.models.rope import RotaryEmbedding, apply_rope

if TYPE_CHECKING:
    from runtime.models.fused import TritonOps


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: Linear  # hidden -> (H + 2 * KVH) * D, with Qwen2's biases
    o: Linear  # H * D -> hidden
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
        self, config: ModelConfig, path: Path, dtype: torch.dtype, device: str, onednn: bool = False
    ) -> None:
        """onednn: run the matmuls through oneDNN (linear.use_onednn decides where it can)."""
        self.config = config
        self.dtype = dtype
        self.onednn = onednn
        w = _load_safetensors(path, dtype, device)
        self.embed = w.pop("model.embed_tokens.weight")  # [vocab, hidden]
        self.final_norm = w.pop("model.norm.weight")
        head = w.pop("lm_head.weight", None)
        if config.tie_word_embeddings or head is None:
            head = self.embed
        self.lm_head = Linear(head, None, onednn)
        self.layers = [self._layer(w, i) for i in range(config.num_layers)]
        self.rope = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
        ).to(device, dtype)
        c = config
        self.q_size, self.kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
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
        c, t = self.config, qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return (q.view(t, c.num_heads, c.head_dim), k.view(t, c.num_kv_heads, c.head_dim),
                v.view(t, c.num_kv_heads, c.head_dim))

    def _layer(self, w: dict[str, torch.Tensor], i: int) -> LayerWeights:
        p = f"model.layers.{i}."
        attn = [w.pop(f"{p}self_attn.{n}_proj.weight") for n in "qkv"]
        biases = [w.pop(f"{p}self_attn.{n}_proj.bias", None) for n in "qkv"]
        qkv_bias = None if biases[0] is None else torch.cat(biases)  # type: ignore[arg-type]
        return LayerWeights(
            input_norm=w.pop(f"{p}input_layernorm.weight"),
            qkv=Linear(torch.cat(attn), qkv_bias, self.onednn),
            o=Linear(w.pop(f"{p}self_attn.o_proj.weight"), None, self.onednn),
            post_norm=w.pop(f"{p}post_attention_layernorm.weight"),
            mlp=self._mlp(w, i),
        )

    def _mlp(self, w: dict[str, torch.Tensor], i: int) -> FeedForward:
        """Layer i's feed-forward, its weights popped from `w`: where MoE families differ."""
        return self.gated_mlp(w, f"model.layers.{i}.mlp.")

    def gated_mlp(self, w: dict[str, torch.Tensor], p: str) -> GatedMLP:
        """The gated MLP whose gate_proj, up_proj and down_proj weights are under `p`."""
        gate_up = torch.cat([w.pop(f"{p}gate_proj.weight"), w.pop(f"{p}up_proj.weight")])
        return GatedMLP(Linear(gate_up, None, self.onednn),
                        Linear(w.pop(f"{p}down_proj.weight"), None, self.onednn))

    @torch.inference_mode()
    def forward(
        self, batch: ForwardBatch, attn: AttentionBackend, logits_rows: torch.Tensor | None
    ) -> torch.Tensor:
        """Run the new tokens; return logits [R, vocab] for `logits_rows` (all rows when None)."""
        ops, eps = self.ops, self.config.rms_norm_eps
        x = self.embed[batch.input_ids]  # [T, hidden]: the residual stream
        attn.begin(batch)
        cos_sin = self.rope.lookup(batch.positions)
        delta = None  # what the last MLP adds to x
        for i, lw in enumerate(self.layers):
            h, x = ops.add_rms_norm(x, delta, lw.input_norm, eps)
            q, k, v = self.qkv(lw, h, cos_sin)
            h, x = ops.add_rms_norm(x, lw.o(attn.forward(i, q, k, v, batch)), lw.post_norm, eps)
            delta = lw.mlp(h, ops)
        if logits_rows is not None:
            x, delta = x[logits_rows], None if delta is None else delta[logits_rows]
        h, _ = ops.add_rms_norm(x, delta, self.final_norm, eps)
        return self.lm_head(h).float()  # [R, vocab]


def _load_safetensors(path: Path, dtype: torch.dtype, device: str) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                weights[name] = st.get_tensor(name).to(device=device, dtype=dtype)
    return weights
