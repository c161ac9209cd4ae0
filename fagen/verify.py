"""Properties of generated kernels, checked against the float64 reference."""

from __future__ import annotations

import dataclasses
import math

import torch

from fagen import reference
from fagen.enums import DType
from fagen.spec import KernelSpec
from fagen.strategies import Problem
from fagen.tables import TORCH_DTYPE

# [Note] Tolerances: |kernel - reference| <= atol + rtol * |reference|, elementwise, against float64.
# Both sides see the same rounded inputs, so what remains is the kernel's own rounding:
#   fp32: fp32 dots ("ieee") and fp32 softmax; errors ~1e-6.
#   fp16: P is rounded to fp16 (11-bit mantissa) before P @ V, and out to fp16: ~2^-11 relative each.
#   bf16: the same with an 8-bit mantissa: ~2^-8 relative each; out in [1, 2) rounds by up to 4e-3.
# A wrong mask, a dropped rescale or a wrong head moves outputs by O(0.1) and fails all of these.
TOLERANCE = {
    DType.FP32: dict(atol=2e-5, rtol=2e-5),
    DType.FP16: dict(atol=3e-3, rtol=3e-3),
    DType.BF16: dict(atol=2e-2, rtol=2e-2),
}
# lse is float32 from fp32 scores in every dtype; only its summation order differs from the reference.
LSE_TOLERANCE = dict(atol=1e-4, rtol=1e-4)

# [Note] Gradient tolerances: |kernel - reference| <= atol * max(1, max|reference|) + rtol * |reference|, elementwise,
# against float64 autograd that uses the kernel's delta (see [Note] Delta from the saved output).
# A gradient is a sum of Sq (dK, dV) or Sk (dQ) products whose signs cancel, so an entry's rounding error follows the
# size of its terms, not of the (often much smaller) result: atol is relative to the tensor's largest entry, which
# tracks the inputs (q of magnitude 16 makes dK 16x larger, and its errors with it). The floor 1 is the size of one
# term for unit-normal inputs: where the exact gradient cancels to 0 (one visible key: dS = dO.v - dO.O = 0), the
# rounding of those terms remains. The peaks below come from a float64 emulation of the kernel's rounding over
# S up to 4096, D up to 128, q magnitude up to 16 (300 for fp16/bf16); each atol leaves a margin of about 4x.
#   fp32: ieee dots everywhere; fp32 rounding of large scores remains: peak 1.4e-5 of the max.
#   fp16: P and dS are rounded to fp16 (2^-11 relative) before the dV, dK and dQ dots, and dQ/dK/dV on store:
#         peak 6.5e-4 of the max.
#   bf16: the same with an 8-bit mantissa: peak 4.7e-3 of the max.
# Like the forward's table for fp16/bf16, but relative to a scale that grows with S and |q| instead of absolute.
# A mask off by one diagonal, a dropped -inf guard or a wrong head moves entries by a sizeable fraction of the max
# (tests/test_backward.py::test_check_backward_catches_mutants).
GRAD_TOLERANCE = {
    DType.FP32: dict(atol=5e-5, rtol=2e-5),
    DType.FP16: dict(atol=3e-3, rtol=3e-3),
    DType.BF16: dict(atol=2e-2, rtol=2e-2),
}


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
    ref_out, ref_lse = reference.attention(q, k, v, mask=spec.mask, **kwargs)
    err = compare("out", out, ref_out, **TOLERANCE[spec.dtype])
    lse_err = compare("lse", lse, ref_lse, **LSE_TOLERANCE)
    return Outcome(max_err=err, max_lse_err=lse_err if math.isfinite(lse_err) else 0.0)


@dataclasses.dataclass
class GradOutcome(Outcome):
    max_dq_err: float  # worst |kernel - reference| over dq, dk, dv
    max_dk_err: float
    max_dv_err: float


def grad_output(problem: Problem, spec: KernelSpec, device: str = "cpu") -> torch.Tensor:
    """dO for a problem: fresh normal data from its seed (not the inputs' stream); NaN in padded rows if poisoned."""
    gen = torch.Generator().manual_seed(problem.seed ^ 0x5EED)
    do = torch.randn(problem.batch, problem.heads_kv * spec.gqa, problem.seq_q, spec.head_dim, generator=gen)
    if problem.poison and problem.seqlens_q is not None:
        for b, lq in enumerate(problem.seqlens_q):
            do[b, :, lq:] = float("nan")
    return do.to(getattr(torch, TORCH_DTYPE[spec.dtype])).to(device)


def compare_grad(name: str, got: torch.Tensor, want: torch.Tensor, dtype: DType) -> float:
    """compare() under GRAD_TOLERANCE, whose atol is relative to max(1, max|want|) (see [Note] Gradient tolerances)."""
    unit = max(1.0, want.detach().abs().max().item()) if want.numel() else 1.0
    tol = GRAD_TOLERANCE[DType(dtype)]
    return compare(name, got, want, atol=tol["atol"] * unit, rtol=tol["rtol"])


def reference_gradients(q, k, v, do, mask, *, out=None, **kwargs):
    """(out, lse, dq, dk, dv) in float64: autograd through the reference. dO rows past seqlens_q are ignored.

    With `out` (the output a backward kernel is given), the softmax backward uses delta = rowsum(dO * out) as the
    kernel does: see [Note] Delta from the saved output.
    """
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_out, lse = reference.attention(q64, k64, v64, mask=mask, **kwargs)
    do64 = do.detach().double()
    if kwargs.get("seqlens_q") is not None:  # padded rows of dO are garbage by contract: they carry no gradient
        rows = torch.arange(do64.shape[2], device=do64.device)
        valid = rows[None, :] < kwargs["seqlens_q"].long()[:, None]  # [B, Sq]
        do64 = torch.where(valid[:, None, :, None], do64, 0.0)
    loss = (ref_out * do64).sum()
    if out is not None:
        # [Note] Delta from the saved output
        # The softmax backward needs delta_i = rowsum(dP * P)_i = rowsum(dO * O)_i. A flash backward only has O
        # rounded to the output dtype, so its delta is off by d_i = rowsum(dO * (out - O))_i, which moves dQ and dK
        # by -scale * d_i * (PK)_i and -scale * (P^T (d * Q)): for bf16 that is ~1e-2 of a unit-sized gradient,
        # more than the rounding of the kernel's own arithmetic, and for large-magnitude q it scales with |q|.
        # It is a property of the saved output, not of the backward kernels, and out itself is checked against the
        # reference. Subtracting sum_i d_i * lse_i from the loss gives d(loss)/dS_ij = P_ij (dP_ij - delta_i - d_i):
        # the exact gradient under the kernel's delta (d(lse_i)/dS_ij = P_ij), so the kernel's own error remains.
        d = (do64 * (out.detach().double() - ref_out.detach())).sum(-1)
        d = torch.where(torch.isfinite(lse), d, 0.0)
        loss = loss - (d * torch.where(torch.isfinite(lse), lse, 0.0)).sum()
    loss.backward()
    return ref_out.detach(), lse.detach(), q64.grad, k64.grad, v64.grad


def check_backward(module, spec: KernelSpec, problem: Problem, device: str = "cpu") -> GradOutcome:
    """forward() and backward() of a loaded bwd module match float64 autograd, with no NaN, on one problem."""
    (q, k, v), kwargs = problem.inputs(spec, device)
    do = grad_output(problem, spec, device)
    out, lse = module.forward(q, k, v, **kwargs)
    dq, dk, dv = module.backward(do, q, k, v, out, lse, **kwargs)
    for name, got, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        if got.dtype != like.dtype or got.shape != like.shape:
            raise PropertyFailure(f"{name}: {got.dtype} {tuple(got.shape)}, want {like.dtype} {tuple(like.shape)}")
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = reference_gradients(q, k, v, do, spec.mask, out=out, **kwargs)
    err = compare("out", out, ref_out, **TOLERANCE[spec.dtype])
    lse_err = compare("lse", lse, ref_lse, **LSE_TOLERANCE)
    grad_errs = [compare_grad(name, got, want, spec.dtype)
                 for name, got, want in (("dq", dq, ref_dq), ("dk", dk, ref_dk), ("dv", dv, ref_dv))]
    return GradOutcome(err, lse_err if math.isfinite(lse_err) else 0.0, *grad_errs)
