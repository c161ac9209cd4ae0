"""The product's Gluon backward (fagen/templates/gluon/backward.py.j2) builds for sm_90 without a GPU, and its dQ modes
do what they say in the PTX: the deterministic mode waits for its turn (acquire loads) and publishes (release adds),
the unordered mode does neither; the step synchronises within a compute warpgroup only. On an H100:
tests/test_gluon_bwd_gpu.py and scripts/gpu_gluon_bwd_product.py."""

import pytest

from test_hopper_compile import build_sm90

_SCRIPT = r"""
import json, os, re, sys
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
import fagen
from fagen.spec.kernel import KernelSpec
from sm90 import loops, ptxas

out = {}
for key, fields in json.loads(sys.argv[2]).items():
    det = fields.pop("deterministic")
    mod = fagen.load(KernelSpec(backend="gluon", direction="bwd", head_dim=128, **fields))
    ck = mod.compile_backward_for(deterministic=det)
    ptx = ck.asm["ptx"]
    res = next(iter(ptxas(ptx)[0].values()))
    steps = loops(ptx, 32, innermost=True)
    out[key] = dict(shared=ck.metadata.shared, spills=res.spill_stores + res.spill_loads,
                    reduce=ptx.count("cp.reduce.async.bulk.tensor"), commit=ptx.count("cp.async.bulk.commit_group"),
                    acquire=len(re.findall(r"ld\.global\.gpu\.acquire", ptx)),
                    release=len(re.findall(r"atom\.global\.gpu\.release\.add", ptx)),
                    complete=sorted(set(re.findall(r"cp\.async\.bulk\.wait_group (\d);", ptx))),
                    setmaxnreg=sorted({int(x) for x in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)}),
                    steps=[dict(wgmma=s.count("wgmma.mma_async"), bars=re.findall(r"\bbar\.sync\s+\d+,\s*(\d+);", s),
                                wait=s.count("mbarrier.try_wait"), arrive=s.count("mbarrier.arrive")) for s in steps])
print("RESULT " + json.dumps(out))
"""

BUILDS = {"det": dict(mask="causal", gqa=2, dtype="bf16", deterministic=True),
          "unordered": dict(mask="none", dtype="bf16", deterministic=False)}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_sm90(tmp_path_factory, _SCRIPT, BUILDS, "gluon-bwd-product")


def test_fits_and_gives_the_compute_warpgroups_240_registers(built):
    for r in built.values():
        assert r["shared"] <= 227 * 1024, r  # sm_90's opt-in shared memory per block
        assert {240, 24} <= set(r["setmaxnreg"]), r


def test_the_dq_modes_order_or_skip_the_adds(built):
    det, unordered = built["det"], built["unordered"]
    # two halves of [64, 64] float32, each two TMA messages (128-byte swizzle), one bulk group per half
    assert det["reduce"] == unordered["reduce"] == 4 and det["commit"] == unordered["commit"] == 2, (det, unordered)
    assert det["acquire"] >= 1 and det["release"] >= 1, det  # waits for its turn, publishes its add
    # publishes once complete (not .read): one step late (2 groups in flight) and at the tile's end (0)
    assert det["complete"] == ["0", "2"], det
    assert unordered["acquire"] == unordered["release"] == 0 and unordered["complete"] == [], unordered


def test_a_compute_step_synchronises_within_its_warpgroup(built):
    """Each compute warpgroup has one step loop of 32 wgmma (S 8, dP 8, dV 4, dQ half 8, dK 4); its bar.syncs span
    128 threads (its own warpgroup), never the CTA; 3 mbarrier waits (Q/dO ready, dS^T ready, dQ slot empty) and 3
    arrives (dS^T ready, dQ slot full, Q/dO slot empty)."""
    for r in built.values():
        assert len(r["steps"]) == 2, r["steps"]
        for s in r["steps"]:
            assert s["wgmma"] == 32 and set(s["bars"]) == {"128"}, s
            assert s["wait"] == 3 and s["arrive"] == 3, s
