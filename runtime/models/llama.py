"""Llama-family forward (Llama, Qwen2, Mistral) over a paged KV cache.

Plain tensors and functional ops, in the spirit of gpt-fast: q/k/v and gate/up are fused into one
matmul each, and every matmul is a `Linear` prepared once for the device's fastest GEMM
(linear.py); everything else follows HF's numerics (fp32 RMSNorm, rotate_half RoPE).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from runtime.attention.base import AttentionBackend
from runtime.config import ModelConfig
from runtime.forward_batch import ForwardBatch
from runtime.models.linear import Linear
from runtime.models.rope import RotaryEmbedding, apply_rope


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: Linear  # hidden -> (H + 2 * KVH) * D, with Qwen2's biases
    o: Linear  # H * D -> hidden
    post_norm: torch.Tensor  # [hidden]
    gate_up: Linear  # hidden -> 2 * inter
    down: Linear  # inter -> hidden


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


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

    def _layer(self, w: dict[str, torch.Tensor], i: int) -> LayerWeights:
        p = f"model.layers.{i}."
        attn = [w.pop(f"{p}self_attn.{n}_proj.weight") for n in "qkv"]
        biases = [w.pop(f"{p}self_attn.{n}_proj.bias", None) for n in "qkv"]
        qkv_bias = None if biases[0] is None else torch.cat(biases)  # type: ignore[arg-type]
        gate_up = [w.pop(f"{p}mlp.{n}_proj.weight") for n in ("gate", "up")]
        return LayerWeights(
            input_norm=w.pop(f"{p}input_layernorm.weight"),
            qkv=Linear(torch.cat(attn), qkv_bias, self.onednn),
            o=Linear(w.pop(f"{p}self_attn.o_proj.weight"), None, self.onednn),
            post_norm=w.pop(f"{p}post_attention_layernorm.weight"),
            gate_up=Linear(torch.cat(gate_up), None, self.onednn),
            down=Linear(w.pop(f"{p}mlp.down_proj.weight"), None, self.onednn),
        )

    @torch.inference_mode()
    def forward(
        self, batch: ForwardBatch, attn: AttentionBackend, logits_rows: torch.Tensor | None
    ) -> torch.Tensor:
        """Run the new tokens; return logits [R, vocab] for `logits_rows` (all rows when None)."""
        c = self.config
        t = batch.input_ids.shape[0]
        x = self.embed[batch.input_ids]  # [T, hidden]
        attn.begin(batch)
        cos_sin = self.rope.lookup(batch.positions)
        for i, lw in enumerate(self.layers):
            h = rms_norm(x, lw.input_norm, c.rms_norm_eps)
            qkv = lw.qkv(h)  # [T, (H + 2KVH) * D]
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.view(t, c.num_heads, c.head_dim)
            k = k.view(t, c.num_kv_heads, c.head_dim)
            v = v.view(t, c.num_kv_heads, c.head_dim)
            q, k = apply_rope(q, cos_sin), apply_rope(k, cos_sin)
            x = x + lw.o(attn.forward(i, q, k, v, batch))
            h = rms_norm(x, lw.post_norm, c.rms_norm_eps)
            gate, up = lw.gate_up(h).chunk(2, dim=-1)
            x = x + lw.down(F.silu(gate) * up)
        if logits_rows is not None:
            x = x[logits_rows]
        x = rms_norm(x, self.final_norm, c.rms_norm_eps)
        return self.lm_head(x).float()  # [R, vocab]


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
