#!/usr/bin/env bash
# On the lent GPU machine: install the carried wheels beside its own torch (never over it) and
# run what is asked, e.g.  bash gpu/run.sh python3 -m pytest -q tests/attention/test_triton_kernels.py
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
fi
export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'triton', triton.__version__)"
exec "$@"
