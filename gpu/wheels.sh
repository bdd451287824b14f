#!/usr/bin/env bash
# Download, on a CPU machine, the small wheels the lent GPU machine lacks (ENVIRONMENT.md "GPU
# machine": its python 3.12 has torch+CUDA, triton and transformers, not the serving stack), at
# the versions this venv runs, into .whl/ (git-ignored), which `run` carries when named:
#   run(carry=[".whl"], command="bash gpu/run.sh python -m pytest ...")
# flashinfer and nixl (~60 MB each) would fill a command's 64 MiB alone: not included here.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
packages="fastapi starlette uvicorn pydantic pydantic-core pyzmq annotated-types typing-inspection
          h11 click anyio sniffio jinja2 markupsafe"
pins=$($py - $packages <<'PY'
import importlib.metadata as m, sys
print(" ".join(f"{p}=={m.version(p)}" for p in sys.argv[1:]))
PY
)
rm -rf .whl && mkdir .whl
$py -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d .whl $pins
ls .whl && du -sh .whl
