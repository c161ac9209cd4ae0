#!/usr/bin/env bash
# Twenty-fourth session, final call on merged main: the standard and serving suites (benchmarks/README.md's tables),
# then the memcheck fuzz's groups of what changed (MEMGROUPS) beside the GPU tests of the changed files (TESTS).
# At most 8 files under $OUT (the device returns 8).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; T0=$(date +%s); ph() { echo "$(date +%H:%M:%S) $1" >> $OUT/phases.txt; }
ph seesaw; timeout ${SEE_T:-60} python3 scripts/gpu_seesaw8_s24.py --round B > $OUT/seesaw.txt 2>&1
echo "seesaw exit $? at $(( $(date +%s) - T0 )) s"; grep -E "^ratio|total" $OUT/seesaw.txt | cut -c1-150 | tail -8
ph std; timeout ${STD_T:-150} python3 cli.py bench --suite standard --impl fagen --impl sdpa-cudnn --impl fagen-nondet --impl cudnn-fp8 --time-limit 135 --json $OUT/std.json > $OUT/std.txt 2>&1
echo "std exit $? at $(( $(date +%s) - T0 )) s"; grep -E "^\|(bwd|fwd|dec)" $OUT/std.txt | cut -c1-190
ph serving; timeout ${SERV_T:-120} python3 cli.py bench --suite serving --json $OUT/serving.json > $OUT/serving.txt 2>&1
echo "serving exit $? at $(( $(date +%s) - T0 )) s"; grep -E "^\|(dec|fwd|bwd)" $OUT/serving.txt | cut -c1-170
ph memcheck
OUT=$OUT timeout ${MC_T:-110} compute-sanitizer --tool memcheck --error-exitcode 1 python3 scripts/gpu_memcheck_fuzz.py ${MEMGROUPS:-} > $OUT/memcheck.txt 2>&1 &
ph tests; timeout ${PT_T:-100} python3 -m pytest -q -n 8 -p no:cacheprovider -rfE --tb=short ${TESTS:-} > $OUT/tests.txt 2>&1
echo "tests exit $? at $(( $(date +%s) - T0 )) s"; grep -E "FAILED|ERROR|passed|failed" $OUT/tests.txt | tail -8
wait; echo "memcheck done at $(( $(date +%s) - T0 )) s"; grep -cE "^ok" $OUT/memcheck.txt; grep -E "FAIL|summary|ERROR SUMMARY|skip" $OUT/memcheck.txt | head -5; ph end
