"""`baton model prepare` and model resolution."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from runtime import model_store


def baton(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "runtime.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_prepare_twice_returns_the_same_folder_without_rewriting(model_path: Path) -> None:
    stamp = (model_path / "model.safetensors").stat().st_mtime_ns
    done = baton("model", "prepare", "smollm2-135m")
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()) == model_path
    assert (model_path / "model.safetensors").stat().st_mtime_ns == stamp
    for f in ("config.json", "tokenizer.json", "model.safetensors"):
        assert (model_path / f).exists()


def test_unknown_builtin_is_a_clear_cli_error() -> None:
    done = baton("model", "prepare", "gpt-17")
    assert done.returncode == 2
    assert "unknown builtin model 'gpt-17'" in done.stderr and "smollm2-135m" in done.stderr


def test_resolve_model_path(model_path: Path, tmp_path: Path) -> None:
    assert model_store.resolve_model_path("builtin:smollm2-135m") == model_path
    assert model_store.resolve_model_path(str(model_path)) == model_path
    with pytest.raises(FileNotFoundError, match=r"not a folder with config\.json"):
        model_store.resolve_model_path(str(tmp_path))
    with pytest.raises(ValueError, match="unknown builtin"):
        model_store.resolve_model_path("builtin:nope")


def test_cache_dir_honours_baton_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("BATON_CACHE", str(tmp_path))
    assert model_store.prepared_dir("smollm2-135m") == tmp_path / "models" / "smollm2-135m"
    with pytest.raises(FileNotFoundError, match="baton model prepare smollm2-135m"):
        model_store.resolve_model_path("builtin:smollm2-135m", prepare_builtin=False)


def test_pull_rejects_non_hf_uris() -> None:
    done = baton("model", "pull", "s3://bucket/model", "--dest", "/tmp/x")
    assert done.returncode != 0 and "expected hf://org/name" in done.stderr
