#!/bin/bash
# Phase 4, GPU run 1 (one `run` call on an H100): a smoke call under a timeout (a hang in the pipelined fixed-order
# dQ would show here), the dQ-writer variant sweep against cuDNN and the Triton backward, the mutants, the GPU
# tests of tests/test_hopper.py. Usage (repository root): OUT=/tmp/out bash benchmarks/hopper/8-pipelined-dq/run1.sh
set -u
OUT=${OUT:-/tmp}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu,driver_version --format=csv \
  > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
timeout 60 python - > "$OUT/smoke.txt" 2>&1 <<'PY'
import torch, fagen
from fagen.spec.kernel import KernelSpec
for mask, gqa in (("causal", 2), ("none", 1)):
    m = fagen.load(KernelSpec(backend="gluon", head_dim=128, mask=mask, gqa=gqa, dtype="bf16", direction="bwd"))
    q = torch.randn(2, 2 * gqa, 1000, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 2, 1000, 128, device="cuda", dtype=torch.bfloat16)
    o, l = m.forward(q, k, k)
    g = m.backward(torch.randn_like(q), q, k, k, o, l)
    torch.cuda.synchronize()
    print("smoke ok", mask, gqa, [t.float().norm().item() for t in g])
PY
echo "smoke rc $?"; tail -3 "$OUT/smoke.txt"
if grep -q "smoke ok none" "$OUT/smoke.txt"; then
  timeout 170 python scripts/hopper_bwd_sweep.py 2>&1 | grep -v Warning | tail -25
  echo "sweep rc $?"
  timeout 45 python scripts/hopper_bwd_mutant.py 2>&1 | grep -v Warning | tail -8
  timeout 60 python -m pytest -q -p no:cacheprovider tests/test_hopper.py -k on_hopper > "$OUT/pytest.txt" 2>&1
  echo "pytest rc $?"; tail -3 "$OUT/pytest.txt"
fi
