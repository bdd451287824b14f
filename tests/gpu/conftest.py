"""GPU tests: marked `gpu`, skipped without CUDA. On the lent machine, with `.whl/` carried
(gpu/prepare.sh fills it here):  bash gpu/run.sh python3 -m pytest -q -m gpu tests/gpu

The builtin model cannot travel there, so the model is the builtin's config and tokenizer with
random-initialised weights, written there (token equality with HF holds for any weights)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.engine.hf_reference import Reference, hf_greedy

# every GPU test module's marks; the timeout (pytest-timeout travels in .whl) keeps one hung test
# from eating a whole 10-minute command on the lent machine (BATON_GPU_TEST_TIMEOUT: a shorter one)
GPU = [pytest.mark.gpu, pytest.mark.timeout(int(os.environ.get("BATON_GPU_TEST_TIMEOUT", "240"))),
       pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
REPO = Path(__file__).resolve().parents[2]
CARRIED = REPO / ".whl" / "model"  # config.json + tokenizer files, from gpu/prepare.sh
FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
         "chat_template.jinja", "special_tokens_map.json")


def model_files() -> Path:
    if (CARRIED / "config.json").exists():
        return CARRIED
    from runtime.model_store import resolve_model_path

    return resolve_model_path("builtin:smollm2-135m")


def random_llama(dest: Path, dtype: torch.dtype, seed: int = 0, **shape: int) -> Path:
    """The builtin model's architecture (or `shape` overrides) with random weights, in `dest`."""
    import transformers

    src = model_files()
    config = transformers.AutoConfig.from_pretrained(src, **shape)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(dest)
    for name in FILES:
        if (src / name).exists() and not (dest / name).exists():
            shutil.copy(src / name, dest / name)
    return dest


def hf_greedy_cuda(path: Path, prompts: list[list[int]], dtype: torch.dtype, n: int) -> list[Reference]:
    refs = hf_greedy(path, prompts, n, dtype, "cuda")
    torch.cuda.empty_cache()  # the HF model's memory
    return refs


@pytest.fixture(scope="session")
def gpu_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return random_llama(tmp_path_factory.mktemp("gpu-model"), torch.float32)
