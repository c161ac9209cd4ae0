"""Run by .ci/run inside a fresh venv that has the built wheel (not the checkout): render, load, run, compare."""

import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # no GPU in CI: the interpreter runs the kernel

import torch  # noqa: E402

import fagen  # noqa: E402
from fagen.verify import reference  # noqa: E402

installed = Path(fagen.__file__).resolve()
assert "site-packages" in installed.parts, f"fagen came from {installed}, not from the installed wheel"
spec = fagen.KernelSpec(head_dim=32, mask="causal", gqa=2, dtype="fp32")
module = fagen.load(spec)
q, k = torch.randn(1, 4, 37, 32), torch.randn(1, 2, 45, 32)
v = torch.randn_like(k)
out, lse = module.forward(q, k, v)
want, _ = reference.attention(q.double(), k.double(), v.double(), mask="causal")
err = (out.double() - want).abs().max().item()
import triton  # noqa: E402

print(f"wheel smoke: {spec.name} from {installed.parent}, triton {triton.__version__}, max |err| {err:.2e}")
sys.exit(0 if err < 1e-4 else 1)
