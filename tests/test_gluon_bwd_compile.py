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
from fagen import backends
from fagen.codegen import render
from fagen.runtime.loader import load_source
from fagen.spec.kernel import KernelSpec
from sm90 import loops, ptxas

out = {}
default = dict(backends.GLUON.variant)
for key, fields in json.loads(sys.argv[2]).items():
    det = fields.pop("deterministic")
    backends.GLUON.variant.clear()
    backends.GLUON.variant.update(default, **fields.pop("variant", {}))  # [Note] Gluon backward levers
    render.render.cache_clear()
    head_dim = fields.pop("head_dim", 128)
    spec = KernelSpec(backend="gluon", direction="bwd", head_dim=head_dim, **fields)
    mod = load_source(fagen.generate(spec), f"{spec.name}_{key}")
    ck = mod.compile_backward_for(deterministic=det)
    ptx = ck.asm["ptx"]
    res = next(iter(ptxas(ptx)[0].values()))
    steps = loops(ptx, 32 if head_dim == 128 else 24, innermost=True)
    out[key] = dict(shared=ck.metadata.shared, spills=res.spill_stores + res.spill_loads,
                    reduce=ptx.count("cp.reduce.async.bulk.tensor"), commit=ptx.count("cp.async.bulk.commit_group"),
                    acquire=len(re.findall(r"ld\.global\.gpu\.acquire", ptx)),
                    release=len(re.findall(r"atom\.global\.gpu\.release\.add", ptx)),
                    complete=sorted(set(re.findall(r"cp\.async\.bulk\.wait_group (\d);", ptx))),
                    named=sorted(set(re.findall(r"\bbar\.(?:sync|arrive) (\d+), (?:160|256);", ptx))),
                    tma_store=ptx.count("cp.async.bulk.tensor.4d.global.shared"), cvt=ptx.count("cvt.rni.s32.f32"),
                    load2d=len(re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::cluster\.global", ptx)),
                    magic=ptx.count("0f4B400000"), spill_bytes=[res.spill_stores, res.spill_loads],
                    unmagic=len(re.findall(r"-1262485504\b", ptx)),
                    setmaxnreg=sorted({int(x) for x in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)}),
                    steps=[dict(wgmma=s.count("wgmma.mma_async"), bars=re.findall(r"\bbar\.sync\s+\d+,\s*(\d+);", s),
                                wait=s.count("mbarrier.try_wait"), arrive=s.count("mbarrier.arrive")) for s in steps])
print("RESULT " + json.dumps(out))
"""

LEVERS = {"bwd_order": 1, "bwd_snake": 1, "bwd_named": 2, "bwd_epi_tma": 1}
# det and levers: the fixed-order dQ ([Note] Fixed-order dQ) whatever the defaults of bwd_fixed and bwd_gqa (GQA
# causal's own variant)
BUILDS = {"det": dict(mask="causal", gqa=2, dtype="bf16", deterministic=True, variant={"bwd_fixed": 0, "bwd_gqa": {}}),
          # the lever-free kernel at full: main's bwd_d128 before the twelfth session's full levers
          "unordered": dict(mask="none", dtype="bf16", deterministic=False,
                            variant={"bwd_d128": {"bwd_fixed": 1, "bwd_fixed_tma": 1, "bwd_sections": 4}}),
          "levers": dict(mask="causal", gqa=2, dtype="bf16", deterministic=True,
                         variant={**LEVERS, "bwd_fixed": 0, "bwd_gqa": {}}),
          "ulevers": dict(mask="causal", dtype="bf16", deterministic=False,
                          variant={"bwd_unordered_levers": {"bwd_named": 2, "bwd_epi_tma": 1}}),
          "fixed": dict(mask="causal", gqa=2, dtype="bf16", deterministic=True, variant={"bwd_fixed": 1}),
          "fixed_full": dict(mask="none", dtype="bf16", deterministic=True, variant={"bwd_fixed": 1, "bwd_d128": {}}),
          # ninth session: [Note] FMA rounding; [Note] Launch order (the deterministic kernel's tiles and turns)
          "fixed_fma": dict(mask="causal", gqa=2, dtype="bf16", deterministic=True,
                            variant={"bwd_fixed": 1, "bwd_fixed_fma": 1}),
          "fixed_fma2": dict(mask="none", dtype="bf16", deterministic=True,
                             variant={"bwd_fixed": 1, "bwd_fixed_fma": 2}),
          "spt": dict(mask="causal", gqa=2, dtype="bf16", deterministic=True,
                      variant={"bwd_fixed": 0, "bwd_spt": 1, "bwd_grid": 1, "bwd_gqa": {}}),
          # tenth session: the d128 MHA default (variant bwd_d128: [Note] qmul rows by TMA, L2 sections) and the
          # same render without the qmul rows by TMA
          "d128": dict(mask="causal", dtype="bf16", deterministic=True),
          "d128_ldg": dict(mask="causal", dtype="bf16", deterministic=True, variant={"bwd_d128": {"bwd_fixed": 1}}),
          # eleventh session: the d64 default (bwd_d64: fixed-point dQ, sections of 8) with the qmul rows by TMA
          "d64": dict(head_dim=64, mask="causal", dtype="bf16", deterministic=True,
                      variant={"bwd_d64": {"bwd_fixed": 1, "bwd_sections": 8}}),
          "d64_tma": dict(head_dim=64, mask="causal", dtype="bf16", deterministic=True,
                          variant={"bwd_d64": {"bwd_fixed": 1, "bwd_sections": 8, "bwd_fixed_tma": 1}}),
          # twelfth session: the d128 full default (bwd_d128's bwd_full_levers: named barriers 2, TMA epilogue), both
          # modes
          "full_lev": dict(mask="none", dtype="bf16", deterministic=True),
          "full_lev_u": dict(mask="none", dtype="bf16", deterministic=False)}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_sm90(tmp_path_factory, _SCRIPT, BUILDS, "gluon-bwd-product")


def test_fits_and_gives_the_compute_warpgroups_240_registers(built):
    for r in built.values():
        assert r["shared"] <= 227 * 1024, r  # sm_90's opt-in shared memory per block
        assert {240, 24} <= set(r["setmaxnreg"]), r


def test_the_levers_render_their_code_only_when_on(built):
    """[Note] Gluon backward levers: with bwd_named 2, named barriers of 160 threads (dQ full 8, 9, empty 10, 11)
    and 256 (the dS^T exchange, 12); with bwd_epi_tma, dK and dV leave by TMA stores. The default render has
    neither (its one 4-d TMA store count is 0: dK/dV by pointer stores)."""
    assert built["levers"]["named"] == ["10", "11", "12", "8", "9"], built["levers"]
    assert built["levers"]["tma_store"] >= 2 and built["det"]["tma_store"] == 0, built
    assert built["det"]["named"] == [] and built["unordered"]["named"] == []
    # bwd_unordered_levers: the unordered mode's own kernel has them (the deterministic one is the default's)
    assert built["ulevers"]["named"] == built["levers"]["named"] and built["ulevers"]["tma_store"] >= 2


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
    for r in (built["det"], built["unordered"]):
        assert len(r["steps"]) == 2, r["steps"]
        for s in r["steps"]:
            assert s["wgmma"] == 32 and set(s["bars"]) == {"128"}, s
            assert s["wait"] == 3 and s["arrive"] == 3, s
    for s in built["levers"]["steps"]:  # named barriers: the dS^T exchange spans both warpgroups (256 threads)
        assert s["wgmma"] == 32 and set(s["bars"]) == {"128", "256"}, s
        assert s["wait"] == 1 and s["arrive"] == 1, s  # the ring's ready wait and empty arrive only


def test_the_fixed_point_dq_rounds_to_int32_and_waits_for_no_turn(built):
    """[Note] Fixed-point dQ (variant bwd_fixed): the deterministic mode rounds each dQ half to int32 (cvt.rni, 32
    a thread per step) and reduce-adds it without turns (no acquire loads, no release adds, no completion waits);
    its step keeps the 32 wgmma of the float32 modes (causal: on the unordered mode's kernel and levers, named
    barriers). The default render has no cvt.rni."""
    for key in ("fixed", "fixed_full"):
        r = built[key]
        assert r["reduce"] == 4 and r["cvt"] >= 64, r
        assert r["acquire"] == r["release"] == 0 and r["complete"] == [], r
        assert len(r["steps"]) == 2 and all(s["wgmma"] == 32 for s in r["steps"]), r["steps"]
    assert built["fixed"]["named"] == built["ulevers"]["named"] and built["fixed_full"]["named"] == []
    assert built["det"]["cvt"] == built["unordered"]["cvt"] == 0


def test_the_fma_rounding_replaces_cvt_and_keeps_the_fixed_point_schedule(built):
    """[Note] FMA rounding (variant bwd_fixed_fma): each dQ element is rounded by fma(x, qmul, 1.5 x 2^23) (the
    constant 0f4B400000 in the PTX, 32 a thread per step in each compute warpgroup) and no cvt.rni; the adds still
    wait for no turn; the step keeps its 32 wgmma."""
    r = built["fixed_fma"]
    assert r["cvt"] == 0 and r["magic"] >= 64, r
    assert built["fixed"]["magic"] == 0, built["fixed"]
    # bwd_fixed_fma 2: the raw bits, no IADD of -0x4B400000 in the main kernel (the postprocess has it)
    assert r["unmagic"] >= 64 and built["fixed_fma2"]["unmagic"] == 0 and built["fixed_fma2"]["magic"] >= 64, built
    assert r["reduce"] == 4 and r["acquire"] == r["release"] == 0 and r["complete"] == [], r
    assert len(r["steps"]) == 2 and all(s["wgmma"] == 32 for s in r["steps"]), r["steps"]


def test_the_launch_order_keeps_the_fixed_order_dq(built):
    """[Note] Launch order (bwd_spt, bwd_grid): the deterministic mode still waits for its turn and publishes once
    complete; only the tiles' order and the turns' direction change (tests/test_gluon_bwd_order.py)."""
    r, det = built["spt"], built["det"]
    assert r["acquire"] >= 1 and r["release"] >= 1 and r["complete"] == ["0", "2"], r
    assert r["reduce"] == det["reduce"] and len(r["steps"]) == 2, r


def test_the_d128_default_brings_the_qmul_rows_by_tma(built):
    """[Note] qmul rows by TMA (bwd_d128's bwd_fixed_tma): the producer's 2-d TMA loads per step are lse2, delta and
    the qmul rows (3, against 2 in the render without it); the compute warpgroups load nothing from global memory in
    the step; the fixed-point dQ's adds wait for no turn."""
    r, ldg = built["d128"], built["d128_ldg"]
    assert r["cvt"] >= 64 and r["acquire"] == r["release"] == 0 and r["complete"] == [], r
    assert r["load2d"] == ldg["load2d"] + 1 == 3, (r, ldg)
    assert len(r["steps"]) == 2 and all(s["wgmma"] == 32 for s in r["steps"]), r["steps"]


def test_d64_brings_the_qmul_rows_by_tma_without_spills(built):
    """[Note] qmul rows by TMA at d64 (eleventh session): the same third 2-d TMA load per step as at d128, the
    step's wgmma unchanged, and neither render spills (sm_90 ptxas: 0 / 0 B; shared 116,112 -> 116,624 B)."""
    r, ldg = built["d64_tma"], built["d64"]
    assert r["load2d"] == ldg["load2d"] + 1 == 3, (r, ldg)
    assert r["spill_bytes"] == ldg["spill_bytes"] == [0, 0], (r, ldg)
    assert r["cvt"] >= 32 and r["acquire"] == r["release"] == 0 and r["complete"] == [], r
    assert len(r["steps"]) == 2 and [s["wgmma"] for s in r["steps"]] == [s["wgmma"] for s in ldg["steps"]], r


def test_the_full_levers_reach_both_modes_of_the_full_default(built):
    """bwd_d128's bwd_full_levers (twelfth session): the d128 full default's unordered kernel has the causal kernel's
    levers (named barriers for the dQ handoff and the dS^T exchange, dK/dV by TMA stores) and serves the
    deterministic mode (DQ_MODE 2: cvt.rni, no turns) as well as deterministic=False; main's render before them
    (built["unordered"]) has neither."""
    for key in ("full_lev", "full_lev_u"):
        r = built[key]
        assert r["named"] == built["levers"]["named"] and r["tma_store"] >= 2, r
        assert r["acquire"] == r["release"] == 0 and r["complete"] == [], r
        assert len(r["steps"]) == 2 and all(s["wgmma"] == 32 for s in r["steps"]), r["steps"]
    assert built["full_lev"]["cvt"] >= 64 and built["full_lev_u"]["cvt"] == 0, built
