#!/usr/bin/env bash
# On the lent GPU machine: install the carried wheels beside its own torch (never over it) and
# run what is asked, e.g.  bash gpu/run.sh python3 -m pytest -q tests/attention/test_triton_kernels.py
# The device tool brings back only what lands under $OUT: the command's output is copied to
# $OUT/run.log (pass `--out "$OUT"` to bench/gpu.py for its JSON).
set -euo pipefail
cd "$(dirname "$0")/.."
for carried in .whl .whl-nixl; do  # gpu/prepare.sh fills them; each travels when named in carry
  if [ -d "$carried" ]; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site "$carried"/*.whl
  fi
done
export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
log=${OUT:-/tmp}/run.log
{
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'triton', triton.__version__)"
  "$@"
} 2>&1 | tee "$log"
