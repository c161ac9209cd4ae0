"""Properties of generated kernels, checked against the float64 reference."""

from __future__ import annotations

import dataclasses
import math

import torch

from fagen import reference
from fagen.enums import DType
from fagen.spec import KernelSpec
from fagen.strategies import Problem

# [Note] Tolerances: |kernel - reference| <= atol + rtol * |reference|, elementwise, against float64.
# Both sides see the same rounded inputs, so what remains is the kernel's own rounding:
#   fp32: fp32 dots ("ieee") and fp32 softmax. On the GPU exp2 is ex2.approx (~2 ulp) and scores of
#         large-magnitude logits (|s| ~ 100) carry |s| * 2^-24 * sqrt(D) absolute error: the H100 showed
#         max errors of 2.2e-5 .. 2.7e-5 at magnitude 16, so 1e-4 keeps a 4x margin.
#   fp16: P is rounded to fp16 (11-bit mantissa) before P @ V, and out to fp16: ~2^-11 relative each.
#   bf16: the same with an 8-bit mantissa: ~2^-8 relative each; out in [1, 2) rounds by up to 4e-3.
# A wrong mask, a dropped rescale or a wrong head moves outputs by O(0.1) and fails all of these.
TOLERANCE = {
    DType.FP32: dict(atol=1e-4, rtol=1e-4),
    DType.FP16: dict(atol=3e-3, rtol=3e-3),
    DType.BF16: dict(atol=2e-2, rtol=2e-2),
}
# lse is float32 from fp32 scores in every dtype; only its summation order differs from the reference.
LSE_TOLERANCE = dict(atol=1e-4, rtol=1e-4)


class PropertyFailure(AssertionError):
    """A kernel broke a property; the message says which, where and by how much."""


@dataclasses.dataclass
class Outcome:
    max_err: float  # worst |kernel - reference| over out
    max_lse_err: float


def compare(name: str, got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float) -> float:
    """Raise PropertyFailure unless got ~ want; returns the max abs error over finite entries."""
    got64, want = got.detach().double().cpu(), want.detach().double().cpu()
    if got64.shape != want.shape:
        raise PropertyFailure(f"{name}: shape {tuple(got64.shape)}, expected {tuple(want.shape)}")
    bad_nan = torch.isnan(got64) & ~torch.isnan(want)
    if bad_nan.any():
        idx = tuple(bad_nan.nonzero()[0].tolist())
        raise PropertyFailure(f"{name}: NaN at {idx} ({int(bad_nan.sum())} NaNs), reference {want[idx].item():.6g}")
    inf_mismatch = torch.isinf(got64) != torch.isinf(want)
    both_inf = torch.isinf(got64) & torch.isinf(want)
    inf_mismatch |= both_inf & (torch.sign(got64) != torch.sign(want))
    if inf_mismatch.any():
        idx = tuple(inf_mismatch.nonzero()[0].tolist())
        raise PropertyFailure(f"{name}: {got64[idx].item():.6g} at {idx}, reference {want[idx].item():.6g}")
    finite = torch.isfinite(want)
    err = torch.where(finite, (got64 - want).abs(), 0.0)
    allowed = atol + rtol * want.abs()
    over = finite & (err > allowed)
    if over.any():
        idx = tuple(over.nonzero()[0].tolist())
        raise PropertyFailure(
            f"{name}: {got64[idx].item():.6g} at {idx}, reference {want[idx].item():.6g} "
            f"(|err| {err[idx].item():.3g} > {allowed[idx].item():.3g}; {int(over.sum())} of {over.numel()} over; "
            f"max |err| {err.max().item():.3g})")
    return err.max().item() if err.numel() else 0.0


def check_forward(module, spec: KernelSpec, problem: Problem, device: str = "cpu") -> Outcome:
    """forward() of a loaded module matches the float64 reference, with no NaN, on one problem."""
    (q, k, v), kwargs = problem.inputs(spec, device)
    out, lse = module.forward(q, k, v, **kwargs)
    if out.dtype != q.dtype or lse.dtype != torch.float32:
        raise PropertyFailure(f"dtypes: out {out.dtype} (want {q.dtype}), lse {lse.dtype} (want float32)")
    ref_out, ref_lse = reference.attention(q, k, v, mask=spec.mask, **kwargs)  # kwargs carry the scale too
    err = compare("out", out, ref_out, **TOLERANCE[spec.dtype])
    lse_err = compare("lse", lse, ref_lse, **LSE_TOLERANCE)
    return Outcome(max_err=err, max_lse_err=lse_err if math.isfinite(lse_err) else 0.0)
