#!/bin/bash
# Phase 4, GPU run 3 (one `run` call on an H100): key-block-major vs head-major tile order of the Gluon backward,
# with diagnostics (no turn wait; no reduce) on causal s16k, beside cuDNN and the Triton backward; then the GPU
# backward tests of tests/test_hopper.py and the drop-one-dq-step mutant on the template's default (head major).
# Usage (repository root): OUT=/tmp/out bash benchmarks/hopper/8-pipelined-dq/run3.sh
set -u
OUT=${OUT:-/tmp}
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv,noheader > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
timeout 68 python scripts/hopper_bwd_sweep.py 1,128,0 1,128,1 1,128,0,no-turn-wait 1,128,0,no-reduce \
  1,128,1,no-turn-wait 1,128,1,no-reduce 2>&1 | grep --line-buffered -v "Warning\|_execution_engine"
echo "sweep rc ${PIPESTATUS[0]}"
timeout 28 python -m pytest -q -p no:cacheprovider tests/test_hopper.py -k backward_matches > "$OUT/pytest.txt" 2>&1
echo "pytest rc $?"; tail -3 "$OUT/pytest.txt"
timeout 16 python scripts/hopper_bwd_mutant.py drop-one-dq-step 2>&1 | grep --line-buffered -v Warning
echo "mutant rc ${PIPESTATUS[0]}"
