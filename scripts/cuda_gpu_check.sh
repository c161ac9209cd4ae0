#!/usr/bin/env bash
# On a GPU machine: every CUDA-backend test (the nvcc/CPU ones, the full compile catalog, the GPU properties)
# and the timing script, with a compact summary. Logs go to $OUT (or ./cuda-gpu-logs) for the details.
#   bash scripts/cuda_gpu_check.sh
set -u
cd "$(dirname "$0")/.."
LOGS="${OUT:-cuda-gpu-logs}"
mkdir -p "$LOGS"
export FAGEN_CACHE_DIR="${FAGEN_CACHE_DIR:-$(mktemp -d -t fagen-cache-XXXX)}"  # one cache: each variant compiles once
export HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-gpu}"
python3 -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__, '| GPU', torch.cuda.get_device_name())" || exit 1
nvcc --version | tail -2 | head -1

status=0
XDIST=""; python -c "import xdist" 2>/dev/null && XDIST="-n 8"  # parallel nvcc when pytest-xdist is there
echo "== 1/3 nvcc + launcher checks (CPU side), full compile catalog"
FAGEN_NVCC_CATALOG=1 timeout 900 python3 -m pytest tests/test_cuda_backend.py -q $XDIST -rfE --tb=short \
    >"$LOGS/cuda_backend.log" 2>&1 || status=1
tail -n 3 "$LOGS/cuda_backend.log"
echo "== 2/3 GPU properties (one process: the float64 reference is large)"
timeout 1500 python3 -m pytest tests/test_cuda_gpu.py -q -s -rfE --tb=short --durations=5 \
    >"$LOGS/cuda_gpu.log" 2>&1 || status=1
grep -E "^precompiled|passed|failed|^FAILED|^ERROR" "$LOGS/cuda_gpu.log" | head -n 40
if grep -q -E "^(FAILED|ERROR)" "$LOGS/cuda_gpu.log"; then
    echo "-- first failure:"; awk '/^_____+ /{n++} n==1' "$LOGS/cuda_gpu.log" | head -n 60
fi
echo "== 3/3 timing (d128 bf16 s16k, full and causal)"
for mask in none causal; do
    timeout 450 python3 cli.py bench --backend cuda --head-dim 128 --dtype bf16 --mask $mask --seq-q 16384 \
        --skip-flex 2>&1 | tee "$LOGS/bench_cuda_$mask.log" | tail -n 8 || status=1
done
exit $status
