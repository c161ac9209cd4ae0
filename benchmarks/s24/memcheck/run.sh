#!/usr/bin/env bash
# Twenty-fourth session, the last call: the memcheck fuzz, every group, on main as it lands (four sanitizer processes).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1; T0=$(date +%s)
G_a="--group padding --group varlen --group paged --group tree"
G_b="--group window --group mods --group mla --group mla_gluon"
G_c="--group mla_fp8 --group fp8_token --group paged_fp8 --group dense_fp8"
G_d="--group mla192 --group gluon_padding --group mla_fp8_seesaw"
for f in a b c d; do g=G_$f; mkdir -p /tmp/mc-$f
  OUT=/tmp/mc-$f timeout ${MC_T:-400} compute-sanitizer --tool memcheck --error-exitcode 1 python3 scripts/gpu_memcheck_fuzz.py ${!g} > $OUT/memcheck-$f.txt 2>&1 &
done
for f in a b c d; do wait -n; echo "a memcheck process exit $?"; done
echo "memcheck done at $(( $(date +%s) - T0 )) s"
for f in a b c d; do grep -cE "^ok" $OUT/memcheck-$f.txt; grep -E "FAIL|summary|ERROR SUMMARY" $OUT/memcheck-$f.txt | head -6; done
