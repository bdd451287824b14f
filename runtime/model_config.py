"""What a checkpoint's config.json says the forward pass needs: the architecture's shapes, its
mixture of experts, its sliding windows and RoPE, its fp8 weights. Read once, frozen."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class MoEConfig:
    """A sparse mixture of experts in place of some layers' MLP (Qwen3-MoE, Mixtral)."""

    num_experts: int
    top_k: int  # experts per token
    intermediate_size: int  # each expert's
    renormalize: bool  # the top-k probabilities rescaled to sum to 1 (`norm_topk_prob`)
    sparse_layers: tuple[int, ...]  # the others keep a dense MLP of `intermediate_size`

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], num_layers: int) -> MoEConfig | None:
        """Qwen3-MoE names `num_experts` (`decoder_sparse_step`, `mlp_only_layers`,
        `moe_intermediate_size`, `norm_topk_prob`); Mixtral `num_local_experts`, every layer
        sparse, always renormalized. None: a dense model."""
        experts = raw.get("num_experts") or raw.get("num_local_experts")
        if not experts:
            return None
        step, dense = int(raw.get("decoder_sparse_step") or 1), set(raw.get("mlp_only_layers") or ())
        return cls(
            num_experts=int(experts), top_k=int(raw["num_experts_per_tok"]),
            intermediate_size=int(raw.get("moe_intermediate_size") or raw["intermediate_size"]),
            renormalize=bool(raw.get("norm_topk_prob", True)),
            sparse_layers=tuple(i for i in range(num_layers)
                                if i not in dense and (i + 1) % step == 0),
        )


class UnsupportedQuantization(ValueError):
    """A checkpoint quantized in a format baton cannot load."""


@dataclass(frozen=True)
class FP8Weights:
    """A checkpoint whose matmul weights are float8_e4m3fn with float32 scales beside them
    (runtime/models/fp8.py): per 128x128 block (`quant_method: fp8` with `weight_block_size`, the
    DeepSeek-V3 / Qwen3-FP8 format: `X.weight_scale_inv`), or per tensor or output channel
    (`fp8` without blocks, or compressed-tensors' float 8-bit weights: `X.weight_scale`)."""

    block: tuple[int, int] | None  # None: per tensor or per channel, as each scale's shape says

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> FP8Weights | None:
        """From config.json's `quantization_config` (None: not quantized); a format baton does
        not load is refused, naming it."""
        qc = raw.get("quantization_config")
        if not qc:
            return None
        method = qc.get("quant_method")
        if method == "fp8":
            block = qc.get("weight_block_size")
            return cls(tuple(block) if block else None)  # type: ignore[arg-type]
        if method == "compressed-tensors":
            groups = (qc.get("config_groups") or {}).values()
            weights = [g.get("weights") or {} for g in groups]
            if weights and all(w.get("type") == "float" and w.get("num_bits") == 8
                               and w.get("strategy") in ("tensor", "channel") for w in weights):
                return cls(None)
            raise UnsupportedQuantization(
                "compressed-tensors checkpoint with weights other than float 8-bit per tensor or "
                f"per channel ({weights}): baton loads fp8 only")
        raise UnsupportedQuantization(
            f"quantization {method!r}: baton loads fp8 checkpoints (quant_method fp8, block-wise "
            "or per tensor, and compressed-tensors fp8)")


@dataclass(frozen=True)
class ModelConfig:
    """The architecture facts the forward pass needs, read from an HF `config.json`."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    moe: MoEConfig | None = None
    fp8: FP8Weights | None = None  # the checkpoint's matmul weights are fp8 (fp8.py: kept or dequantized)
    # Per layer, how many of the latest positions a query attends to, itself included (a
    # sliding window); None: every earlier position. One entry per layer.
    sliding_windows: tuple[int | None, ...] = ()
    # RoPE of the sliding-window layers where it is not the others' (Gemma 3's local base)
    local_rope_theta: float | None = None
    local_rope_scaling: dict[str, Any] | None = None
    query_pre_attn_scalar: float | None = None  # attention scores scale by its -1/2 power (Gemma)
    attn_logit_softcap: float | None = None  # scores -> cap * tanh(scores / cap)
    final_logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap)
    hidden_act: str = "silu"  # the gated MLP's activation

    @property
    def attention_scale(self) -> float:
        """What q . k is multiplied by: head_dim ** -0.5, or Gemma's query_pre_attn_scalar's."""
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        raw = json.loads((Path(path) / "config.json").read_text())
        return cls.from_hf_dict(raw)

    @staticmethod
    def architecture_of(raw: dict[str, Any]) -> str:
        """config.json's first `architectures` entry (Llama's when it names none)."""
        archs = raw.get("architectures") or ["LlamaForCausalLM"]
        return str(archs[0])

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        raw = {**_HF_DEFAULTS.get(str(raw.get("model_type")), {}), **raw}
        arch = cls.architecture_of(raw)  # which family runs it: runtime/models/registry.py
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        num_layers = int(raw["num_hidden_layers"])
        (rope_theta, rope_scaling), (local_theta, local_scaling) = _ropes(raw)
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            # Qwen2 has biases on q/k/v; Llama has an explicit flag.
            attention_bias=bool(raw.get("attention_bias", arch == "Qwen2ForCausalLM")),
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
            moe=MoEConfig.from_hf_dict(raw, num_layers),
            fp8=FP8Weights.from_hf_dict(raw),
            sliding_windows=_sliding_windows(raw, num_layers),
            local_rope_theta=local_theta,
            local_rope_scaling=local_scaling,
            query_pre_attn_scalar=raw.get("query_pre_attn_scalar"),
            attn_logit_softcap=raw.get("attn_logit_softcapping"),
            final_logit_softcap=raw.get("final_logit_softcapping"),
            hidden_act=str(raw.get("hidden_activation") or raw.get("hidden_act") or "silu"),
        )


# What HF's config class assumes of a field a config.json leaves out, where it is not the
# default read below, by model_type (RoPE bases: _ROPE_THETA)
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3_text": {"query_pre_attn_scalar": 256, "hidden_activation": "gelu_pytorch_tanh",
                    "sliding_window": 4096, "tie_word_embeddings": True},
}
# RoPE bases where a config names none, by model_type: (global, sliding layers), HF's defaults
_ROPE_THETA: dict[str, tuple[float, float | None]] = {"gemma3_text": (1_000_000.0, 10_000.0)}
Rope = tuple[float, dict[str, Any] | None]  # (base, scaling); scaling None: plain RoPE


def _ropes(raw: dict[str, Any]) -> tuple[Rope, tuple[float | None, dict[str, Any] | None]]:
    """The RoPE of the global layers, and of the sliding-window layers where theirs differs
    ((None, None) where not). transformers >= 5 writes them under `rope_parameters`, per layer
    type where the types differ (Gemma 3: {"full_attention": ..., "sliding_attention": ...});
    before it, `rope_theta`, `rope_scaling` and Gemma 3's `rope_local_base_freq`."""
    theta, local_theta = _ROPE_THETA.get(str(raw.get("model_type")), (10000.0, None))
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    local = rope.pop("sliding_attention", None)
    full = _rope(rope.pop("full_attention", None) or rope, raw.get("rope_theta"), theta)
    if local is None and (local_theta or "rope_local_base_freq" in raw):
        local = {"rope_theta": raw.get("rope_local_base_freq", local_theta)}
    return full, _rope(local, None, 10000.0) if local else (None, None)


def _rope(params: dict[str, Any], theta: Any, default: float) -> Rope:
    """(base, scaling) of one RoPE's parameters; `theta`, where the config gives it apart, wins
    over theirs, and `default` where neither names one."""
    rope = dict(params)
    base = float(theta or rope.pop("rope_theta", default))
    kind = rope.get("rope_type", rope.get("type", "default"))
    return base, None if kind == "default" else rope


def _sliding_windows(raw: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window, by HF's rules: `layer_types` where the config lists them
    (transformers >= 5 writes them: Gemma 3, Qwen2/Qwen3 with `use_sliding_window`), else
    Gemma 3's older `sliding_window_pattern` (every n-th layer global, the others sliding),
    else Qwen2's `max_window_layers` (the layers from it on slide) or Mistral's window on
    every layer."""
    window = raw.get("sliding_window")
    context = int(raw.get("max_position_embeddings", 2048))
    if not window or window >= context or raw.get("use_sliding_window") is False:
        return (None,) * num_layers  # (a window as long as the context is none)
    if raw.get("layer_types"):
        sliding = [t == "sliding_attention" for t in raw["layer_types"]]
    elif raw.get("model_type") == "gemma3_text" or "sliding_window_pattern" in raw:
        pattern = int(raw.get("sliding_window_pattern") or 6)
        sliding = [(i + 1) % pattern != 0 for i in range(num_layers)]
    else:
        first = int(raw.get("max_window_layers") or 0) if raw.get("use_sliding_window") else 0
        sliding = [i >= first for i in range(num_layers)]
    return tuple(int(window) if s else None for s in sliding)
