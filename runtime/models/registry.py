"""Which model runs a checkpoint: a registry keyed by its config.json `architectures`.

A family is one module under runtime/models/ (its forward over the paged KV cache) and the HF
architecture names it runs. The engine asks `build_model` for the model; `baton serve` asks
`check_architecture` before it starts anything, so a checkpoint no family runs is refused at
start-up with the list of those that are. Adding a family is one entry here, its module and its
test (equal greedy tokens with HF transformers). The model classes are imported only when a model
is built: the registry itself needs no torch (the HTTP process and the router read it).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from runtime.model_config import ModelConfig

if TYPE_CHECKING:
    import torch

    from runtime.attention.base import AttentionBackend
    from runtime.forward_batch import ForwardBatch
    from runtime.models.parallel import TensorParallel


class CausalLM(Protocol):
    """What the engine needs of a model: its config, and the forward that runs a batch's new
    tokens over the paged KV cache and returns the logits of `logits_rows` ([R, vocab]; every
    row when None)."""

    config: ModelConfig
    num_kv_heads: int  # the KV heads this rank holds (all of them without TP)

    @property
    def cuda_graph_safe(self) -> bool:
        """Its forward makes no host sync: decode steps can be captured in a CUDA graph."""

    def forward(self, batch: ForwardBatch, attn: AttentionBackend,
                logits_rows: torch.Tensor | None) -> torch.Tensor: ...


# (config, checkpoint folder, dtype, device, matmuls through oneDNN, this rank's part) -> the
# loaded model
# (config, path, dtype, device, onednn, tp, fp8_gemm) -> the model
ModelFactory = Callable[[ModelConfig, Path, "torch.dtype", str, bool, "TensorParallel", bool],
                        CausalLM]


def _llama() -> ModelFactory:
    from runtime.models.llama import LlamaModel

    return LlamaModel


def _qwen3() -> ModelFactory:
    from runtime.models.qwen3 import Qwen3Model

    return Qwen3Model


def _mixtral() -> ModelFactory:
    from runtime.models.mixtral import MixtralModel

    return MixtralModel


def _qwen2_moe() -> ModelFactory:
    from runtime.models.qwen2_moe import Qwen2MoeModel

    return Qwen2MoeModel


def _gemma3() -> ModelFactory:
    from runtime.models.gemma3 import Gemma3Model

    return Gemma3Model


@dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]  # config.json `architectures[0]` values it runs
    factory: Callable[[], ModelFactory]  # imports the family's module on use


FAMILIES: tuple[Family, ...] = (
    Family("llama", ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"), _llama),
    Family("qwen3", ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"), _qwen3),
    Family("mixtral", ("MixtralForCausalLM",), _mixtral),
    Family("qwen2_moe", ("Qwen2MoeForCausalLM",), _qwen2_moe),
    Family("gemma3", ("Gemma3ForCausalLM",), _gemma3),  # text only
)


class UnsupportedArchitecture(ValueError):
    pass


def supported() -> list[str]:
    return sorted(a for f in FAMILIES for a in f.architectures)


def family_of(architecture: str) -> Family:
    for family in FAMILIES:
        if architecture in family.architectures:
            return family
    raise UnsupportedArchitecture(
        f"unsupported architecture {architecture!r}: baton runs {', '.join(supported())}")


def check_architecture(model_path: Path, tp: int = 1) -> Family:
    """The family that runs the checkpoint in `model_path` (UnsupportedArchitecture if none),
    split over `tp` ranks (TPConfigError if its head counts do not divide)."""
    from runtime.models.parallel import TensorParallel

    raw: dict[str, Any] = json.loads((model_path / "config.json").read_text())
    family = family_of(ModelConfig.architecture_of(raw))
    TensorParallel(0, tp).check(ModelConfig.from_hf_dict(raw))
    return family


def build_model(config: ModelConfig, path: Path, dtype: torch.dtype, device: str,
                onednn: bool, tp: TensorParallel, fp8_gemm: bool = False) -> CausalLM:
    """The model of `config.architecture`'s family with the checkpoint's weights loaded (this
    rank's part of them under tensor parallelism; an fp8 checkpoint's matmul weights kept in
    fp8 with `fp8_gemm`, else dequantized)."""
    return family_of(config.architecture).factory()(config, path, dtype, device, onednn, tp,
                                                    fp8_gemm)
