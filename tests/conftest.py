"""Shared fixtures: the real builtin model, prepared once and cached, and one colocated
`baton serve` process for the whole session (server, disagg and router tests use it)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tests.engine.hf_reference import Reference
from tests.server.server_process import ServerProcess, start_server


@pytest.fixture(scope="session")
def model_path() -> Path:
    """SmolLM2-135M-Instruct as an HF folder (converted from the PyPI GGUF on first use)."""
    from runtime.model_store import resolve_model_path

    return resolve_model_path("builtin:smollm2-135m")


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The default server (torch sampler), used by the OpenAI, concurrency, error and fuzz tests,
    and as the colocated reference of the disaggregated ones."""
    srv = start_server("--served-model-name", "smollm2",
                       log_path=tmp_path_factory.mktemp("srv") / "server.log")
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="session")
def client(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="session")
def tokenizer(model_path: Path):  # type: ignore[no-untyped-def]
    """transformers' own tokenizer: the reference the servers' outputs are checked against."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


@pytest.fixture(scope="session")
def model_files_path() -> Path:
    """The builtin model's config and tokenizer, for tests that write random weights of their
    own (on the GPU machine, where the weights cannot travel, from .whl/model)."""
    from tests.gpu.conftest import model_files

    return model_files()


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Llama with the real tokenizer, for tests where speed matters (on the
    GPU machine too: the config and tokenizer come from .whl/model there)."""
    from tests.disagg.pd import tiny_model
    from tests.gpu.conftest import model_files

    return tiny_model(model_files(), tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def sharp_tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with large random weights: its greedy tokens depend strongly on every
    position's KV (not one token repeated), so a lost, doubled or foreign token shows."""
    from tests.disagg.pd import tiny_model
    from tests.gpu.conftest import model_files

    return tiny_model(model_files(), tmp_path_factory.mktemp("sharp-llama"), init_range=0.5)


@pytest.fixture(scope="session")
def prompt_ids(tokenizer: Any) -> list[list[int]]:
    from tests.engine.hf_reference import PROMPTS

    return [tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="session")
def hf_refs(model_path: Path, prompt_ids: list[list[int]]) -> list[Reference]:
    """HF transformers' greedy output (with top-2 gaps) for PROMPTS: the token-exact reference."""
    from tests.engine.hf_reference import MAX_NEW, hf_greedy

    return hf_greedy(model_path, prompt_ids, MAX_NEW)
