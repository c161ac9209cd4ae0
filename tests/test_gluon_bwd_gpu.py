"""The Gluon backward on an H100/H200 through fagen.attention with gradients: both modes against the float64
reference (lengths not multiples of 64/128, rows that see no key, GQA), the exact zeros and the bitwise repeatability
of the deterministic mode, and the dQ mutant caught. Skipped elsewhere (Gluon kernels do not run in Triton's
interpreter); scripts/gpu_gluon_bwd_product.py runs the same checks and times the modes."""

import pytest
import torch

import fagen
from fagen.runtime import hopper, resolve
from fagen.spec.axes import DType
from fagen.spec.kernel import KernelSpec
from fagen.verify import engine, reference
from fagen.verify.tolerances import compare_grad

ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not ON_HOPPER, reason="runs on an sm_90 GPU (H100/H200)")]


@pytest.fixture
def any_size(monkeypatch):
    """Small problems take the Gluon backward too (hopper.BWD_MIN_WORK is a host-time floor, not a limit)."""
    monkeypatch.setattr(hopper, "BWD_MIN_WORK", 0)
    monkeypatch.delenv(hopper.ENV, raising=False)


def inputs(b, hq, hkv, sq, sk, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16)
            for shape in ((b, hq, sq, 128), (b, hkv, sk, 128), (b, hkv, sk, 128), (b, hq, sq, 128))]


def grads(fn, q, k, v, do):
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    return torch.autograd.grad(fn(qg, kg, vg), (qg, kg, vg), do)


def reference_grads(q, k, v, do, mask):
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    out, _ = reference.attention(q64, k64, v64, mask=mask)
    return torch.autograd.grad(out, (q64, k64, v64), do.double())


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("mask,gqa,sq,sk", [("causal", 1, 300, 300), ("none", 1, 200, 333), ("causal", 4, 257, 190),
                                            ("causal", 1, 300, 190), ("none", 4, 97, 1000)])
def test_gradients_match_the_float64_reference(any_size, mask, gqa, sq, sk, deterministic):
    """(causal, Sq 300 > Sk 190: rows 0..109 see no key and get dq = 0.)"""
    q, k, v, do = inputs(2, 2 * gqa, 2, sq, sk)
    assert resolve.resolve(q, k, v, mask, False, big_bwd=True).NAME.endswith("_gluon")
    got = grads(lambda *t: fagen.attention(*t, mask=mask, deterministic=deterministic), q, k, v, do)
    for name, g, r in zip(("dq", "dk", "dv"), got, reference_grads(q, k, v, do, mask)):
        compare_grad(name, g, r, DType.BF16)


def test_rows_that_see_one_key_get_exact_zeros(any_size):
    q, k, v, do = inputs(1, 2, 2, 100, 1, seed=1)
    dq, dk, dv = grads(lambda *t: fagen.attention(*t), q, k, v, do)
    assert (dq == 0).all() and (dk == 0).all() and dv.abs().sum() > 0
    q, k, v, do = inputs(1, 2, 2, 200, 200, seed=1)
    dq, _, _ = grads(lambda *t: fagen.attention(*t, mask="causal"), q, k, v, do)
    assert (dq[:, :, 0] == 0).all()  # row 0 sees key 0 only


@pytest.mark.parametrize("mask,hq,hkv", [("causal", 8, 2), ("none", 4, 4)])
def test_the_deterministic_mode_is_bitwise_repeatable(any_size, mask, hq, hkv):
    q, k, v, do = inputs(1, hq, hkv, 2000, 2000, seed=2)
    runs = [grads(lambda *t: fagen.attention(*t, mask=mask), q, k, v, do) for _ in range(3)]
    assert all(torch.equal(a, b) for r in runs[1:] for a, b in zip(r, runs[0]))


@pytest.mark.parametrize("mutant,fixed", [("gluon-bwd-dq-one-half", 0), ("gluon-bwd-fixed-no-scale", 1),
                                          ("gluon-bwd-fixed-fma-no-scale", 1), ("gluon-bwd-fixed-fma-limb", 1),
                                          ("gluon-bwd-fixed-tma-rows", 1)])
def test_the_dq_mutant_is_caught(mutant, fixed, monkeypatch):
    from fagen import backends
    from fagen.codegen import render
    monkeypatch.setitem(backends.GLUON.variant, "bwd_fixed", fixed)  # [Note] Fixed-point dQ
    # [Note] FMA rounding; the limb mutant: [Note] Two-limb FMA rounding (bwd_fixed_fma 3, with the qmul rows by TMA)
    monkeypatch.setitem(backends.GLUON.variant, "bwd_fixed_fma", 3 if "limb" in mutant else int("fma" in mutant))
    monkeypatch.setitem(backends.GLUON.variant, "bwd_fixed_tma", int("limb" in mutant or "tma" in mutant))
    render.render.cache_clear()
    spec = KernelSpec(backend="gluon", direction="bwd", head_dim=128, dtype="bf16", mask="causal")
    broken = engine.mutant_module(spec, mutant)
    render.render.cache_clear()
    q, k, v, do = inputs(1, 2, 2, 300, 300)
    got = grads(lambda *t: broken.attention(*t), q, k, v, do)
    with pytest.raises(AssertionError):
        compare_grad("dq", got[0], reference_grads(q, k, v, do, "causal")[0], DType.BF16)
