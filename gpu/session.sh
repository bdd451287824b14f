#!/usr/bin/env bash
# Everything a lent GPU checks, in one call (README "GPU"): the GPU suite, where a decode step's
# time goes (batch 1; batch 256 with Python's GIL switch interval at its 5 ms default and at
# 0.5 ms), and bench/gpu.py on the 1B shape against HF. Each step has its own time limit and a
# failed step does not stop the next; results land under $OUT. Run through gpu/run.sh, carrying
# .whl (nixl installs in a call of its own before, `bash gpu/run.sh true` carrying .whl-nixl):
#   bash gpu/run.sh bash gpu/session.sh          # run(timeout_s=600): ~8 minutes
# The steps' limits add up to more than a call's 600 s: the bench, last, is what a slow run loses.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/baton-gpu}
mkdir -p "$out"

step() {  # step LIMIT_S COMMAND...: run it, say how it ended
  local limit=$1
  shift
  echo "== $* (limit ${limit} s)"
  local start=$SECONDS rc
  timeout "$limit" "$@"
  rc=$?
  echo "== exit $rc after $((SECONDS - start)) s"
  return $rc
}

anatomy() {  # anatomy NAME ARGS...: bench/step_anatomy.py on the 1B shape, kept as NAME.txt
  local name=$1
  shift
  step 90 python3 bench/step_anatomy.py --shape 1b --steps 64 --out "$out" "$@" \
    && mv "$out/step_anatomy.txt" "$out/$name.txt"
}

BATON_GPU_TEST_TIMEOUT=${BATON_GPU_TEST_TIMEOUT:-120} step 220 python3 -m pytest -q -rfEs \
  -p no:cacheprovider tests/attention/test_triton_kernels.py tests/models/test_fused.py tests/gpu
anatomy anatomy-b1
anatomy anatomy-b256 --batch 256
anatomy anatomy-b256-switch0.5ms --batch 256 --switch-interval-ms 0.5
step 200 python3 bench/gpu.py --shapes 1b --out "$out"
