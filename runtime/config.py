"""Configuration: frozen dataclasses built once in `main` and passed down.

argparse defaults come from these fields (see `runtime.cli`), so a default lives in one place.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

Role = Literal["colocated", "prefill", "decode"]
LinearBackend = Literal["auto", "onednn", "torch"]  # runtime/models/linear.py


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

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        raw = json.loads((Path(path) / "config.json").read_text())
        return cls.from_hf_dict(raw)

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        archs = raw.get("architectures") or ["LlamaForCausalLM"]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r}; baton runs {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        # transformers >= 5 writes rope settings under `rope_parameters`.
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope_theta = float(raw.get("rope_theta") or rope.pop("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=None if rope_type == "default" else rope,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            # Qwen2 has biases on q/k/v; Llama has an explicit flag.
            attention_bias=bool(raw.get("attention_bias", arch == "Qwen2ForCausalLM")),
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
        )


SUPPORTED_ARCHITECTURES = frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"})


@dataclass(frozen=True)
class EngineConfig:
    """What the model runner needs: where the weights are and how to run them."""

    model: str = "builtin:smollm2-135m"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = "cpu"
    attention_backend: str = "auto"  # auto: "cpu" where it runs, else "torch"
    sampler_backend: str = "torch"
    linear_backend: LinearBackend = "auto"
    page_size: int = 16
    max_total_tokens: int = 32768
    context_length: int | None = None  # None: the model's max_position_embeddings
    num_threads: int | None = None  # torch intra-op threads; None: torch's default


@dataclass(frozen=True)
class SchedulerConfig:
    """CPU policy knobs of the scheduler loop."""

    max_running_requests: int = 256
    chunked_prefill_size: int = 2048
    enable_overlap: bool = True
    # Fraction of each running request's remaining budget reserved when admitting new ones.
    new_token_ratio: float = 0.4
    stream_interval: int = 1
    # Non-streaming requests still emit every this many tokens so nothing waits for minutes.
    forced_stream_interval: int = 64


@dataclass(frozen=True)
class ServerArgs:
    """`baton serve` flags (DESIGN.md "CLI contract"); argparse defaults come from these fields.

    Field names are the flags (`max_total_tokens` -> `--max-total-tokens`); `help` metadata is
    the flag's help text.
    """

    model: str = field(default="builtin:smollm2-135m", metadata={"help": "HF folder or builtin:NAME"})
    role: Role = field(default="colocated", metadata={"help": "colocated serves; prefill|decode: later"})
    host: str = "127.0.0.1"
    port: int = 8000
    bootstrap_port: int = 8998
    kv_transfer: Literal["nixl", "tcp"] = "nixl"
    served_model_name: str | None = field(
        default=None, metadata={"help": "name clients use as `model` (default: --model)"}
    )
    max_running_requests: int = 256
    max_total_tokens: int = field(default=32768, metadata={"help": "KV pool size in tokens"})
    chunked_prefill_size: int = 2048
    enable_overlap: bool = True
    stream_interval: int = field(default=1, metadata={"help": "stream every N tokens"})
    forced_stream_interval: int = field(
        default=64, metadata={"help": "non-streaming requests still flush every N tokens"}
    )
    context_length: int | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = "cpu"
    page_size: int = 16
    attention_backend: str = field(
        default="auto", metadata={"help": "torch | cpu (native decode kernel) | auto: cpu where it runs"}
    )
    sampler_backend: str = field(default="torch", metadata={"help": "a registered sampler backend"})
    linear_backend: LinearBackend = field(
        default="auto", metadata={"help": "matmuls: onednn (CPU) or torch; auto: onednn where it runs"}
    )
    plugin: tuple[str, ...] = field(
        default=(),
        metadata={"help": "module imported in the scheduler process first (repeatable); it may "
                  "call register_sampler_backend"},
    )
    num_threads: int | None = field(default=None, metadata={"help": "torch threads (scheduler)"})
    max_body_bytes: int = field(default=1 << 20, metadata={"help": "larger bodies get 413"})
    request_timeout_s: float = field(
        default=600.0, metadata={"help": "abort a request that makes no progress this long"}
    )
    startup_timeout_s: float = field(default=600.0, metadata={"help": "model load + warm-up"})
    shutdown_grace_s: float = field(
        default=30.0, metadata={"help": "on SIGTERM, in-flight requests get this long to finish"}
    )
    log_level: str = "info"

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=self.model,
            dtype=self.dtype,
            device=self.device,
            attention_backend=self.attention_backend,
            sampler_backend=self.sampler_backend,
            linear_backend=self.linear_backend,
            page_size=self.page_size,
            max_total_tokens=self.max_total_tokens,
            context_length=self.context_length,
            num_threads=self.num_threads,
        )

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            max_running_requests=self.max_running_requests,
            chunked_prefill_size=self.chunked_prefill_size,
            enable_overlap=self.enable_overlap,
            stream_interval=self.stream_interval,
            forced_stream_interval=self.forced_stream_interval,
        )
