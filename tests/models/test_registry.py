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
from tests.ports import free_port
from tests.server.server_process import REPO


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


def config_only(dest: Path, architecture: str) -> Path:
    """A checkpoint folder with nothing but config.json (no weights, no tokenizer)."""
    dest.mkdir(parents=True)
    (dest / "config.json").write_text(json.dumps({
        "architectures": [architecture], "hidden_size": 64, "num_attention_heads": 4,
        "num_hidden_layers": 2, "vocab_size": 128}))
    return dest


@pytest.mark.parametrize("architecture", ["DeepseekV3ForCausalLM", "GPT2LMHeadModel"])
def test_serve_writes_its_refusal_where_kubernetes_keeps_it(tmp_path: Path,
                                                             architecture: str) -> None:
    """The refusal comes before anything is loaded (a config.json alone is refused the same
    way) and lands in the container's termination message, the file Kubernetes copies into
    the Pod's status for the operator; a file that does not exist is not made."""
    model = config_only(tmp_path / "model", architecture)
    message, absent = tmp_path / "termination-log", tmp_path / "no" / "termination-log"
    message.touch()  # the kubelet makes the file before the container starts
    for path in (message, absent):
        env = dict(os.environ, PYTHONPATH=str(REPO), BATON_TERMINATION_MESSAGE_PATH=str(path))
        done = subprocess.run(
            [sys.executable, "-m", "runtime.cli", "serve", "--model", str(model), "--port",
             str(free_port())], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, done.stdout + done.stderr
    written = message.read_text()
    assert written.startswith(f"unsupported architecture '{architecture}': baton runs "), written
    assert all(name in written for name in supported()), written
    assert "Traceback" not in done.stderr and not absent.parent.exists()
