"""Configuration: frozen dataclasses built once in `main` and passed down.

argparse defaults come from these fields (see `runtime.cli`), so a default lives in one place.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

MAX_BODY_BYTES = 1 << 20  # a request body's limit, on the workers and the router alike

Role = Literal["colocated", "prefill", "decode"]
LinearBackend = Literal["auto", "onednn", "torch"]  # runtime/models/linear.py


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
    fp8: FP8Weights | None = None  # the checkpoint's matmul weights are fp8 (dequantized at load)
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


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True)
class EngineConfig:
    """What the model runner needs: where the weights are and how to run them."""

    model: str = field(default="builtin:smollm2-135m", metadata=_help("HF folder or builtin:NAME"))
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = "cpu"
    attention_backend: str = field(default="auto", metadata=_help(
        "auto | cpu (native CPU decode kernel) | torch | triton (CUDA) | flashinfer (CUDA, "
        "bf16/fp16); auto: cpu on a CPU, triton on CUDA, where each runs, else torch"))
    sampler_backend: str = field(default="torch", metadata=_help("a registered sampler backend"))
    linear_backend: LinearBackend = field(
        default="auto", metadata=_help("matmuls: onednn (CPU) or torch; auto: onednn where it runs")
    )
    page_size: int = 16
    max_total_tokens: int = field(default=32768, metadata=_help("KV pool size in tokens"))
    mem_fraction_static: float | None = field(default=None, metadata=_help(
        "GPU: size the KV pool so weights + pool take this fraction of GPU memory (e.g. 0.85), "
        "instead of --max-total-tokens"))
    cuda_graph_max_bs: int = field(default=256, metadata=_help(
        "GPU: decode batches up to this size replay captured CUDA graphs"))
    disable_cuda_graph: bool = field(default=False, metadata=_help("GPU: run every decode step eagerly"))
    context_length: int | None = None  # None: the model's max_position_embeddings
    disable_prefix_cache: bool | None = field(default=None, metadata=_help(
        "free every KV page when its request ends instead of keeping it for reuse; default: "
        "the cache is on, except on a decode server (its KV arrives by transfer)"))
    num_threads: int | None = field(default=None, metadata=_help("torch threads (scheduler)"))
    quantization: Literal["none", "int8", "int4"] = field(default="none", metadata=_help(
        "CPU: weight-only matmuls, int8 per output channel or int4 per group of 32; the quantized "
        "kernel for steps of up to --quant-max-rows rows, the dequantized weights above "
        "(runtime/models/quantize.py, docs/performance.md)"))
    quant_max_rows: int = field(default=4, metadata=_help(
        "with --quantization: the most rows a step may have to take the quantized kernel (it "
        "beats fp32 only for a few rows: the crossover measured on this machine)"))
    tp: int = field(default=1, metadata={**_help(
        "tensor parallelism: split the model over this many ranks, one process each (one GPU "
        "each where there are enough; docs/tensor-parallel.md)"), "aliases": ("--tensor-parallel-size",)})
    tp_timeout_s: float = field(default=120.0, metadata=_help(
        "tensor parallelism: a collective that waits this long for a rank ends the server"))


@dataclass(frozen=True)
class SchedulerConfig:
    """CPU policy knobs of the scheduler loop."""

    max_running_requests: int = 256
    chunked_prefill_size: int = 2048
    enable_overlap: bool | None = field(default=None, metadata=_help(
        "run each forward on a thread of its own while the scheduler builds the next batch; "
        "default: on with a GPU (the host works while the device computes), off on a CPU "
        "(there the scheduler's work takes cores from the forward: docs/performance.md)"))
    # Fraction of each running request's remaining budget reserved when admitting new ones.
    new_token_ratio: float = 0.4
    stream_interval: int = field(default=1, metadata=_help("stream every N tokens"))
    # Non-streaming requests still emit every this many tokens so nothing waits for minutes.
    forced_stream_interval: int = field(
        default=64, metadata=_help("non-streaming requests still flush every N tokens")
    )

    def overlaps(self, device_type: str) -> bool:
        """Whether forwards run on their own thread on a device of this type ('cpu', 'cuda')."""
        return self.enable_overlap if self.enable_overlap is not None else device_type != "cpu"


@dataclass(frozen=True)
class CanaryConfig:
    """The KV canary and its fault injection (docs/kv-canary.md). Off by default, at no cost."""

    kv_canary: Literal["none", "log", "raise"] = field(default="none", metadata=_help(
        "check that every forward reads KV computed from its own tokens: log counts and logs "
        "violations, raise ends the offending request with an error (never the server)"))
    kv_canary_sweep: int = field(default=1, metadata=_help(
        "check the KV a decode step reads every N steps (prefill always checks)"))
    kv_canary_bytes: Literal["none", "partial", "all"] = field(default="none", metadata=_help(
        "also checksum each slot's KV bytes when written and check them when read (partial: "
        "first and last layers only)"))
    perturb: str | None = field(default=None, metadata=_help(
        "fault injection for tests, KIND=PROB[,KIND=PROB...]; kinds kv_after_forward, "
        "req_to_token, wrong_slots, next_token_swap, kv_before_send (needs --kv-canary)"))
    perturb_seed: int = field(default=0, metadata=_help("seed of the fault injection"))
    perturb_warmup_steps: int = field(default=0, metadata=_help(
        "forwards to run before injecting any fault"))

    @property
    def enabled(self) -> bool:
        return self.kv_canary != "none"


@dataclass(frozen=True)
class DisaggConfig:
    """Prefill/decode disaggregation (docs/disaggregation.md "Disaggregation flow"). Timeouts can also come
    from the environment (BATON_BOOTSTRAP_TIMEOUT_S, ...: runtime/server/args.py reads them)."""

    bootstrap_port: int = field(default=8998, metadata=_help(
        "prefill: the bootstrap server's port (decode with --move-kv-on-drain: where another "
        "decode fetches a moved request's KV; 0: any free port)"))
    kv_port: int = field(default=8999, metadata=_help(
        "decode: the KV receiver's port, where prefill servers open their links (0: any free port)"))
    cluster_key_file: str | None = field(default=None, metadata=_help(
        "file holding the deployment's shared cluster key (else $BATON_CLUSTER_KEY): room tickets, "
        "bootstrap calls and KV links are then authenticated; without one, anyone who reaches the "
        "KV ports is trusted"))
    kv_transfer: Literal["nixl", "tcp"] = field(
        default="nixl", metadata=_help("KV transfer backend; tcp is the fallback without nixl")
    )
    bootstrap_timeout_s: float = field(
        default=300.0, metadata=_help("a request waiting for its peer to show up fails after this")
    )
    waiting_timeout_s: float = field(
        default=300.0, metadata=_help("decode: a request waiting for its KV fails after this")
    )
    heartbeat_interval_s: float = field(
        default=5.0, metadata=_help("decode: how often it checks the prefill servers it waits on")
    )
    heartbeat_misses: int = field(
        default=2, metadata=_help("decode: missed heartbeats before a prefill counts as gone")
    )
    advertise_host: str | None = field(
        default=None,
        metadata=_help("address peers reach this server's KV endpoint on (default: $POD_IP, "
                       "else --host unless it is a wildcard, else this host's name)"),
    )
    move_kv_on_drain: bool = field(default=False, metadata=_help(
        "decode: when it drains (SIGTERM), hand each stream the router follows to another "
        "decode with its KV (offered on --bootstrap-port) instead of leaving the router to "
        "recompute it there"))
    allow_local_prefill: bool = field(default=False, metadata=_help(
        "decode: also serve a request that comes without bootstrap fields, prefilling it here "
        "(the router's --fallback colocated, when no prefill can take it)"))


@dataclass(frozen=True)
class ServerArgs:
    """`baton serve` flags (docs/architecture.md "CLI contract"); argparse defaults come from these fields.

    Flags are the field names, the nested configs' fields included (`engine.max_total_tokens`
    -> `--max-total-tokens`); `help` metadata is the flag's help text.
    """

    engine: EngineConfig = field(default_factory=EngineConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    disagg: DisaggConfig = field(default_factory=DisaggConfig)
    canary: CanaryConfig = field(default_factory=CanaryConfig)
    role: Role = field(default="colocated", metadata=_help("colocated, or one side of PD"))
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = field(
        default=None, metadata=_help("name clients use as `model` (default: --model; a "
                                     "builtin:NAME model is served as NAME, as in a cluster)")
    )
    plugin: tuple[str, ...] = field(
        default=(),
        metadata=_help("module imported in the scheduler process first (repeatable); it may "
                       "call register_sampler_backend"),
    )
    max_body_bytes: int = field(default=MAX_BODY_BYTES, metadata=_help("larger bodies get 413"))
    api_key: tuple[str, ...] = field(default=(), metadata=_help(
        "require `Authorization: Bearer KEY` (repeatable; also $BATON_API_KEY, comma-separated)"))
    api_key_file: str | None = field(default=None, metadata=_help(
        "keys to require, one per line; read again when it changes"))
    protect_metrics: bool = field(default=False, metadata=_help(
        "require a key for /metrics too (/health and /ready stay open)"))
    admin_api_key: str | None = field(default=None, metadata=_help(
        "with API keys on, the /debug/ views need this key (also $BATON_ADMIN_API_KEY)"))
    request_timeout_s: float = field(
        default=600.0, metadata=_help("abort a request that makes no progress this long")
    )
    startup_timeout_s: float = field(default=600.0, metadata=_help("model load + warm-up"))
    shutdown_grace_s: float = field(
        default=30.0, metadata=_help("on SIGTERM, in-flight requests get this long to finish")
    )
    stall_timeout_s: float = field(
        default=30.0, metadata=_help("/ready answers 503 once the scheduler process has been "
                                     "silent this long (frozen or stuck; it speaks every second)")
    )
    log_level: str = "info"

    @property
    def model(self) -> str:
        return self.engine.model

    @property
    def model_name(self) -> str:
        """The one name `/v1/models` lists (`builtin:` spellings are accepted as aliases)."""
        return self.served_model_name or self.engine.model.removeprefix("builtin:")

    def names_model(self, name: str) -> bool:
        """Does a request's `model` mean this server's model?"""
        return name in (self.model_name, self.engine.model)
