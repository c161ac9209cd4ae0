"""The lab's Gluon backward at MLA's split head dims (lab/gluon_bwd_mla.py: d_qk 192 beside d_v 128, 32-query steps,
dQ_j^T = K^T dS^T) builds for sm_90 without a GPU, within shared memory and setmaxnreg 248 / 24 / 24, and its dQ modes
do what they say in the PTX: the fixed-point mode rounds each partial to int32 (cvt.rni) before the reduce-adds, the
unordered mode adds float32 as it comes; neither waits for a turn (no acquire loads, no release adds). Each compute
warpgroup's step is one loop of its own wgmma count. On an H100: scripts/gpu_mla_bwd_s15.py (float64 checks, bitwise
repeatability of the fixed-point mode, timings beside cuDNN; docs/serving.md, "MLA backward (fifteenth session)")."""

import pytest

from test_hopper_compile import build_sm90

_SCRIPT = r"""
import json, os, re, sys
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
from lab import gluon_bwd_mla
from sm90 import loops, ptxas

out = {}
for key, kw in json.loads(sys.argv[2]).items():
    ck = gluon_bwd_mla.compile_for(**kw)
    ptx = ck.asm["ptx"]
    res = next(iter(ptxas(ptx)[0].values()))
    out[key] = dict(shared=ck.metadata.shared, spills=res.spill_stores + res.spill_loads,
                    cvt=ptx.count("cvt.rni.s32.f32"), reduce=ptx.count("cp.reduce.async.bulk.tensor"),
                    acquire=len(re.findall(r"ld\.global\.gpu\.acquire", ptx)),
                    release=len(re.findall(r"atom\.global\.gpu\.release\.add", ptx)),
                    setmaxnreg=sorted({int(x) for x in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)}),
                    steps=sorted(s.count("wgmma.mma_async") for s in loops(ptx, 24, innermost=True)))
print("RESULT " + json.dumps(out))
"""

BUILDS = {"fixed": dict(FIXED=1, QM_TMA=1), "float": dict(FIXED=0), "ksplit": dict(FIXED=1, QM_TMA=1, KSPLIT=1)}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_sm90(tmp_path_factory, _SCRIPT, BUILDS, "gluon-bwd-mla-lab")


def test_it_fits_shared_memory_and_the_register_split(built):
    for r in built.values():
        assert r["shared"] <= 227 * 1024, r  # sm_90's opt-in shared memory per block
        assert {248, 24} <= set(r["setmaxnreg"]), r
        assert r["spills"] <= 320, r  # ptxas (triton 3.6): 64 + 80 B float32, 68 + 88 B fixed-point, KSPLIT 120 + 160


def test_the_fixed_point_mode_rounds_each_partial_and_no_mode_waits_for_a_turn(built):
    fixed, flt = built["fixed"], built["float"]
    # one [128, 32] and one [64, 32] tile of dQ^T per step, one TMA message each (128-byte rows); KSPLIT: both
    # warpgroups' partials, two tiles each
    assert fixed["reduce"] == flt["reduce"] == 2 and built["ksplit"]["reduce"] == 4, built
    assert fixed["cvt"] >= 1, fixed  # the element type of the adds is the tensor map's (int32 / float32 dQ^T)
    assert flt["cvt"] == 0, flt
    for r in built.values():
        assert r["acquire"] == r["release"] == 0, r


def test_each_compute_warpgroup_steps_in_one_loop(built):
    """Warpgroup 0 (keys 0-63; dQ^T rows 0-127): S^T 12 wgmma (d_qk 128 + 64), dP^T 8, dV 2, dQ^T 16 (two m64
    tiles, K 128 keys), dK 2 + 2: 42. Warpgroup 1 (dQ^T rows 128-191): dQ^T 8, so 34. KSPLIT: each warpgroup
    all 192 rows over its 64 keys (12), 38 each."""
    for key, r in built.items():
        assert r["steps"] == ([38, 38] if key == "ksplit" else [34, 42]), r
