"""The lab's FA3-synchronised Gluon backward (lab/gluon_bwd.py, v1) builds for sm_90 without a GPU, and its dQ modes
do what they say in the PTX: the deterministic mode waits for its turn (acquire loads) and publishes (release adds),
the unordered mode does neither, the no-reduce diagnostic issues no bulk reduce; each compute warpgroup's step
synchronises only within its warpgroup (bar.sync of 128 threads) and through mbarriers. The levers (ORDER, NAMED,
EPI_TMA): the wave order's turns, computed by the kernel's own helpers on scalars, give every (query head, query
block) each key block's add once and cannot deadlock the persistent grid; the named-barrier handoff and the TMA
epilogue show in the PTX. On an H100: scripts/gpu_gluon_bwd.py, scripts/gpu_gluon_bwd_lev.py (docs/hopper.md, "A
Gluon backward with FA3's synchronisation", "Levers on v1")."""


import pytest

from test_hopper_compile import build_sm90

_SCRIPT = r"""
import json, os, re, sys
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
from lab import gluon_bwd
from sm90 import loops, ptxas

out = {}
for key, kw in json.loads(sys.argv[2]).items():
    ck = gluon_bwd.compile_for("v1", **kw)
    ptx = ck.asm["ptx"]
    res = next(iter(ptxas(ptx)[0].values()))
    steps = loops(ptx, 32 if kw.get("head_dim", 128) == 128 else 24, innermost=True)
    out[key] = dict(shared=ck.metadata.shared, spills=res.spill_stores + res.spill_loads,
                    named=sorted(set(re.findall(r"\bbar\.(sync|arrive)\s+(\d+),\s*(\d+);", ptx))),
                    tma_store=len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared", ptx)),
                    st_global=len(re.findall(r"\bst\.global", ptx)),
                    reduce=ptx.count("cp.reduce.async.bulk.tensor"), commit=ptx.count("cp.async.bulk.commit_group"),
                    acquire=len(re.findall(r"ld\.global\.gpu\.acquire", ptx)),
                    release=len(re.findall(r"atom\.global\.gpu\.release\.add", ptx)),
                    setmaxnreg=sorted({int(x) for x in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)}),
                    steps=[dict(wgmma=s.count("wgmma.mma_async"), bars=re.findall(r"\bbar\.sync\s+\d+,\s*(\d+);", s),
                                wait=s.count("mbarrier.try_wait"), arrive=s.count("mbarrier.arrive")) for s in steps])
print("RESULT " + json.dumps(out))
"""

BUILDS = {"det": dict(dq_mode=0), "nondet": dict(dq_mode=1), "noreduce": dict(dq_mode=2),
          "levers": dict(dq_mode=0, causal=False, ORDER=1, NAMED=2, EPI_TMA=1)}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_sm90(tmp_path_factory, _SCRIPT, BUILDS, "gluon-bwd-lab")


def test_v1_fits_and_gives_the_compute_warpgroups_240_registers(built):
    for r in built.values():
        assert r["shared"] <= 227 * 1024, r  # sm_90's opt-in shared memory per block
        assert {240, 24} <= set(r["setmaxnreg"]), r


def test_the_dq_modes_order_or_skip_the_adds(built):
    det, nondet, noreduce = built["det"], built["nondet"], built["noreduce"]
    # two halves of [64, 64] float32, each two TMA messages (128-byte swizzle), one bulk group per half
    assert det["reduce"] == nondet["reduce"] == 4 and det["commit"] == nondet["commit"] == 2, (det, nondet)
    assert det["acquire"] >= 1 and det["release"] >= 1, det  # waits for its turn, publishes its add
    assert nondet["acquire"] == nondet["release"] == 0, nondet
    assert noreduce["reduce"] == 0, noreduce


def test_a_compute_step_synchronises_within_its_warpgroup(built):
    """Each compute warpgroup has one step loop of 32 wgmma (S 8, dP 8, dV 4, dQ half 8, dK 4); its bar.syncs span
    128 threads (its own warpgroup), never the CTA; 3 mbarrier waits (Q/dO ready, dS^T ready, dQ slot empty) and 3
    arrives (dS^T ready, dQ slot full, Q/dO slot empty)."""
    steps = built["det"]["steps"]
    assert len(steps) == 2, steps
    for s in steps:
        assert s["wgmma"] == 32 and set(s["bars"]) == {"128"}, s
        assert s["wait"] == 3 and s["arrive"] == 3, s


def test_the_levers_hand_over_through_named_barriers_and_store_dk_dv_by_tma(built):
    """NAMED 2: the dQ handoff is bar.arrive 8 + w / bar.sync 10 + w of 160 threads (a warpgroup and the dQ warp),
    the dS^T exchange bar.sync 12 of 256 (both warpgroups); a step waits on one mbarrier (Q/dO ready) and arrives
    on one (the slot empty). EPI_TMA: dK and dV leave by TMA stores, with no st.global in the kernel."""
    r, det = built["levers"], built["det"]
    named = {tuple(x) for x in r["named"]}
    assert {("arrive", "8", "160"), ("arrive", "9", "160"), ("sync", "10", "160"), ("sync", "11", "160"),
            ("sync", "12", "256")} <= named, named
    assert not any(x[1] in "8 9 10 11 12".split() for x in det["named"]), det["named"]  # v1 itself: mbarriers
    assert len(r["steps"]) == 2, r["steps"]
    for s in r["steps"]:
        assert s["wgmma"] == 32 and s["wait"] == 1 and s["arrive"] == 1, s
    assert r["tma_store"] >= 4 and r["st_global"] == 0 < det["st_global"], (r, det)
    assert r["acquire"] >= 1 and r["release"] >= 1, r  # still the deterministic mode
