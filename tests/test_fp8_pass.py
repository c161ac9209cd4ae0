"""The fp8 forward's host pass and full-mask schedule levers (thirteenth session; GluonBackend.variant, all off by
default): fp8_pass_evict (transpose_v's V loads evict-first), fp8_vt_pad (bytes added to Vt's row stride) in
fagen/templates/gluon/fp8_host.py.j2 ([Note] fp8 V pass levers), and fp8_full_order (the tile order _SCHED of an fp8
full-mask forward: GluonBackend.tile_order and the template's full_plain). The render, the rule, and transpose_v on
Triton's interpreter; the kernels against float64 and bit for bit against the product run in scripts/gpu_fp8fwd_s13.py
on an H100."""

import re

import pytest
import torch

import fagen
from fagen import backends
from fagen.runtime.loader import load_source
from fagen.spec.kernel import KernelSpec
from _env import DEVICE, INTERPRETER_WORKS, ON_GPU
from test_fp8_wgs import variant

E4M3 = torch.float8_e4m3fn


def spec(**fields):
    return KernelSpec(**{"backend": "gluon", "head_dim": 128, "dtype": "fp8_e4m3", "mask": "causal", **fields})


def test_the_pass_levers_render_only_under_their_switches():
    """Off (the default) the render is the product's; fp8_pass_evict marks both of transpose_v's V loads (the
    permuted and the plain one) evict-first and nothing else; fp8_vt_pad adds its bytes to Vt's row stride; bf16
    renders never change."""
    with variant(fp8_pass_evict=0, fp8_vt_pad=0):
        base = {m: fagen.generate(spec(mask=m)) for m in ("causal", "none")}
        bf16 = fagen.generate(spec(dtype="bf16"))
    assert all("eviction_policy" not in s and "16 * 16)" in s for s in base.values())
    with variant(fp8_pass_evict=1):
        for m, before in base.items():
            src = fagen.generate(spec(mask=m))
            assert src.count('other=0.0, eviction_policy="evict_first")') == 1
            assert src.count('seq_k, eviction_policy="evict_first")') == 1
            assert src.replace(', eviction_policy="evict_first"', "") == before
        assert fagen.generate(spec(dtype="bf16")) == bf16
    with variant(fp8_vt_pad=128):
        src = fagen.generate(spec())
        assert src.count("(width + 15) // 16 * 16 + 128)") == 1 and src.replace(" + 128)", ")", 1) == base["causal"]
        assert fagen.generate(spec(dtype="bf16")) == bf16


@pytest.mark.skipif(ON_GPU and not INTERPRETER_WORKS, reason="the interpreter; the GPU script runs the kernels")
@pytest.mark.parametrize("sk", [37, 130])
def test_transpose_v_under_the_levers_gives_the_products_vt(sk):
    """transpose_v with both levers on: Vt's values bit for bit the product's (zeros past Sk included), its row stride
    the product's plus the pad, every stride a multiple of 16 bytes (a TMA descriptor)."""
    v = torch.randn(2, sk, 3, 128).to(E4M3).to(DEVICE).transpose(1, 2)  # [B, Hkv, Sk, D], heads inside rows
    want = fagen.load(spec(gqa=2)).transpose_v(v)
    with variant(fp8_pass_evict=1, fp8_vt_pad=128):
        sp = spec(gqa=2)
        mod = load_source(fagen.generate(sp), f"{sp.name}_test_pass_levers")
    got = mod.transpose_v(v)
    assert got.shape == want.shape and got.stride(2) == want.stride(2) + 128 and mod._tma_ready(got)
    assert all(s % 16 == 0 for s in got.stride()[:3])
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("order", [0, 2, 3])
def test_the_full_mask_order_follows_the_backend_rule(order):
    """fp8_full_order n renders _SCHED n and the tile counter for fp8 full-mask forwards without the window (d128 and
    d64's three warpgroups), and GluonBackend.tile_order / tile_schedule say the same; causal fp8, bf16 full and the
    window are untouched (0: no order, the plain loop, as before)."""
    cases = [dict(mask="none"), dict(mask="none", head_dim=64), dict(mask="none", gqa=4),
             dict(mask="none", window=True), dict(mask="none", dtype="bf16"), dict(mask="causal")]
    with variant(fp8_full_order=0):
        before = [fagen.generate(spec(**c)) for c in cases]
    with variant(fp8_full_order=order):
        for c, old in zip(cases, before):
            sp = spec(**c)
            src = fagen.generate(sp)
            got = re.search(r"^_SCHED = (\d)", src, flags=re.M)
            got = int(got.group(1)) if got else None
            assert got == backends.GLUON.tile_order(sp), c
            assert ("TileCounter" in src) == backends.GLUON.tile_schedule(sp) == (got is not None), c
            plain = c.get("dtype", "fp8_e4m3") == "fp8_e4m3" and c["mask"] == "none" and not c.get("window")
            if plain:
                assert got == (order or None), c
            else:
                assert src == old, c
