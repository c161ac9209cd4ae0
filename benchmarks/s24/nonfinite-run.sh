#!/usr/bin/env bash
# Twenty-fourth session: the fp8 seesaw's non-finite Q guard. The new test on the fixed template, then on the
# template before the fix (expected red), then the seesaw script's checks on the fixed template.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1; T0=$(date +%s)
timeout 90 python3 -m pytest -q -p no:cacheprovider -rfE --tb=line tests/test_mla_fp8_api.py > $OUT/fixed.txt 2>&1
echo "fixed exit $? at $(( $(date +%s) - T0 )) s"; tail -4 $OUT/fixed.txt
cp fagen/templates/gluon/mla_seesaw.j2 /tmp/fixed.j2; cp .gpu/mla_seesaw_prefix.j2 fagen/templates/gluon/mla_seesaw.j2
timeout 60 python3 -m pytest -q -p no:cacheprovider -rfE --tb=line tests/test_mla_fp8_api.py -k non_finite > $OUT/prefix.txt 2>&1
echo "before the fix exit $? at $(( $(date +%s) - T0 )) s"; grep -E "FAILED|passed|failed|assert" $OUT/prefix.txt | head -6 | cut -c1-250
cp /tmp/fixed.j2 fagen/templates/gluon/mla_seesaw.j2
[ -n "${SEE:-}" ] && timeout 60 python3 scripts/gpu_seesaw8_s24.py --round B > $OUT/seesaw.txt 2>&1
echo "seesaw exit $? at $(( $(date +%s) - T0 )) s"; grep -E "^check|^ratio|total" $OUT/seesaw.txt | cut -c1-160 | tail -16
