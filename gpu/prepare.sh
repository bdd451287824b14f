#!/usr/bin/env bash
# Here, on a CPU machine: fill .whl/ (git-ignored) with what the lent GPU machine lacks, for
# `run(carry=[".whl"], command="bash gpu/run.sh python3 -m pytest -q -m gpu tests/gpu")`:
# - the small wheels of the serving stack and the openai SDK (its python 3.12 has torch+CUDA,
#   triton and transformers, not these; docs/gpu.md "The GPU machine"), at this venv's versions,
#   with each one's own requirements that machine lacks (fastapi >= 0.165 imports opentelemetry);
# - .whl/model: the builtin model's config and tokenizer (its weights cannot travel; the GPU
#   tests and bench/gpu.py write random-initialised ones there).
# flashinfer and nixl (~60 MB each) would fill a command's 64 MiB alone: not included here;
# docs/gpu.md "The GPU machine" has the two-call recipe for flashinfer (tests/gpu skip it without).
# `bash gpu/prepare.sh nixl` fills .whl-nixl/ instead (57 MiB: nixl and its CUDA 13 build, the
# machine's torch being cu130), for a first call that only installs it, `bash gpu/run.sh true`
# with carry=[".whl-nixl"]; the next call, carrying .whl, finds it installed while the machine
# is warm.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
if [ "${1:-}" = nixl ]; then
  version=$($py -c "import importlib.metadata as m; print(m.version('nixl'))")
  rm -rf .whl-nixl && mkdir .whl-nixl
  $py -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 --platform any -d .whl-nixl \
    "nixl==$version" "nixl-cu13==$version"
  ls .whl-nixl && du -sh .whl-nixl
  exit 0
fi
packages="fastapi starlette uvicorn pydantic pydantic-core pyzmq annotated-types typing-inspection
          h11 click anyio sniffio jinja2 markupsafe openai jiter httpx2 httpcore2 truststore
          pytest-timeout opentelemetry-api annotated-doc"
pins=$($py - $packages <<'PY'
import importlib.metadata as m, sys
print(" ".join(f"{p}=={m.version(p)}" for p in sys.argv[1:]))
PY
)
rm -rf .whl && mkdir .whl
$py -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d .whl $pins
model=$($py -c "from runtime.model_store import resolve_model_path as r; print(r('builtin:smollm2-135m'))")
mkdir .whl/model
for f in config.json generation_config.json tokenizer.json tokenizer_config.json chat_template.jinja \
         special_tokens_map.json; do
  if [ -f "$model/$f" ]; then cp "$model/$f" .whl/model/; fi
done
ls .whl .whl/model && du -sh .whl
