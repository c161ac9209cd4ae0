#!/bin/bash
# Issue 16 phase 2 on one H100: the gluon backend through fagen's own commands. Run from the repository root:
#   OUT=/some/folder bash benchmarks/hopper/6-integration/run.sh
# Each step has its own time limit, so a slow one leaves the others' results.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 FAGEN_CACHE_DIR=${FAGEN_CACHE_DIR:-/tmp/fagen-cache}
set -o pipefail
log() { echo; echo "== $(date -u +%T) $*"; }
{
log versions
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability())"

log "pytest tests/test_hopper.py (GPU reference test, selection, sm_90 compile)"
timeout 120 python3 -m pytest tests/test_hopper.py -q -p no:cacheprovider 2>&1 | tail -15

log "fagen verify: gluon d128 bf16, none/causal x gqa 1/4"
mkdir -p /tmp/specs
python3 - <<'PY'
from fagen.spec.kernel import KernelSpec
for mask in ("none", "causal"):
    for gqa in (1, 4):
        s = KernelSpec(head_dim=128, mask=mask, gqa=gqa, dtype="bf16", backend="gluon")
        open(f"/tmp/specs/{s.name}.toml", "w").write(s.to_toml())
PY
timeout 150 python3 -m fagen.cli verify /tmp/specs/*.toml --device cuda --scale gpu --time-budget 110 \
    --json $OUT/verify.json -q 2>&1

log "fagen.attention: which module serves (no grad / grad) and agreement with the Triton forward"
timeout 60 python3 - <<'PY' 2>&1
import torch, fagen
from fagen.runtime import resolve
torch.manual_seed(0)
for mask, hq, hkv, dtype in (("causal", 16, 16, torch.bfloat16), ("none", 32, 8, torch.bfloat16),
                             ("causal", 16, 16, torch.float16)):
    q = torch.randn(2, hq, 1000, 128, device="cuda", dtype=dtype)
    k, v = (torch.randn(2, hkv, 1000, 128, device="cuda", dtype=dtype) for _ in range(2))
    out = fagen.attention(q, k, v, mask=mask)
    served = [m.NAME for (m, _) in resolve._FAST.values()][-1]
    q.requires_grad_()
    out_g = fagen.attention(q, k, v, mask=mask)
    served_g = [m.NAME for (m, _) in resolve._FAST.values()][-1]
    print(f"{mask} {hq}/{hkv} {dtype}: no grad -> {served}; grad -> {served_g}; "
          f"max |diff| {(out.float() - out_g.detach().float()).abs().max().item():.3g}")
PY

log "fagen bench, d128 rows (gluon selected)"
timeout 200 python3 -m fagen.cli bench --suite standard --case fwd-d128-full-s16k --case fwd-d128-causal-s16k \
    --case fwd-gqa-d128-causal-s4k --skip-flex --json $OUT/bench.json 2>&1

log "the same rows, fagen only, FAGEN_HOPPER=0 (the Triton forward)"
FAGEN_HOPPER=0 timeout 100 python3 -m fagen.cli bench --suite standard --case fwd-d128-full-s16k \
    --case fwd-d128-causal-s16k --case fwd-gqa-d128-causal-s4k --impl fagen --json $OUT/bench_triton.json 2>&1
log done
} 2>&1 | tee $OUT/run.log
