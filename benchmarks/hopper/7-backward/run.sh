#!/bin/bash
# The phase-3 GPU run (one `run` call on an H100): a smoke call of the Gluon backward under a timeout (a hang in
# the fixed-order dQ would show here), then scripts/hopper_bwd_gpu.py, then `fagen verify` on a gluon bwd spec.
# Usage (repository root): OUT=/tmp/out bash benchmarks/hopper/7-backward/run.sh
set -u
OUT=${OUT:-/tmp}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv > "$OUT/gpu.txt" 2>&1
timeout 120 python - > "$OUT/smoke.txt" 2>&1 <<'PY'
import torch, fagen
from fagen.spec.kernel import KernelSpec
m = fagen.load(KernelSpec(backend="gluon", head_dim=128, mask="causal", gqa=2, dtype="bf16", direction="bwd"))
q = torch.randn(1, 4, 1000, 128, device="cuda", dtype=torch.bfloat16)
k = torch.randn(1, 2, 1000, 128, device="cuda", dtype=torch.bfloat16)
o, l = m.forward(q, k, k)
g = m.backward(torch.randn_like(q), q, k, k, o, l)
torch.cuda.synchronize()
print("smoke ok", [t.float().norm().item() for t in g])
PY
echo "smoke rc $?"; tail -3 "$OUT/smoke.txt"
if grep -q "smoke ok" "$OUT/smoke.txt"; then
  timeout 330 python scripts/hopper_bwd_gpu.py 2>&1 | grep -v Warning | tail -45
  timeout 80 python -m pytest -q -p no:cacheprovider tests/test_hopper.py -k on_hopper > "$OUT/pytest.txt" 2>&1
  echo "pytest rc $?"; tail -3 "$OUT/pytest.txt"
  timeout 90 python -m fagen.cli verify --backend gluon --direction bwd --head-dim 128 --mask causal --gqa 2 \
    --dtype bf16 --device cuda --examples 8 > "$OUT/verify.txt" 2>&1
  echo "verify rc $?"; tail -12 "$OUT/verify.txt"
else
  timeout 300 python scripts/hopper_bwd_proto.py gpu 2>&1 | tail -12
fi
