"""The fp8 forward's packed P carry (GluonBackend.variant fp8_p_cvt 3, [Note] fp8 P packed carry in
fagen/templates/gluon/attention.py.j2; eleventh session): P handed from one step to the next as int32 words of four
e4m3 keys; and the 192-key steps built on it (fp8_n192, [Note] fp8 192-key steps). The render (what reads the
switches), and the sm_90 build on the CPU: no spills, P not repacked in the loop, the matmuls e4m3. The kernel against float64, and bit for bit against the product, runs in
scripts/gpu_fp8fwd_s11.py on an H100 (with a mutant that swaps a word's bytes, which must fail there)."""

import pytest

import fagen
from fagen import backends
from fagen.backends.gluon import smem_bytes
from fagen.spec import targets
from fagen.spec.kernel import KernelSpec
from test_fp8_wgs import full_128, variant
from test_hopper_compile import build_sm90


@pytest.fixture(autouse=True)
def _full_128():  # the 128-key full-mask loop ([Note] fp8 full-mask 192-key steps: FP8_FULL_N192 off here)
    yield from full_128()


def render(mask="causal", dtype="fp8_e4m3", head_dim=128, **fields):
    return fagen.generate(KernelSpec(backend="gluon", head_dim=head_dim, mask=mask, dtype=dtype, **fields))


def test_packed_carry_is_rendered_only_under_its_switch_and_only_for_fp8():
    with variant(fp8_p_cvt=2, fp8_n192=0):
        before, bf16 = render(), render(dtype="bf16")
    assert "def _p_pack(" not in before and "# [Note] fp8 P packed carry\n" not in before
    with variant(fp8_p_cvt=3, fp8_n192=0):
        packed = render()
        assert render(dtype="bf16") == bf16
    carry = packed[packed.index("def _p_carry("):packed.index("\n\n\n", packed.index("def _p_carry("))]
    issue = packed[packed.index("def _p_issue("):packed.index("\n\n\n", packed.index("def _p_issue("))]
    assert "return _p_pack(p, p_layout)" in carry and "return _p_unpack(p_prev, p_layout)" in issue
    assert "# [Note] fp8 P packed carry\n" in packed and "dtype=gl.int32" in packed


def test_192_key_steps_render_only_under_their_switch_without_the_window():
    """[Note] fp8 192-key steps: BLOCK_N 192 over 2 stages, the step's own functions, K and Vt in 64-key boxes (the
    host's descriptors too); the window and d64 keep the 128-key kernel; bf16 never reads the switch."""
    with variant(fp8_n192=0):
        before, bf16 = render(), render(dtype="bf16")
    assert "_consumer_step192" not in before and "BLOCK_N = 128\n" in before
    with variant(fp8_n192=1):
        for mask in ("causal", "none"):
            src = render(mask)
            assert "BLOCK_N = 192\n" in src and "STAGES = 2\n" in src and "def _p_pack(" in src
            assert src.count("_consumer_step192(") == 3  # its def and the two loops
            assert "rows, cols = (64 if rows == BLOCK_N else rows), (64 if cols == BLOCK_N else cols)" in src
        for other in (render(window=True), render(head_dim=64)):  # the window, d64 (three warpgroups)
            assert "_consumer_step192" not in other and "BLOCK_N = 128\n" in other
        assert "BLOCK_N = 64\n" in render(block_n=64)  # an explicit block_n 64 is kept
        assert render(dtype="bf16") == bf16


def test_192_key_rule_is_the_templates_and_counts_its_shared_memory():
    """GluonBackend.fp8_n192 (the host's rule, and smem_bytes by it) agrees with the template's n192 on every fp8
    spec shape it could differ on."""
    g = backends.GLUON
    cases = [dict(mask=m, head_dim=d, window=w, block_n=bn, gqa=q) for m in ("causal", "none") for d in (64, 128)
             for w in (False, True) for bn in (64, 128) for q in (1, 4)]
    for on in (0, 1, 2):
        with variant(fp8_n192=on):
            for c in cases:
                spec = KernelSpec(backend="gluon", dtype="fp8_e4m3", **c)
                assert g.fp8_n192(spec) == ("_consumer_step192" in render(**c)), (on, c)
                if g.fp8_n192(spec):  # compiled (sm_90, d128 full): 180,648 and 213,472 bytes
                    assert g.smem_bytes(spec) == (181248, 214016)[on - 1] <= targets.ARCH_SMEM_LIMIT["sm_90"]
                    assert ("STAGES = 3\n" if on == 2 else "STAGES = 2\n") in render(**c)
                else:
                    assert g.smem_bytes(spec) == smem_bytes(c["head_dim"], 128, c["block_n"], spec.num_stages, 1,
                                                            c["head_dim"], g.variant_for(spec)["fp8_wgs"])


_SCRIPT = r"""
import json, os, re, sys
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
import fagen
from fagen import backends
backends.gluon.FP8_FULL_N192 = False  # the 128-key full-mask loop ([Note] fp8 full-mask 192-key steps)
backends.gluon.FP8_N256.clear()  # and not the 256-key steps ([Note] fp8 256-key steps)
from fagen.spec.kernel import KernelSpec
from fagen.codegen import render
from fagen.runtime.loader import load_source
from sm90 import loops, ptxas

backends.GLUON.variant["fp8_p_cvt"] = 3
out = {}
for key, fields in json.loads(sys.argv[2]).items():
    fields = dict(fields)
    backends.GLUON.variant["fp8_n192"] = fields.pop("n192", 0)
    spec = KernelSpec(backend="gluon", **{"head_dim": 128, "dtype": "fp8_e4m3", **fields})
    render.render.cache_clear()
    mod = load_source(fagen.generate(spec), spec.name + "_" + key)
    ptx = mod.compile_for().asm["ptx"]
    res = ptxas(ptx)[0]["_attn_fwd_hopper"]
    out[key] = dict(spills=res.spill_stores + res.spill_loads, stack=res.stack,
                    wgmma=sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(\S+?)\s", ptx))),
                    e4m3_cvt=len(re.findall(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx)),
                    shfl=ptx.count("shfl.sync"),
                    loop_wgmma=[body.count("wgmma.mma_async") for body in loops(ptx, min_wgmma=2, innermost=True)],
                    repack=[len(re.findall(r"^\s*(?:prmt\.b32|cvt\.u32\.u16)\s", body, flags=re.M))
                            for body in loops(ptx, min_wgmma=2, innermost=True)])
print("RESULT " + json.dumps(out))
"""
MODULES = {"full": dict(mask="none"), "causal": dict(mask="causal"), "n192_full": dict(mask="none", n192=1),
           "n192_thirds": dict(mask="none", n192=2)}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_sm90(tmp_path_factory, _SCRIPT, MODULES, "fp8-packed-sm90")


@pytest.mark.parametrize("key", ["full", "causal"])
def test_packed_carry_builds_without_spills_or_repacking(built, key):
    """ptxas (sm_90): no spill (P_CVT 2 spills 28 / 148 operations, full / causal), every P V still e4m3 x e4m3, P
    rounded by cvt ...e4m3x2 and never repacked byte by byte in a loop that issues wgmma (an e4m3 tensor carried
    across the back edge costs ~110 prmt a loop), no shuffle more than the product's row reductions."""
    r = built[key]
    assert r["spills"] == 0 and r["stack"] == 0, r
    assert set(r["wgmma"]) == {"m64n128k32.f32.e4m3.e4m3"}, r
    assert r["e4m3_cvt"] > 0 and r["repack"] and max(r["repack"]) <= 4, r
    assert r["shfl"] <= 36 * 2, r


def test_192_key_steps_build_without_spills_as_two_s_and_three_p_v_matmuls(built):
    """[Note] fp8 192-key steps (sm_90, d128 full): no spill (causal: 56 spill operations in its masked loop), S as
    m64n128 + m64n64, P V as m64n128 over three 64-key boxes: 4 + 4 + 6 wgmma in each loop that issues them (a P V
    box left out gives 12), P not repacked."""
    r = built["n192_full"]
    assert r["spills"] == 0 and r["stack"] == 0, r
    assert set(r["wgmma"]) == {"m64n128k32.f32.e4m3.e4m3", "m64n64k32.f32.e4m3.e4m3"}, r
    assert r["loop_wgmma"] and set(r["loop_wgmma"]) == {14}, r
    assert max(r["repack"]) <= 4, r


def test_192_key_steps_in_thirds_build_without_spills(built):
    """fp8_n192 2 (sm_90, d128 full): S as three m64n64 matmuls from 64-row K slots, 3 stages; no spill (causal: 40
    spill operations); 4 x 3 + 6 wgmma in each loop that issues them."""
    r = built["n192_thirds"]
    assert r["spills"] == 0 and r["stack"] == 0, r
    assert set(r["wgmma"]) == {"m64n128k32.f32.e4m3.e4m3", "m64n64k32.f32.e4m3.e4m3"}, r
    assert r["loop_wgmma"] and set(r["loop_wgmma"]) == {18}, r
