"""The fp8 forward's packed P carry (GluonBackend.variant fp8_p_cvt 3, [Note] fp8 P packed carry in
fagen/templates/gluon/attention.py.j2; eleventh session): P handed from one step to the next as int32 words of four
e4m3 keys. The render (what reads the switch), and the sm_90 build on the CPU: no spills, P not repacked in the
loop, the matmuls e4m3. The kernel against float64, and bit for bit against the product, runs in
scripts/gpu_fp8fwd_s11.py on an H100 (with a mutant that swaps a word's bytes, which must fail there)."""

import pytest

import fagen
from fagen.spec.kernel import KernelSpec
from test_fp8_wgs import variant
from test_hopper_compile import build_sm90


def render(mask="causal", dtype="fp8_e4m3", head_dim=128, **fields):
    return fagen.generate(KernelSpec(backend="gluon", head_dim=head_dim, mask=mask, dtype=dtype, **fields))


def test_packed_carry_is_rendered_only_under_its_switch_and_only_for_fp8():
    product, bf16 = render(), render(dtype="bf16")
    assert "def _p_pack(" not in product and "fp8 P packed carry" not in product
    with variant(fp8_p_cvt=3):
        packed = render()
        assert render(dtype="bf16") == bf16
    carry = packed[packed.index("def _p_carry("):packed.index("\n\n\n", packed.index("def _p_carry("))]
    issue = packed[packed.index("def _p_issue("):packed.index("\n\n\n", packed.index("def _p_issue("))]
    assert "return _p_pack(p, p_layout)" in carry and "return _p_unpack(p_prev, p_layout)" in issue
    assert "[Note] fp8 P packed carry" in packed and "dtype=gl.int32" in packed


_SCRIPT = r"""
import json, os, re, sys
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
import fagen
from fagen import backends
from fagen.spec.kernel import KernelSpec
from sm90 import loops, ptxas

backends.GLUON.variant["fp8_p_cvt"] = 3
out = {}
for key, fields in json.loads(sys.argv[2]).items():
    mod = fagen.load(KernelSpec(backend="gluon", **{"head_dim": 128, "dtype": "fp8_e4m3", **fields}))
    ptx = mod.compile_for().asm["ptx"]
    res = ptxas(ptx)[0]["_attn_fwd_hopper"]
    out[key] = dict(spills=res.spill_stores + res.spill_loads, stack=res.stack,
                    wgmma=sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(\S+?)\s", ptx))),
                    e4m3_cvt=len(re.findall(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx)),
                    shfl=ptx.count("shfl.sync"),
                    repack=[len(re.findall(r"^\s*(?:prmt\.b32|cvt\.u32\.u16)\s", body, flags=re.M))
                            for body in loops(ptx, min_wgmma=2, innermost=True)])
print("RESULT " + json.dumps(out))
"""
MODULES = {"full": dict(mask="none"), "causal": dict(mask="causal")}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_sm90(tmp_path_factory, _SCRIPT, MODULES, "fp8-packed-sm90")


@pytest.mark.parametrize("key", list(MODULES))
def test_packed_carry_builds_without_spills_or_repacking(built, key):
    """ptxas (sm_90): no spill (P_CVT 2 spills 28 / 148 operations, full / causal), every P V still e4m3 x e4m3, P
    rounded by cvt ...e4m3x2 and never repacked byte by byte in a loop that issues wgmma (an e4m3 tensor carried
    across the back edge costs ~110 prmt a loop), no shuffle more than the product's row reductions."""
    r = built[key]
    assert r["spills"] == 0 and r["stack"] == 0, r
    assert set(r["wgmma"]) == {"m64n128k32.f32.e4m3.e4m3"}, r
    assert r["e4m3_cvt"] > 0 and r["repack"] and max(r["repack"]) <= 4, r
    assert r["shfl"] <= 36 * 2, r
