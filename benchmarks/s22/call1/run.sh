#!/usr/bin/env bash
# Twenty-second session, call 1 on main (469ad159): the whole standard suite in one run (fp8 rows included), then the memcheck fuzz, every group, in two sanitizer processes at once.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
T0=$(date +%s); ph() { echo "$(date +%H:%M:%S) $1" >> $OUT/phases.txt; }
ph std; timeout ${STD_T:-270} python3 cli.py bench --suite standard --impl fagen --impl sdpa-cudnn --impl fagen-nondet --impl cudnn-fp8 --time-limit ${STD_L:-250} --json $OUT/std.json > $OUT/std.txt 2>&1
echo "std exit $? at $(( $(date +%s) - T0 )) s"; grep -E "^\| (bwd|fwd|dec)" $OUT/std.txt | cut -c1-200
ph memcheck
G_a="--group padding --group varlen --group paged --group tree"
G_b="--group window --group mods --group mla --group mla_gluon"
G_c="--group mla_fp8 --group fp8_token --group paged_fp8 --group dense_fp8"
for f in a b c; do g=G_$f
  OUT=$OUT timeout ${MC_T:-240} compute-sanitizer --tool memcheck --error-exitcode 1 python3 scripts/gpu_memcheck_fuzz.py ${!g} > $OUT/memcheck-$f.txt 2>&1 &
done
for f in a b c; do wait -n; echo "a memcheck process exit $?"; done
echo "memcheck done at $(( $(date +%s) - T0 )) s"
for f in a b c; do grep -cE "^ok" $OUT/memcheck-$f.txt; grep -E "FAIL|summary|ERROR SUMMARY" $OUT/memcheck-$f.txt | head -6; done; ph end
