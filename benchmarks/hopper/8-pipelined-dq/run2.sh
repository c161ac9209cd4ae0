#!/bin/bash
# Phase 4, GPU run 2 (one `run` call on an H100): the dQ-writer variant sweep (each variant checked against float64
# and for bitwise repeatability, then timed beside cuDNN and the Triton backward), the correctness part of
# scripts/hopper_bwd_gpu.py on the default variant, the mutants, a short `fagen verify`.
# Usage (repository root): OUT=/tmp/out bash benchmarks/hopper/8-pipelined-dq/run2.sh
set -u
OUT=${OUT:-/tmp}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu,driver_version --format=csv \
  > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
timeout 110 python scripts/hopper_bwd_sweep.py 2>&1 | grep --line-buffered -v "Warning\|_execution_engine"
echo "sweep rc ${PIPESTATUS[0]}"
HOPPER_TIMINGS=0 timeout 55 python scripts/hopper_bwd_gpu.py 2>&1 | grep --line-buffered -v "Warning\|_execution_engine"
echo "gpu checks rc ${PIPESTATUS[0]}"
timeout 35 python scripts/hopper_bwd_mutant.py no-turn-wait drop-one-dq-step 2>&1 | grep --line-buffered -v Warning
echo "mutant rc ${PIPESTATUS[0]}"
timeout 38 python -m fagen.cli verify --backend gluon --direction bwd --head-dim 128 --mask causal --gqa 2 \
  --dtype bf16 --device cuda --examples 4 > "$OUT/verify.txt" 2>&1
echo "verify rc $?"; tail -12 "$OUT/verify.txt"
