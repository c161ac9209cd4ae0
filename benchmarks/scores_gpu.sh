#!/usr/bin/env bash
# Issue 15 on the H100 in one device call: the score-switch bench rows (`fagen bench --suite scores`), then the
# score-switch property suite at GPU scale (HYPOTHESIS_PROFILE=ci, -n 8). Logs and JSON go to $OUT.
#   BENCH_S: seconds for the bench (0 skips it); TESTS_S: seconds for the tests; TESTS: pytest node ids/files.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-logs}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
BENCH_S=${BENCH_S:-230}; TESTS_S=${TESTS_S:-330}
if [ "$BENCH_S" -gt 0 ]; then
  timeout "$BENCH_S" python3 cli.py bench --suite scores ${BENCH_ARGS:-} --json "$OUT/scores.json" \
    --time-limit $(( BENCH_S - 25 )) > "$OUT/scores-bench.log" 2>&1
  echo "bench exit $?"; tail -c 3500 "$OUT/scores-bench.log"
fi
if [ "$TESTS_S" -gt 0 ]; then
  HYPOTHESIS_PROFILE=ci timeout "$TESTS_S" python3 -m pytest ${TESTS:-tests/test_scores.py} -v -n 8 \
    -p no:cacheprovider -rfE --tb=short --durations=25 > "$OUT/scores-tests.log" 2>&1
  echo "pytest exit $?"; echo "passed $(grep -cE ' PASSED ' "$OUT/scores-tests.log")"
  grep -E " (FAILED|ERROR) " "$OUT/scores-tests.log" | head -20
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/scores-tests.log" | cut -c1-240 | tail -8
  grep -A27 "slowest" "$OUT/scores-tests.log" | cut -c1-160
fi
if [ "${PROBE_S:-0}" -gt 0 ]; then  # benchmarks/scores_probe.py: configs, PTX tanh, the softcap backward
  timeout "$PROBE_S" python3 benchmarks/scores_probe.py ${PROBE_ARGS:-} --json "$OUT/scores-probe.json" \
    > "$OUT/scores-probe.log" 2>&1
  echo "probe exit $?"; grep -v Warning "$OUT/scores-probe.log" | tail -25
fi
