"""The model registry: which family runs a checkpoint, and a clear refusal of the others."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.models.registry import (
    FAMILIES,
    UnsupportedArchitecture,
    check_architecture,
    family_of,
    supported,
)
from tests.server.server_process import REPO, free_port


def test_every_listed_architecture_has_one_family() -> None:
    names = [a for f in FAMILIES for a in f.architectures]
    assert len(names) == len(set(names)) and sorted(names) == supported()
    assert {"LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"} <= set(names)
    for name in names:
        assert name in family_of(name).architectures
    with pytest.raises(UnsupportedArchitecture, match=r"'GPT2LMHeadModel': baton runs .*Llama"):
        family_of("GPT2LMHeadModel")


def _with_architecture(src: Path, dest: Path, architectures: list[str] | None) -> Path:
    shutil.copytree(src, dest, symlinks=True)
    config = json.loads((dest / "config.json").read_text())
    if architectures is None:
        config.pop("architectures", None)
    else:
        config["architectures"] = architectures
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def test_a_checkpoint_without_architectures_is_llama(tiny_path: Path, tmp_path: Path) -> None:
    assert check_architecture(_with_architecture(tiny_path, tmp_path / "m", None)).name == "llama"


def test_serve_refuses_an_unsupported_architecture_at_start_up(tiny_path: Path,
                                                               tmp_path: Path) -> None:
    """Exit code 2 within seconds, before any process is spawned or a port is opened, with a
    message that names the architecture and lists the supported ones."""
    model = _with_architecture(tiny_path, tmp_path / "gpt2", ["GPT2LMHeadModel"])
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run(
        [sys.executable, "-m", "runtime.cli", "serve", "--model", str(model), "--port",
         str(free_port())], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    out = done.stdout + done.stderr
    assert "unsupported architecture 'GPT2LMHeadModel'" in out, out
    assert all(name in out for name in supported()), out
    assert "Traceback" not in out and "scheduler process" not in out, out
