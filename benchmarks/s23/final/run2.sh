#!/usr/bin/env bash
# Twenty-third session, a last check on merged main after the final call: the Gluon d64 forward's GPU test (which
# failed there, the traceback not returned), the mods suite's learned-bias row (NameError there, fixed on the CPU),
# and the learned bias's diagonal-sum tests on the GPU.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; T0=$(date +%s)
timeout 70 python3 -m pytest -q -x -p no:cacheprovider --tb=short tests/test_hopper_gpu.py -k "64" 2>&1 | tail -25
echo "hopper_gpu at $(( $(date +%s) - T0 )) s"
timeout 60 python3 cli.py bench --suite mods --case learned-bias+grad --skip-flex --json $OUT/mods-lb.json > $OUT/mods-lb.txt 2>&1
echo "mods-lb exit $? at $(( $(date +%s) - T0 )) s"; grep -E "learned|^\|" $OUT/mods-lb.txt | cut -c1-250 | head -5
timeout 60 python3 -m pytest -q -n 8 -p no:cacheprovider --tb=line tests/test_mods_diag_scratch.py 2>&1 | tail -6
echo "diag at $(( $(date +%s) - T0 )) s"
