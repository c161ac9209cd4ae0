"""Tolerances and comparisons: what "equal to the float64 reference" means per dtype, and the failures."""

from __future__ import annotations

import dataclasses
import math

import torch

from fagen.spec.axes import DType

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
    # fp8 e4m3 forward: P is rounded to e4m3 (2^-4 relative) before P @ V. A CPU emulation of the kernel's numerics
    # (scripts/gpu_fp8.py emulate) on the bench's inputs (q ~ 3 N(0, 1), k and v with per-head scales 0.5..1.5,
    # S 1024 / 2048, d128, full and causal) needs atol = rtol = 0.045: 0.1 leaves about 2x. Coarse by nature: the
    # fp8 checks with teeth (RMSE against the emulation, the bf16 fingerprint) are scripts/gpu_fp8.py's.
    DType.FP8_E4M3: dict(atol=1e-1, rtol=1e-1),
}
# lse is float32 from fp32 scores in every dtype; only its summation order differs from the reference.
LSE_TOLERANCE = dict(atol=1e-4, rtol=1e-4)
# [Note] Kernel against kernel: when a property compares two kernel runs (a gqa kernel against the MHA kernel,
# two halves merged against the whole), each run may be TOLERANCE away from the truth, so by the triangle
# inequality they may be twice that apart. No single kernel is ever held to less than TOLERANCE.
PAIR = 2

# [Note] Gradient tolerances: |kernel - reference| <= atol * max(1, max|reference|) + rtol * |reference|, elementwise,
# against float64 autograd that uses the kernel's delta (see [Note] Delta from the saved output).
# A gradient is a sum of Sq (dK, dV) or Sk (dQ) products whose signs cancel, so an entry's rounding error follows the
# size of its terms, not of the (often much smaller) result: atol is relative to the tensor's largest entry, which
# tracks the inputs (q of magnitude 16 makes dK 16x larger, and its errors with it). The floor 1 is the size of one
# term for unit-normal inputs: where the exact gradient cancels to 0 (one visible key: dS = dO.v - dO.O = 0), the
# rounding of those terms remains. The peaks below come from a float64 emulation of the kernel's rounding over
# S up to 4096, D up to 128, q magnitude up to 16 (300 for fp16/bf16); each atol leaves a margin of about 4x.
#   fp32: ieee dots everywhere; fp32 rounding of large scores remains: peak 1.4e-5 of the max in that emulation,
#         but custom scales (0.3 with |q| 16: scores near 100) reached 5.7e-5 of the max (dv, tree, CPU
#         interpreter, 2026-11-22), so atol is 2e-4: a 3.5x margin over what was seen.
#   fp16: P and dS are rounded to fp16 (2^-11 relative) before the dV, dK and dQ dots, and dQ/dK/dV on store:
#         peak 6.5e-4 of the max.
#   bf16: the same with an 8-bit mantissa: peak 4.7e-3 of the max.
# Like the forward's table for fp16/bf16, but relative to a scale that grows with S and |q| instead of absolute.
# A mask off by one diagonal, a dropped -inf guard or a wrong head moves entries by a sizeable fraction of the max
# (tests/test_backward.py::test_check_backward_catches_mutants).
GRAD_TOLERANCE = {
    DType.FP32: dict(atol=2e-4, rtol=2e-5),
    DType.FP16: dict(atol=3e-3, rtol=3e-3),
    DType.BF16: dict(atol=2e-2, rtol=2e-2),
}


class PropertyFailure(AssertionError):
    """A kernel broke a property; the message says which, where and by how much."""


@dataclasses.dataclass
class Outcome:
    max_err: float  # worst |kernel - reference| over out
    max_lse_err: float


def compare(name: str, got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float,
            expected: str = "reference") -> float:
    """Raise PropertyFailure unless got ~ want; returns the max abs error over finite entries.

    `expected` names what `want` is in messages (the float64 reference, or another kernel's output).
    """
    got64, want = got.detach().double().cpu(), want.detach().double().cpu()
    if got64.shape != want.shape:
        raise PropertyFailure(f"{name}: shape {tuple(got64.shape)}, expected {tuple(want.shape)}")
    bad_nan = torch.isnan(got64) & ~torch.isnan(want)
    if bad_nan.any():
        idx = tuple(bad_nan.nonzero()[0].tolist())
        raise PropertyFailure(f"{name}: NaN at {idx} ({int(bad_nan.sum())} NaNs), {expected} {want[idx].item():.6g}")
    lost_nan = torch.isnan(want) & ~torch.isnan(got64)  # NaN in real inputs must reach the output, not vanish
    if lost_nan.any():
        idx = tuple(lost_nan.nonzero()[0].tolist())
        raise PropertyFailure(f"{name}: {got64[idx].item():.6g} at {idx} where the {expected} is NaN "
                              f"({int(lost_nan.sum())} entries): a NaN input was silently dropped")
    inf_mismatch = torch.isinf(got64) != torch.isinf(want)
    both_inf = torch.isinf(got64) & torch.isinf(want)
    inf_mismatch |= both_inf & (torch.sign(got64) != torch.sign(want))
    if inf_mismatch.any():
        idx = tuple(inf_mismatch.nonzero()[0].tolist())
        raise PropertyFailure(f"{name}: {got64[idx].item():.6g} at {idx}, {expected} {want[idx].item():.6g}")
    finite = torch.isfinite(want)
    err = torch.where(finite, (got64 - want).abs(), 0.0)
    allowed = atol + rtol * want.abs()
    over = finite & (err > allowed)
    if over.any():
        idx = tuple(over.nonzero()[0].tolist())
        raise PropertyFailure(
            f"{name}: {got64[idx].item():.6g} at {idx}, {expected} {want[idx].item():.6g} "
            f"(|err| {err[idx].item():.3g} > {allowed[idx].item():.3g}; {int(over.sum())} of {over.numel()} over; "
            f"max |err| {err.max().item():.3g})")
    return err.max().item() if err.numel() else 0.0


def check_finite(out: torch.Tensor, lse: torch.Tensor, what: str = "forward") -> None:
    """out is finite everywhere and lse is finite or -inf (a row that sees no key): never NaN, never +inf.

    Holds for finite inputs and for NaN in padding alike: padded query rows give out = 0 and lse = -inf.
    """
    for name, bad in (("out", ~torch.isfinite(out)), ("lse", torch.isnan(lse) | (lse == float("inf")))):
        if bad.any():
            t = out if name == "out" else lse
            idx = tuple(bad.nonzero()[0].tolist())
            raise PropertyFailure(f"{what}: {name} is {t[idx].item()} at {idx} ({int(bad.sum())} entries); "
                                  f"{name} must be {'finite' if name == 'out' else 'finite or -inf'}")


def compare_pair(name: str, got: torch.Tensor, want: torch.Tensor, dtype: DType) -> float:
    """Two kernel outputs agree within PAIR x TOLERANCE (see [Note] Kernel against kernel)."""
    tol = TOLERANCE[dtype]
    return compare(name, got, want, atol=PAIR * tol["atol"], rtol=PAIR * tol["rtol"], expected="expected")


def compare_pair_lse(name: str, got: torch.Tensor, want: torch.Tensor) -> float:
    err = compare(name, got, want, atol=PAIR * LSE_TOLERANCE["atol"], rtol=PAIR * LSE_TOLERANCE["rtol"],
                  expected="expected")
    return err if math.isfinite(err) else 0.0


def compare_grad(name: str, got: torch.Tensor, want: torch.Tensor, dtype: DType) -> float:
    """compare() under GRAD_TOLERANCE, whose atol is relative to max(1, max|want|) (see [Note] Gradient tolerances)."""
    unit = max(1.0, want.detach().abs().max().item()) if want.numel() else 1.0
    tol = GRAD_TOLERANCE[DType(dtype)]
    return compare(name, got, want, atol=tol["atol"] * unit, rtol=tol["rtol"])
