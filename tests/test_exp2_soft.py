"""[Note] Software exp2 (fagen/templates/triton/attention.py.j2): _exp2_soft against float64 2^x over its whole
range (-inf, below the -127 clamp, 0, NaN), and half-precision softcap forwards rendered with the knob on (all,
half and a quarter of the columns in software) against the float64 reference."""

import dataclasses
import math

import pytest
import torch
import triton
import triton.language as tl

from fagen.codegen.render import _context, environment, generate, template_name
from fagen.runtime.loader import load_source
from fagen.spec.axes import DType
from fagen.verify.properties import check_forward, check_nan_propagates
from conftest import DEVICE
from test_scores import approx_problems, softcap_spec

# Max relative error of _exp2_soft over [-126, 0] by degree (measured: 7.5e-5, 2.7e-6, 2.3e-7 with fp32 rounding).
BOUND = {3: 8e-5, 4: 3e-6, 5: 3e-7}


def soft_source(spec, every: int, degree: int = 4) -> str:
    """The spec's source rendered with the software-exp2 knob set (fagen.spec.defaults.SOFT_EXP2)."""
    assert every in (0, 1, 2, 4) and degree in (3, 4, 5)
    return environment().get_template(template_name(spec)).render(
        **{**_context(spec), "soft_exp2": {"every": every, "degree": degree}})


@triton.jit
def _apply(fn, X, Y, n, DEGREE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n, other=0.0)
    tl.store(Y + offs, fn(x, DEGREE), mask=offs < n)


def exp2_soft(x: torch.Tensor, degree: int, source: str | None = None) -> torch.Tensor:
    module = load_source(source or soft_source(softcap_spec(DType.BF16), 2, degree), "exp2_soft_helper")
    y = torch.empty_like(x)
    _apply[(triton.cdiv(x.numel(), 1024),)](module._exp2_soft, x, y, x.numel(), DEGREE=degree, BLOCK=1024)
    return y


def inputs() -> torch.Tensor:
    dense = torch.linspace(-126.0, 0.0, 1 << 15, dtype=torch.float64)
    near = torch.cat([torch.arange(-130, 3, dtype=torch.float64) + d for d in (0.0, 0.5, -0.5, 0.25, 1e-3, -1e-3)])
    return torch.cat([dense, near, torch.tensor([0.0, -0.0, 1.0, 5.5, -1e-7])]).float().to(DEVICE)


def relative_error(x: torch.Tensor, y: torch.Tensor) -> float:
    want = torch.exp2(x.double())
    return ((y.double() - want).abs() / want)[x >= -126].max().item()


@pytest.mark.parametrize("degree", [3, 4, 5])
def test_exp2_soft_matches_float64(degree):
    x = inputs()
    y = exp2_soft(x, degree)
    err = relative_error(x, y)
    print(f"degree {degree}: max relative error {err:.3g} over [-126, 5.5]")
    assert err <= BOUND[degree], err
    assert math.isnan(err) is False
    # Below the normal range: never negative, never above 2^-126; from -126.5 down (the -127 clamp) exactly 0.
    low = y[x < -126].double()
    assert (low >= 0).all() and (low <= 2.0 ** -126).all()
    assert (y[x < -126.5] == 0).all()
    special = exp2_soft(torch.tensor([float("-inf"), -127.0, -1e30, float("nan"), 0.0], device=DEVICE), degree)
    assert special[:3].tolist() == [0.0, 0.0, 0.0]  # [Note] Masking before exp2: -inf gives exactly 0
    assert math.isnan(special[3].item())
    assert abs(special[4].item() - 1.0) <= BOUND[degree]


def test_exp2_soft_has_teeth():
    """A wrong coefficient (the degree-4 linear term 1% off) fails the same bound."""
    source = soft_source(softcap_spec(DType.BF16), 2, 4)
    good = "        p = p * f + 0.69312179088592530\n"
    assert source.count(good) == 1
    broken = source.replace(good, good.replace("0.6931", "0.7000"))
    x = inputs()
    assert relative_error(x, exp2_soft(x, 4, broken)) > BOUND[4]


@pytest.mark.parametrize("dtype, every", [(DType.BF16, 1), (DType.BF16, 2), (DType.BF16, 4), (DType.FP16, 2)])
def test_softcap_forward_with_software_exp2_matches_reference(dtype, every):
    """A cap that bites (2.0 at magnitude 16), ragged lengths past one 16-key block; NaN in a key still propagates."""
    spec = softcap_spec(dtype)
    source = soft_source(spec, every)
    assert "_exp2_soft(" in source and source != soft_source(spec, 0)
    module = load_source(source, f"{spec.name}_soft_exp2_{every}")
    problem = [p for p in approx_problems(spec) if p.softcap == 2.0][0]
    check_forward(module, spec, problem, DEVICE)
    check_nan_propagates(module, spec, dataclasses.replace(problem, batch=1, heads_kv=1), DEVICE)


def test_knob_off_renders_todays_kernel():
    spec = softcap_spec(DType.BF16)
    assert soft_source(spec, 0) == generate(spec) and "_exp2_soft" not in generate(spec)
    fp32 = softcap_spec(DType.FP32)
    assert "_exp2_soft" not in soft_source(fp32, 2)  # fp32 kernels keep the exact path
