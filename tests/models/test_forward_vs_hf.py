"""Each family's forward over the paged KV cache vs HF's forward, logit for logit.

Tiny random models cover what SmolLM2 does not: Qwen2's q/k/v biases, Qwen3's per-head q/k
norms and free head_dim, sparse MoE layers (Qwen3-MoE with dense layers between, Mixtral), llama3 and linear rope scaling, untied lm_head, and a prefix read back
from the paged pool (chunked extend + decode); Gemma 3's sliding-window layers (a window of 8 or
5 over 40 tokens, on pages of 4) beside its global ones, each with its RoPE base, its (1 + w)
norms (all random here), scaled embedding, GeGLU, query_pre_attn_scalar and logit soft-capping.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.config import EngineConfig
from runtime.engine.model_runner import ModelRunner
from runtime.sampling_params import SamplingParams
from runtime.scheduler.batch import ScheduleBatch
from runtime.scheduler.req import Req

COMMON: dict[str, Any] = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-tied": ("LlamaConfig", dict(tie_word_embeddings=True, rope_theta=10000.0)),
    "llama3-rope-untied": (
        "LlamaConfig",
        dict(
            tie_word_embeddings=False,
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            ),
        ),
    ),
    "llama-linear-rope": (
        "LlamaConfig",
        dict(rope_theta=10000.0, rope_scaling=dict(rope_type="linear", factor=2.0)),
    ),
    "qwen2-bias": ("Qwen2Config", dict(tie_word_embeddings=False, rope_theta=1000000.0)),
    # q/k norms per head, and a head_dim (32) that is not hidden / heads (16)
    "qwen3-qk-norm": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=False,
                                          rope_theta=1000000.0)),
    "qwen3-tied": ("Qwen3Config", dict(head_dim=24, tie_word_embeddings=True)),
    # sparse MoE: 4 experts, top 2; layer 1 dense (mlp_only_layers), renormalized or not
    "qwen3-moe": ("Qwen3MoeConfig", dict(head_dim=16, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=32, norm_topk_prob=True,
                                         mlp_only_layers=[1])),
    "qwen3-moe-step2": ("Qwen3MoeConfig", dict(head_dim=16, num_experts=6, num_experts_per_tok=3,
                                               moe_intermediate_size=24, norm_topk_prob=False,
                                               decoder_sparse_step=2)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2,
                                      tie_word_embeddings=False)),
    "mixtral-top-k-all": ("MixtralConfig", dict(num_local_experts=3, num_experts_per_tok=3)),
    # routed experts plus a gated shared expert, q/k/v biases, layer 0 dense
    "qwen2-moe-shared": ("Qwen2MoeConfig", dict(num_experts=4, num_experts_per_tok=2,
                                                moe_intermediate_size=32,
                                                shared_expert_intermediate_size=48,
                                                mlp_only_layers=[0], tie_word_embeddings=False)),
    "gemma3-sliding": ("Gemma3TextConfig", dict(head_dim=32, sliding_window=8,
                                                layer_types=["sliding_attention", "full_attention"],
                                                query_pre_attn_scalar=24)),
    # the global layer first, its rope scaled; logits capped; an untied lm_head
    "gemma3-softcap-linear-rope": ("Gemma3TextConfig", dict(
        head_dim=32, sliding_window=5, layer_types=["full_attention", "sliding_attention"],
        final_logit_softcapping=3.0, rope_scaling=dict(rope_type="linear", factor=2.0),
        tie_word_embeddings=False)),
}


@pytest.fixture(params=sorted(VARIANTS))
def tiny(request: pytest.FixtureRequest, model_path: Path, tmp_path: Path) -> tuple[Path, Any]:
    return hf_tiny(request.param, model_path, tmp_path)


def hf_tiny(variant: str, model_path: Path, dest: Path) -> tuple[Path, Any]:
    """VARIANTS[variant] with random weights, saved in `dest` with the builtin tokenizer, and
    the HF model itself."""
    import transformers

    cls_name, extra = VARIANTS[variant]
    config = getattr(transformers, cls_name)(**COMMON, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random biases and norms, so a dropped one cannot go unnoticed
        for name, p in model.named_parameters():
            if cls_name.startswith("Gemma") and name.endswith("norm.weight"):
                p.normal_(0, 0.5)  # Gemma scales by 1 + w: w = 0 would hide a lost 1
            elif name.endswith("bias"):
                p.normal_(0, 0.5)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                p.normal_(1, 0.5)
            elif name.endswith("gate.weight"):  # MoE routers (and a shared expert's gate)
                p.normal_(0, 1.0)
    model.save_pretrained(dest)
    shutil.copy(model_path / "tokenizer.json", dest / "tokenizer.json")
    return dest, model.eval()


@pytest.mark.parametrize("backend", ["torch", "auto"], ids=["plain-torch", "onednn-native"])
def test_extend_chunks_and_decode_match_hf_logits(tiny: tuple[Path, Any], backend: str) -> None:
    path, hf = tiny
    check_logits(path, hf, backend, "torch" if backend == "torch" else "auto")


def _forward(runner: ModelRunner, fb: Any) -> torch.Tensor:
    """Every position's logits of `fb`, staged as ModelRunner.forward_batch stages a batch: on
    the runner's device, with the req->token table's writes it queued (on the CPU they are made
    at once; on a GPU a kernel that reads the table before them reads stale rows)."""
    fb = fb.to(runner.device)
    runner.kv.req_to_token.apply(fb.table_writes)
    return runner.model.forward(fb, runner.attn, None)


def check_logits(path: Path, hf: Any, attention: str, linear: str,
                 device: str = "cpu") -> ModelRunner:
    """40 random tokens through our forward, as two extend chunks (the second reading the first
    from the pool) and 10 decode steps, give HF's logits (HF on the CPU); returns the runner."""
    config = EngineConfig(
        model=str(path), max_total_tokens=512, page_size=4, device=device, dtype="float32",
        linear_backend=linear, attention_backend=attention,  # type: ignore[arg-type]
    )
    runner = ModelRunner(config, 4)
    # on a CPU the experts read their counts on the host: no decode graph may capture them
    assert runner.model.cuda_graph_safe is (runner.model.config.moe is None)
    ids = torch.randint(3, 49152, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        want = hf(torch.tensor([ids])).logits[0]  # [40, vocab]
    req = Req("r", ids[:30], SamplingParams(max_new_tokens=8, temperature=0.0))
    got = []
    for lo, hi in ((0, 17), (17, 30)):  # two chunks: the second reads the first from the pool
        batch = ScheduleBatch(reqs=[req], extend_lens=[hi - lo], is_last_chunk=[hi == 30])
        got.append(_forward(runner, batch.prepare_for_extend(runner.kv)))
    for tok in ids[30:]:  # decode the rest one token at a time
        req.output_ids.append(tok)
        batch = ScheduleBatch(reqs=[req], input_ids=torch.tensor([tok]))
        got.append(_forward(runner, batch.prepare_for_decode(runner.kv)))
    ours = torch.cat(got).cpu()
    # decode logits are for the token after each input: align with HF's rows 30..39
    torch.testing.assert_close(ours, want, atol=2e-4, rtol=1e-4)
    runner.kv.release(req)
    assert runner.kv.is_all_free()
    return runner
