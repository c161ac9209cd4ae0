#!/usr/bin/env bash
# One stage of a GPU session on the H100: `bash scripts/gpu_session.sh tests|bench|cuda|decode|tune|runtime|timing|host`.
# Full logs go under $OUT (the device tool brings them back); a compact summary is printed last.
set -uo pipefail
stage=${1:?usage: gpu_session.sh tests|bench|cuda|decode|tune|runtime|timing|layouts|host}
OUT=${OUT:-$PWD/gpu-logs}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD  # tests make their own cache per worker, as in CI
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
case $stage in
  layouts)  # issue 14: the layouts' property tests at GPU scale, then the layouts bench suite
    timeout ${TESTS_TIMEOUT:-300} python3 -m pytest tests/test_layouts.py -v -n 8 -p no:cacheprovider -rfE --tb=short \
      > "$OUT/layouts-tests.log" 2>&1; echo "layouts tests exit $?"
    grep -cE " PASSED " "$OUT/layouts-tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/layouts-tests.log" | cut -c1-240 | head
    tail -2 "$OUT/layouts-tests.log"
    timeout 240 python3 cli.py bench --suite layouts --json "$OUT/layouts.json" > "$OUT/layouts-bench.log" 2>&1
    echo "layouts bench exit $?"; cat "$OUT/layouts-bench.log" | tail -20 ;;
  host)  # issue 13: host time per call (latency suite), the decode rows, the host-path tests
    timeout 150 python3 cli.py bench --suite latency --json "$OUT/latency.json" > "$OUT/latency.log" 2>&1
    echo "latency exit $?"; grep -v "^ *$" "$OUT/latency.log" | tail -14
    timeout 120 python3 cli.py bench --suite standard --impl fagen --impl sdpa-cudnn --case decode-d128-kv8k-b32 \
      --case decode-d128-kv32k-b8 --json "$OUT/decode-rows.json" > "$OUT/decode-rows.log" 2>&1
    echo "decode rows exit $?"; tail -c 1500 "$OUT/decode-rows.log"
    HYPOTHESIS_PROFILE=ci timeout ${TESTS_TIMEOUT:-200} python3 -m pytest tests/test_launch.py tests/test_graphs.py \
      tests/test_ops.py tests/test_decode.py ${HOST_TESTS:-} -q -n 8 -p no:cacheprovider -rfE --tb=short \
      > "$OUT/host-tests.log" 2>&1; echo "host tests exit $?"
    grep -E "^(FAILED|ERROR)" "$OUT/host-tests.log" | cut -c1-240 | head -30; tail -2 "$OUT/host-tests.log" ;;
  runtime)  # issue 13: graphs, operators/compile, transformers; then forward/decode/backward at GPU scale (ci profile)
    timeout 240 python3 -m pytest tests/test_graphs.py tests/test_ops.py tests/test_transformers.py tests/test_cache.py \
      -v -n 8 -p no:cacheprovider -rfE --tb=short > "$OUT/runtime.log" 2>&1; echo "runtime tests exit $?"
    HYPOTHESIS_PROFILE=ci timeout 170 python3 -m pytest tests/test_forward.py tests/test_decode.py tests/test_backward.py \
      -q -n 8 -p no:cacheprovider -rfE --tb=short > "$OUT/kernels.log" 2>&1; echo "kernel tests exit $?"
    grep -E "^(FAILED|ERROR)" "$OUT/runtime.log" "$OUT/kernels.log" | cut -c1-240 | head -40
    tail -2 "$OUT/runtime.log"; tail -2 "$OUT/kernels.log" ;;
  timing)  # issue 13: host time per call; the standard suite (no flex) to check for regressions
    timeout 120 python3 cli.py bench --suite latency --json "$OUT/latency.json" > "$OUT/latency.log" 2>&1
    echo "latency exit $?"; cat "$OUT/latency.log"
    timeout 280 python3 cli.py bench --suite standard --skip-flex --json "$OUT/h100.json" --time-limit 240 \
      > "$OUT/bench.log" 2>&1; echo "bench exit $?"; tail -c 3500 "$OUT/bench.log" ;;
  tests)  # the whole suite at GPU scale (the CUDA backend's GPU tests run in the cuda stage)
    # -v logs each result as it lands, so a run cut short by its timeout still names its failures.
    timeout ${TESTS_TIMEOUT:-400} python3 -m pytest ${TESTS:-tests} -v -n 8 -p no:cacheprovider -rfE --tb=short \
      --ignore=tests/test_cuda_gpu.py > "$OUT/pytest.log" 2>&1
    echo "pytest exit $?"; grep -cE " PASSED " "$OUT/pytest.log"; grep -E " (FAILED|ERROR) " "$OUT/pytest.log" | head -20
    timeout 120 python3 cli.py verify --head-dim 64 --mask tree --gqa 4 --dtype fp16 --device cuda --scale gpu \
      > "$OUT/verify.log" 2>&1; echo "verify exit $?"
    grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | cut -c1-220 | head -40
    tail -3 "$OUT/pytest.log"; tail -4 "$OUT/verify.log" ;;
  bench)
    timeout 560 python3 cli.py bench --suite standard --json "$OUT/h100.json" --plot "$OUT/h100.png" \
      --time-limit 480 > "$OUT/bench.log" 2>&1
    echo "bench exit $?"; tail -c 5000 "$OUT/bench.log" ;;
  cuda)  # the CUDA backend's GPU properties (10 examples each), then its timing script
    HYPOTHESIS_PROFILE=ci timeout 380 python3 -m pytest tests/test_cuda_gpu.py -q -x -rfE --tb=short \
      > "$OUT/cuda_gpu.log" 2>&1; echo "cuda gpu tests exit $?"
    timeout 150 python3 cli.py bench --backend cuda --head-dim 128 --dtype bf16 --mask causal --seq-q 16384 \
      --skip-flex > "$OUT/bench_cuda.log" 2>&1; echo "bench cuda exit $?"
    grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/cuda_gpu.log" | cut -c1-300 | head -20
    tail -c 3000 "$OUT/bench_cuda.log" ;;
  tune)  # `fagen tune` for each key of TUNE_KEYS (';'-separated flag sets, the suite's shapes) into $OUT/tuned.json
    IFS=';' read -ra keys <<< "${TUNE_KEYS:?set TUNE_KEYS to ';'-separated fagen tune flags}"
    for key in "${keys[@]}"; do
      echo "== fagen tune $key"
      timeout ${TUNE_TIMEOUT:-150} python3 cli.py tune $key --table "${TUNE_TABLE:-$OUT/tuned.json}" \
        --time-limit $(( ${TUNE_TIMEOUT:-150} - 30 )) >> "$OUT/tune.log" 2>&1; echo "exit $?"
      grep -E "top:|winner|cannot|unchanged" "$OUT/tune.log" | tail -4
    done
    python3 -c "import json,sys; [print(e['head_dim'], e['mask'], e['direction'], 'm%dn%dw%ds%d' % (e['block_m'], e['block_n'], e['num_warps'], e['num_stages']), e['ms'], e.get('tflops')) for e in json.load(open(sys.argv[1]))['entries']]" "${TUNE_TABLE:-$OUT/tuned.json}" ;;
  decode)
    timeout ${DECODE_TIMEOUT:-300} python3 scripts/bench_decode.py ${DECODE_ARGS:-} --json "$OUT/decode.json" \
      > "$OUT/decode.log" 2>&1; echo "decode exit $?"
    tail -c 4000 "$OUT/decode.log" ;;
esac
