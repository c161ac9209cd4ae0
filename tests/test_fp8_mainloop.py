"""The fp8 forward's main loop, thirteenth session (issue 28): exponentials on the FMA pipe (GluonBackend.variant
fp8_exp_poly, [Note] fp8 exp2 on the FMA pipe), O's rescale skipped by the warp (fp8_o_warp_skip, [Note] fp8 O
rescale by warp) and the lazy max (fp8_lazy_max, [Note] fp8 lazy max), in fagen/templates/gluon/attention.py.j2. The
render (what reads the switches), and the sm_90 build on the CPU: no spills, the MUFU exponentials of the unmasked
loop one in K fewer, the vote and the uniform branch around the rescale. The kernels against float64 (and the skip
bit for bit against the product, with mutants that must fail) run in scripts/gpu_fp8mma_s13.py on an H100."""

import re

import pytest

import fagen
from fagen.spec.kernel import KernelSpec
from test_fp8_wgs import variant
from test_hopper_compile import build_sm90


def render(mask="causal", dtype="fp8_e4m3", head_dim=128, **fields):
    return fagen.generate(KernelSpec(backend="gluon", head_dim=head_dim, mask=mask, dtype=dtype, **fields))


def test_switches_render_only_where_on_and_only_for_fp8():
    with variant(fp8_exp_poly=0, fp8_o_warp_skip=0):
        before, bf16 = render(), render(dtype="bf16")
    assert "_exp2_mix" not in before and "_o_rescale" not in before
    for k in (4, 8, 16):
        with variant(fp8_exp_poly=k):
            src = render()
            assert render(dtype="bf16") == bf16
        mix = src[src.index("def _exp2_mix("):src.index("\n\n\n", src.index("def _exp2_mix("))]
        assert mix.count("ex2.approx.ftz.f32") == k - 1 and f"pack={k})" in mix and mix.count("fma.rn.f32") == 3
        assert f"add.u32 ${k - 1}, p, e;" in mix and f"max.f32 f, ${2 * k - 1}, 0fC2FA0000" in mix
        step = src[src.index("def _softmax("):src.index("\n\n\n", src.index("def _softmax("))]
        assert "if MASKED:\n        p = gl.exp2(" in step and "p = _exp2_mix(" in step  # masked steps keep exp2
    with variant(fp8_o_warp_skip=1):
        src = render()
        assert render(dtype="bf16") == bf16
    resc = src[src.index("def _o_rescale("):src.index("\n\n\n", src.index("def _o_rescale("))]
    assert resc.count("mul.f32 $") == 64 and "vote.sync.any.pred" in resc and "@!p bra.uni SKIP" in resc
    assert '"=r,' in resc and ",0,1,2," in resc and "pack=64)" in resc  # the outputs tied to O's registers
    assert "o_acc = _o_rescale(o_acc, " in src
    assert "fp8 lazy max" not in before
    with variant(fp8_lazy_max=1):
        src = render()
        assert render(dtype="bf16") == bf16
    assert src.count("m_new = gl.where(m_new > m_i + 0.75, m_new, m_i)  # [Note] fp8 lazy max") == 2  # both branches


_SCRIPT = r"""
import json, os, re, sys
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
import fagen
from fagen import backends
from fagen.spec.kernel import KernelSpec
from fagen.codegen import render
from fagen.runtime.loader import load_source
from sm90 import loops, ptxas

out = {}
for key, fields in json.loads(sys.argv[2]).items():
    fields = dict(fields)
    backends.GLUON.variant["fp8_exp_poly"] = fields.pop("poly", 0)
    backends.GLUON.variant["fp8_o_warp_skip"] = fields.pop("oskip", 0)
    spec = KernelSpec(backend="gluon", **{"head_dim": 128, "dtype": "fp8_e4m3", **fields})
    render.render.cache_clear()
    mod = load_source(fagen.generate(spec), spec.name + "_" + key)
    ptx = mod.compile_for().asm["ptx"]
    res = ptxas(ptx)[0]["_attn_fwd_hopper"]
    bodies = loops(ptx, min_wgmma=2, innermost=True)
    out[key] = dict(spills=res.spill_stores + res.spill_loads, stack=res.stack,
                    ex2=sorted(body.count("ex2.approx") for body in bodies),
                    vote=[body.count("vote.sync.any.pred") for body in bodies],
                    wgmma=[body.count("wgmma.mma_async") for body in bodies],
                    mul=sorted(len(re.findall(r"^\s*mul\.f32\s", body, flags=re.M)) for body in bodies))
print("RESULT " + json.dumps(out))
"""
MODULES = {"product": dict(mask="none"), "poly8": dict(mask="none", poly=8),
           "poly8_causal": dict(mask="causal", poly=8), "oskip": dict(mask="none", oskip=1)}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_sm90(tmp_path_factory, _SCRIPT, MODULES, "fp8-mainloop-sm90")


@pytest.mark.parametrize("key", list(MODULES))
def test_builds_without_spills(built, key):
    r = built[key]
    assert r["spills"] == 0 and r["stack"] == 0, r


def test_exp2_on_the_fma_pipe_takes_one_in_eight_off_the_unmasked_loops_mufu(built):
    """Each loop that issues wgmma (two a consumer warpgroup: unmasked and masked) has the product's 66 exponentials
    (64 of P, 2 of alpha); with fp8_exp_poly 8 the unmasked loops lose 64 / 8 of them, the masked ones none."""
    base, poly = built["product"]["ex2"], built["poly8"]["ex2"]
    assert base and set(base) == {66} and len(poly) == len(base), (base, poly)
    assert poly == sorted([58] * (len(base) // 2) + [66] * (len(base) // 2)), (base, poly)
    assert built["poly8_causal"]["ex2"] == poly, built["poly8_causal"]


def test_o_rescale_by_warp_votes_and_keeps_its_64_multiplies(built):
    r, base = built["oskip"], built["product"]
    assert r["vote"] and set(r["vote"]) == {1}, r  # one vote a step, in every loop
    assert set(base["vote"]) == {0}, base


def test_each_step_loop_issues_eight_wgmma(built):
    """Each step loop of the product issues S (4) and P V (4) wgmma (the row sum by wgmma, fp8_l_mma, was removed
    in the thirteenth session: it read NaN on the H100)."""
    base = built["product"]["wgmma"]
    assert base and set(base) == {8}, base
