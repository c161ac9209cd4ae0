#!/usr/bin/env bash
# Twenty-second session, last call on merged main (softcap selection included): the standard suite in one run, then GPU tests of the flipped defaults (TESTS).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; T0=$(date +%s); ph() { echo "$(date +%H:%M:%S) $1" >> $OUT/phases.txt; }
ph std; timeout ${STD_T:-165} python3 cli.py bench --suite standard --impl fagen --impl sdpa-cudnn --impl fagen-nondet --impl cudnn-fp8 --time-limit 150 --json $OUT/std.json > $OUT/std-log.txt 2>&1
echo "std exit $? at $(( $(date +%s) - T0 )) s"; grep -E "^\|(bwd|fwd)" $OUT/std-log.txt | cut -c1-190
ph tests; timeout ${PT_T:-140} python3 -m pytest -v -n 12 -p no:cacheprovider -rfE --tb=short ${TESTS:-} > $OUT/tests-log.txt 2>&1
echo "tests exit $? at $(( $(date +%s) - T0 )) s"; grep -E "FAILED|ERROR|passed|failed" $OUT/tests-log.txt | grep -v PASSED | tail -12; ph end
