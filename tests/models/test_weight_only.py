"""Weight-only int8 and int4 (runtime/models/quantize.py): the rounding (int8 per output channel,
int4 per group of 32 on GGUF Q4_1's grid, which it keeps exactly), the quantized kernel and the
dequantized path computing with the same rounded weights, the rows of a step picking the path,
and every matmul of a model's layers replaced (not the embedding or MoE experts; the lm_head
under int4 only, in two int4 passes). End to end: with the kernel off, the engine equals HF on
the same rounded weights dequantized to float32, token for token. (Their quality against fp32
is bench/quality.py's gate.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime import Engine
from runtime.models.linear import Linear
from runtime.models.quantize import Int4Linear, Int4ResidualLinear, Int8Linear, quantize
from tests.engine.hf_reference import PROMPTS, compare, hf_greedy
from tests.models.checkpoints import SHAPE, write_checkpoint, write_family

pytestmark = pytest.mark.timeout(300)


def test_the_int8_kernel_and_the_dequantized_path_share_their_weights() -> None:
    g = torch.Generator().manual_seed(0)
    w, bias = torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    lin = Int8Linear(w, bias, onednn=False, max_rows=4)
    scale = w.abs().amax(1) / 127
    assert torch.equal(lin.q, torch.round(w / scale[:, None]).to(torch.int8))
    deq = lin.q.float() * scale[:, None]
    assert (deq - w).abs().max() <= scale.max() / 2 + 1e-6  # half a step, per channel
    few, many = torch.randn(3, 64, generator=g), torch.randn(9, 64, generator=g)
    assert torch.equal(lin(many), many @ deq.T + bias)  # above max_rows: the dequantized path
    # up to max_rows: the int8 kernel, bf16 activations: close to the same weights, not equal
    kernel = lin(few)
    assert not torch.equal(kernel, few @ deq.T + bias)
    torch.testing.assert_close(kernel, few @ deq.T + bias, rtol=2e-2, atol=0.1)  # |y| ~ 8
    assert lin(few[None]).shape == (1, 3, 96)  # any leading shape


def test_int4_keeps_a_q4_1_grid_and_its_kernel_shares_the_weights() -> None:
    """Weights already on a Q4_1 grid (d * q + m per group of 32, each group using q = 0 and
    15, d and m exact in bf16) come back exactly: the builtin model's GGUF blocks lose nothing."""
    g = torch.Generator().manual_seed(1)
    out, k = 64, 96
    q = torch.randint(0, 16, (out, k // 32, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15
    d = (torch.rand(out, k // 32, 1, generator=g) * 0.01 + 0.001).bfloat16().float()
    m = (torch.randn(out, k // 32, 1, generator=g) * 0.01).bfloat16().float()
    w = (d * q + m).view(out, k)
    lin = Int4Linear(w, None, onednn=False, max_rows=2)
    deq = lin.dequantized.weight
    # exact but for zero = m + 8d rounded to bf16 (a shift of at most half a bf16 ulp of it)
    assert (deq - w).abs().max() <= (m.abs() + 8 * d).max() * 2**-8
    few, many = torch.randn(2, k, generator=g), torch.randn(5, k, generator=g)
    assert torch.equal(lin(many), many @ deq.T)
    torch.testing.assert_close(lin(few), few @ deq.T, rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="divisible by 32"):
        Int4Linear(torch.randn(8, 40), None, onednn=False, max_rows=2)


def test_the_int4_lm_head_rounds_twice_and_both_paths_share_its_weights() -> None:
    """The lm_head under int4: the weight on the int4 grid, then what that left over on its
    own grid; its error is a small part of one pass's, the kernel path (two int4 kernels,
    summed in float32) is close to the same weights, and a row count the kernel does not take
    (not a multiple of 16) is padded and cut."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(1000, 96, generator=g)
    once, twice = Int4Linear(w, None, False, 2), Int4ResidualLinear(w, None, False, 2)
    deq = twice.dequantized.weight
    assert torch.equal(deq, once.dequantized.weight + twice.second[2])
    assert (deq - w).abs().max() < (once.dequantized.weight - w).abs().max() / 10
    few, many = torch.randn(2, 96, generator=g), torch.randn(5, 96, generator=g)
    assert torch.equal(twice(many), many @ deq.T)
    y = twice(few)
    assert y.shape == (2, 1000) and y.dtype == torch.float32
    torch.testing.assert_close(y, few @ deq.T, rtol=2e-2, atol=0.1)  # bf16 activations, |y| ~ 10


@pytest.mark.parametrize(("family", "kind", "per_layer"),
                         [("llama", "int8", 4), ("qwen3-moe", "int8", 2), ("llama", "int4", 4)])
def test_every_matmul_is_replaced_and_nothing_else(family: str, kind: str, per_layer: int,
                                                   model_path: Path, tmp_path: Path) -> None:
    path = (write_checkpoint("LlamaConfig", tmp_path / "m", model_path, **SHAPE)
            if family == "llama" else write_family(family, tmp_path / "m", model_path))
    engine = Engine(model=str(path), max_total_tokens=1024, quantization=kind)
    cls = {"int8": Int8Linear, "int4": Int4Linear}[kind]
    try:
        model = engine.runner.model
        # the lm_head: full precision under int8, two int4 passes under int4
        head = {"int8": Linear, "int4": Int4ResidualLinear}[kind]
        assert isinstance(model.lm_head, head)  # type: ignore[attr-defined]
        for layer in model.layers:  # type: ignore[attr-defined]
            assert isinstance(layer.qkv, cls) and isinstance(layer.o, cls)
        assert not any(isinstance(v, Linear) for layer in model.layers  # type: ignore[attr-defined]
                       for v in vars(layer).values())
        # a MoE layer keeps its experts in full precision: 2 matmuls a layer, q/k/v and o
        assert engine.runner.quantized_matmuls == (per_layer * len(model.layers)  # type: ignore[attr-defined]
                                                   + (kind == "int4"))
        assert quantize(model, kind, 4) == 0  # nothing left to replace
        assert isinstance(model.embed, torch.Tensor)  # type: ignore[attr-defined]
    finally:
        engine.shutdown()


def _int8(w: torch.Tensor) -> torch.Tensor:
    scale = w.abs().amax(1).clamp(min=1e-12) / 127
    return torch.round(w / scale[:, None]).clamp(-127, 127) * scale[:, None]


def _int4(w: torch.Tensor) -> torch.Tensor:
    g = w.view(w.shape[0], -1, 32)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp(min=1e-12).bfloat16().float()
    zero = (lo + 8 * scale).bfloat16().float()
    q = torch.round((g - zero) / scale + 8).clamp(0, 15)
    return ((q - 8) * scale + zero).view(w.shape)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_the_dequantized_path_equals_hf_on_the_same_weights(kind: str, model_path: Path,
                                                           tmp_path: Path) -> None:
    src = write_checkpoint("Qwen2Config", tmp_path / "src", model_path,
                           **dict(SHAPE, tie_word_embeddings=False))
    tensors = load_file(src / "model.safetensors")
    for name, w in tensors.items():  # what quantize.py makes of each matmul weight
        if name.endswith("_proj.weight"):
            tensors[name] = (_int8 if kind == "int8" else _int4)(w)
        elif name == "lm_head.weight" and kind == "int4":  # (under int8 it stays as it is)
            tensors[name] = _int4(w) + _int4(w - _int4(w))
    (tmp_path / "deq").mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (tmp_path / "deq" / f.name).write_bytes(f.read_bytes())
    save_file(tensors, str(tmp_path / "deq" / "model.safetensors"), metadata={"format": "pt"})
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src)
    ids = [tok.encode(p) for p in PROMPTS[:3]]
    refs = hf_greedy(tmp_path / "deq", ids, 16)
    engine = Engine(model=str(src), max_total_tokens=2048, quantization=kind, quant_max_rows=0)
    try:
        outs = engine.generate(ids, {"temperature": 0, "max_new_tokens": 16})
    finally:
        engine.shutdown()
    for out, ref in zip(outs, refs, strict=True):
        assert compare(out["output_ids"], ref) is None


def test_pd_with_int4_equals_colocated_int4(model_path: Path, tmp_path: Path) -> None:
    """`make run`'s mode through PD over tcp (what `baton up -- --quantization int4` runs): the
    prefill's KV and first token, the decode's steps, the same tokens as one int4 engine and
    logprobs within float noise of its, the KV canary raising on any violation."""
    import asyncio

    import httpx

    from tests.disagg.pd import pd_call, start_pair

    path = write_checkpoint("LlamaConfig", tmp_path / "m", model_path,
                            **dict(SHAPE, hidden_size=128, num_attention_heads=8))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    ids = [tok.encode(p) for p in PROMPTS[:4]]
    engine = Engine(model=str(path), max_total_tokens=2048, quantization="int4")
    try:
        want = engine.generate(ids, {"temperature": 0, "max_new_tokens": 12}, return_logprob=True)
    finally:
        engine.shutdown()
    pair = start_pair(tmp_path, "tcp", "--quantization", "int4", "--kv-canary", "raise",
                      model=str(path))
    try:
        async def run() -> list[dict[str, object]]:
            async with httpx.AsyncClient(timeout=120) as http:
                calls = [pd_call(http, pair, "/generate", {
                    "input_ids": p, "return_logprob": True, **pair.fields(prompt={"input_ids": p}),
                    "sampling_params": {"temperature": 0, "max_new_tokens": 12}}) for p in ids]
                return [decoded for _, decoded in await asyncio.gather(*calls)]

        for got, w in zip(asyncio.run(run()), want, strict=True):
            assert isinstance(got, dict), got
            assert got["output_ids"] == w["output_ids"]
            lps = [lp for lp, _ in got["meta_info"]["output_token_logprobs"]]  # type: ignore[index]
            # (batches of other sizes add in another order: float noise, not a different model)
            assert max(abs(a - b) for a, b in zip(
                lps, [lp for lp, _ in w["meta_info"]["output_token_logprobs"]], strict=True)) < 1e-4
    finally:
        pair.stop()
