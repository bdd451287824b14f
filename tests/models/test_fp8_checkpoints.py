"""FP8 checkpoints in the formats users have (runtime/models/fp8.py): block-wise fp8 (quant_method
fp8, weight_block_size [128, 128], `weight_scale_inv`: the DeepSeek-V3 / Qwen3-FP8 format), and
per-channel and per-tensor fp8 (compressed-tensors, `weight_scale`). A test writes each from a
tiny HF model (its matmul weights quantized as the format says, partial blocks included), and
the same model with those weights dequantized to float32 as an ordinary checkpoint: baton on the
fp8 checkpoint equals baton on the dequantized one exactly (tokens and logprobs), which equals HF
on it; also split over 2 ranks. A quantization baton cannot load is refused, naming it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime import Engine
from runtime.model_config import FP8Weights, ModelConfig, UnsupportedQuantization
from runtime.models.registry import check_architecture
from tests.engine.hf_reference import PROMPTS, compare, hf_greedy
from tests.models.checkpoints import SHAPE, write_checkpoint, write_family

pytestmark = pytest.mark.timeout(300)
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
# q/k/v/o and the MLPs (dense and experts); not the embedding, lm_head, norms or MoE router
QUANTIZED = ("_proj.weight", ".w1.weight", ".w2.weight", ".w3.weight")
FORMATS: dict[str, dict[str, Any]] = {
    "block": {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"},
    "channel": {"quant_method": "compressed-tensors", "format": "float-quantized",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                    "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}}},
                "ignore": ["lm_head"]},
    "tensor": {"quant_method": "compressed-tensors", "format": "float-quantized",
               "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                   "num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True}}},
               "ignore": ["lm_head"]},
}


def _quantize(w: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp8 weight, its scales as the format stores them, the weight they stand for in float32:
    computed here, not by the code under test)."""
    w = w.float()
    if fmt == "block":
        rows, cols = -(-w.shape[0] // 128), -(-w.shape[1] // 128)
        padded = torch.zeros(rows * 128, cols * 128)
        padded[: w.shape[0], : w.shape[1]] = w
        amax = padded.view(rows, 128, cols, 128).abs().amax(dim=(1, 3))
        scale = amax.clamp(min=1e-12) / FP8_MAX
        grid = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[: w.shape[0], : w.shape[1]]
    else:
        amax = w.abs().amax(dim=1, keepdim=True) if fmt == "channel" else w.abs().amax().reshape(1)
        scale = amax.clamp(min=1e-12) / FP8_MAX
        grid = scale.expand_as(w)
    q = (w / grid).to(torch.float8_e4m3fn)
    return q, scale, q.float() * grid


def write_fp8(src: Path, fmt: str, fp8_dest: Path, plain_dest: Path) -> None:
    """`src` quantized as `fmt` into fp8_dest, and dequantized back to float32 into plain_dest."""
    tensors = {k: v for f in sorted(src.glob("*.safetensors")) for k, v in load_file(f).items()}
    quantized, plain = {}, {}
    for name, w in tensors.items():
        if name.endswith(QUANTIZED):
            q, s, plain[name] = _quantize(w, fmt)
            quantized[name], quantized[name + ("_scale_inv" if fmt == "block" else "_scale")] = q, s
        else:
            quantized[name] = plain[name] = w
    config = json.loads((src / "config.json").read_text())
    for dest, weights, extra in ((fp8_dest, quantized, {"quantization_config": FORMATS[fmt]}),
                                 (plain_dest, plain, {})):
        dest.mkdir(parents=True)
        for f in src.iterdir():
            if f.suffix != ".safetensors" and f.name != "config.json":
                (dest / f.name).write_bytes(f.read_bytes())
        save_file(weights, str(dest / "model.safetensors"), metadata={"format": "pt"})
        (dest / "config.json").write_text(json.dumps({**config, **extra}))


def _generate(path: Path, ids: list[list[int]], **options: Any) -> list[dict[str, Any]]:
    engine = Engine(model=str(path), max_total_tokens=4096, **options)
    try:
        return engine.generate(ids, {"temperature": 0, "max_new_tokens": 16},  # type: ignore[no-any-return]
                               return_logprob=True)
    finally:
        engine.shutdown()


@pytest.mark.parametrize(("family", "fmt"), [("llama", "block"), ("llama", "channel"),
                                             ("llama", "tensor"), ("qwen3-moe", "block")])
def test_an_fp8_checkpoint_equals_its_dequantized_weights(family: str, fmt: str, model_path: Path,
                                                          tmp_path: Path) -> None:
    if family == "llama":  # 192 x 320: blocks of 128 that do not divide either
        src = write_checkpoint("LlamaConfig", tmp_path / "src", model_path,
                               **dict(SHAPE, hidden_size=192, intermediate_size=320,
                                      num_attention_heads=6, num_key_value_heads=2))
    else:
        src = write_family(family, tmp_path / "src", model_path)
    write_fp8(src, fmt, tmp_path / "fp8", tmp_path / "plain")
    assert ModelConfig.from_dir(tmp_path / "fp8").fp8 == FP8Weights(
        (128, 128) if fmt == "block" else None)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src)
    ids = [tok.encode(p) for p in PROMPTS[:3]]
    fp8, plain = _generate(tmp_path / "fp8", ids), _generate(tmp_path / "plain", ids)
    for a, b in zip(fp8, plain, strict=True):
        assert a["output_ids"] == b["output_ids"]
        assert a["meta_info"]["output_token_logprobs"] == b["meta_info"]["output_token_logprobs"]
    refs = hf_greedy(tmp_path / "plain", ids, 16)
    for out, ref in zip(plain, refs, strict=True):
        assert compare(out["output_ids"], ref) is None
    if fmt == "block" and family == "llama":  # each rank's part of a dequantized fp8 weight
        for out, ref in zip(_generate(tmp_path / "fp8", ids, tp=2), refs, strict=True):
            assert compare(out["output_ids"], ref) is None


@pytest.mark.parametrize("qc", [
    {"quant_method": "gptq", "bits": 4},
    {"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {
        "num_bits": 4, "type": "int", "strategy": "group"}}}},
])
def test_a_quantization_baton_cannot_load_is_refused(qc: dict[str, Any], model_path: Path,
                                                     tmp_path: Path) -> None:
    config = json.loads((model_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    with pytest.raises(UnsupportedQuantization, match="baton loads fp8"):
        check_architecture(tmp_path)
