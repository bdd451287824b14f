"""Configuration: frozen dataclasses built once in `main` and passed down.

argparse defaults come from these fields (see `runtime.cli`), so a default lives in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

MAX_BODY_BYTES = 1 << 20  # a request body's limit, on the workers and the router alike

Role = Literal["colocated", "prefill", "decode"]
LinearBackend = Literal["auto", "onednn", "torch"]  # runtime/models/linear.py


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
    quantization: Literal["none", "int8", "int4", "fp8"] = field(default="none", metadata=_help(
        "CPU: weight-only matmuls, int8 per output channel or int4 per group of 32; the quantized "
        "kernel for steps of up to --quant-max-rows rows, the dequantized weights above "
        "(runtime/models/quantize.py, docs/performance.md). CUDA (sm_89+): fp8, the matmul "
        "weights in fp8 per output channel, activations per token, torch._scaled_mm "
        "(runtime/models/fp8_linear.py)"))
    kv_cache_dtype: Literal["auto", "fp8_e4m3"] = field(default="auto", metadata=_help(
        "the KV pool's dtype: auto, the model's; fp8_e4m3, float8_e4m3fn pages with one scale per "
        "layer for K and one for V (the checkpoint's k_scale/v_scale, else 1.0): twice the "
        "tokens in the same bytes; attention: torch (runtime/kvcache/fp8.py)"))
    fp8_gemm: Literal["auto", "off"] = field(default="auto", metadata=_help(
        "an fp8 checkpoint's matmuls: auto keeps its weights in fp8 and runs fp8 GEMMs on CUDA "
        "at sm_89+ (elsewhere dequantized at load); off dequantizes them at load everywhere"))
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
    revision: str | None = field(default=None, metadata=_help(
        "the deployment revision: a prefill and a decode pair, and KV moves, only within one "
        "(also $BATON_REVISION; default: a digest of the runtime's code, the model, dtype, KV "
        "cache dtype and quantization: runtime/revision.py)"))

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
