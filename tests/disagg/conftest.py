"""Disaggregation fixtures: a tiny random Llama (real tokenizer) for tests where speed matters."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.disagg.pd import tiny_model


@pytest.fixture(scope="session")
def tiny_path(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(model_path, tmp_path_factory.mktemp("tiny-llama"))
