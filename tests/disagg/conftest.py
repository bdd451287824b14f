"""Disaggregation fixtures: the prompts of the PD equality tests and their HF greedy reference,
computed once per session."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.engine.hf_reference import Reference, hf_greedy

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Hello, my name is",
    "Once upon a time, in a land far away, there lived a",
    "List three colors:",
    "Water boils at a temperature of",
    "Explain why the sky is blue. " * 6,
    "In 1492, Columbus sailed across the ocean. " * 12,
]
MAX_NEW = 24


@pytest.fixture(scope="session")
def prompt_ids(tokenizer: Any) -> list[list[int]]:
    return [tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="session")
def hf_refs(model_path: Path, prompt_ids: list[list[int]]) -> list[Reference]:
    return hf_greedy(model_path, prompt_ids, MAX_NEW)
