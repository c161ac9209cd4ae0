#!/usr/bin/env bash
# Twenty-second session, final call on merged main: capexp's script (branch s22-capexp, .gpu/src.tgz), the standard and serving suites, the memcheck fuzz's groups of what changed, GPU tests of the changed files (TESTS).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; T0=$(date +%s); ph() { echo "$(date +%H:%M:%S) $1" >> $OUT/phases.txt; }
ph capexp; mkdir -p /tmp/src && tar xzf .gpu/src.tgz -C /tmp
(cd /tmp/src/capexp && OUT=/tmp/out-capexp PYTHONPATH=/tmp/site:/tmp/src/capexp PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc-capexp timeout 90 python3 scripts/gpu_capexp_s22.py --round C) > $OUT/capexp.txt 2>&1
echo "capexp exit $? at $(( $(date +%s) - T0 )) s"; grep -E "TIME|checks:|phase" $OUT/capexp.txt | cut -c1-160
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
ph std; timeout ${STD_T:-175} python3 cli.py bench --suite standard --impl fagen --impl sdpa-cudnn --impl fagen-nondet --impl cudnn-fp8 --time-limit 160 --json $OUT/std.json > $OUT/std.txt 2>&1
echo "std exit $? at $(( $(date +%s) - T0 )) s"; grep -E "^\|(bwd|fwd)" $OUT/std.txt | cut -c1-190
ph serving; timeout ${SERV_T:-100} python3 cli.py bench --suite serving --json $OUT/serving.json > $OUT/serving.txt 2>&1
echo "serving exit $? at $(( $(date +%s) - T0 )) s"; grep -E "mla|fp8" $OUT/serving.txt | grep "^|" | cut -c1-170
ph memcheck
OUT=$OUT timeout 70 compute-sanitizer --tool memcheck --error-exitcode 1 python3 scripts/gpu_memcheck_fuzz.py --group gluon_padding > $OUT/memcheck-gp.txt 2>&1 &
OUT=$OUT timeout 70 compute-sanitizer --tool memcheck --error-exitcode 1 python3 scripts/gpu_memcheck_fuzz.py --group padding --group varlen > $OUT/memcheck-pv.txt 2>&1 &
ph tests; timeout ${PT_T:-90} python3 -m pytest -v -n 12 -p no:cacheprovider -rfE --tb=short ${TESTS:-} > $OUT/tests.txt 2>&1
echo "tests exit $? at $(( $(date +%s) - T0 )) s"; grep -E "FAILED|ERROR|passed|failed" $OUT/tests.txt | grep -v PASSED | tail -8
wait; echo "memcheck done at $(( $(date +%s) - T0 )) s"
for f in gp pv; do grep -cE "^ok" $OUT/memcheck-$f.txt; grep -E "FAIL|summary|ERROR SUMMARY" $OUT/memcheck-$f.txt | head -5; done; ph end
