"""Llama-family forward (Llama, Qwen2, Mistral) over a paged KV cache.

Plain tensors and functional ops, in the spirit of gpt-fast: q/k/v and gate/up are fused into one
matmul each; everything else follows HF's numerics (fp32 RMSNorm, rotate_half RoPE).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from runtime.attention.base import AttentionBackend
from runtime.config import ModelConfig
from runtime.engine.forward_batch import ForwardBatch
from runtime.models.rope import RotaryEmbedding, apply_rope


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [(H + 2 * KVH) * D, hidden]
    qkv_bias: torch.Tensor | None
    o: torch.Tensor  # [hidden, H * D]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 * inter, hidden]
    down: torch.Tensor  # [hidden, inter]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class LlamaModel:
    def __init__(self, config: ModelConfig, path: Path, dtype: torch.dtype, device: str) -> None:
        self.config = config
        self.dtype = dtype
        w = _load_safetensors(path, dtype, device)
        self.embed = w.pop("model.embed_tokens.weight")  # [vocab, hidden]
        self.final_norm = w.pop("model.norm.weight")
        lm_head = w.pop("lm_head.weight", None)
        self.lm_head = self.embed if config.tie_word_embeddings or lm_head is None else lm_head
        self.layers = [self._layer(w, i) for i in range(config.num_layers)]
        self.rope = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
        ).to(device, dtype)
        c = config
        self.q_size, self.kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim

    @staticmethod
    def _layer(w: dict[str, torch.Tensor], i: int) -> LayerWeights:
        p = f"model.layers.{i}."
        attn = [w.pop(f"{p}self_attn.{n}_proj.weight") for n in "qkv"]
        biases = [w.pop(f"{p}self_attn.{n}_proj.bias", None) for n in "qkv"]
        qkv_bias = None if biases[0] is None else torch.cat(biases)  # type: ignore[arg-type]
        return LayerWeights(
            input_norm=w.pop(f"{p}input_layernorm.weight"),
            qkv=torch.cat(attn).contiguous(),
            qkv_bias=qkv_bias,
            o=w.pop(f"{p}self_attn.o_proj.weight"),
            post_norm=w.pop(f"{p}post_attention_layernorm.weight"),
            gate_up=torch.cat(
                [w.pop(f"{p}mlp.gate_proj.weight"), w.pop(f"{p}mlp.up_proj.weight")]
            ).contiguous(),
            down=w.pop(f"{p}mlp.down_proj.weight"),
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
            qkv = F.linear(h, lw.qkv, lw.qkv_bias)  # [T, (H + 2KVH) * D]
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.view(t, c.num_heads, c.head_dim)
            k = k.view(t, c.num_kv_heads, c.head_dim)
            v = v.view(t, c.num_kv_heads, c.head_dim)
            q, k = apply_rope(q, cos_sin), apply_rope(k, cos_sin)
            x = x + F.linear(attn.forward(i, q, k, v, batch), lw.o)
            h = rms_norm(x, lw.post_norm, c.rms_norm_eps)
            gate, up = F.linear(h, lw.gate_up).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, lw.down)
        if logits_rows is not None:
            x = x[logits_rows]
        x = rms_norm(x, self.final_norm, c.rms_norm_eps)
        return F.linear(x, self.lm_head).float()  # [R, vocab]


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
