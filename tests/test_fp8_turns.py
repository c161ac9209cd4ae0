"""The fp8 forward's warpgroup turns, nineteenth session (issue 28): GluonBackend.variant fp8_turns ([Note] fp8
warpgroup turns in fagen/templates/gluon/attention.py.j2), named barriers of both consumer warpgroups (256 threads):
1 FA3's scheduler barriers, 2 cuDNN's one barrier a step at the wgmma, 3 FA3's with warpgroup 1 skipping the step's
K/V waits, 4 cuDNN's places exactly (bar.red with a data dependency each way), 5 2 with 3's waits. The render
(only where on: fp8, two warpgroups at 128 or 192 keys, not S a step ahead; bf16 and d64 unchanged), and the sm_90
build on the CPU: no spills, and in the SASS of each step loop the barriers where each mode puts them, one a
warpgroup a step (the hang risks: a count of 256, every sync paired). The kernels against float64 and bit for bit
against the product run in scripts/gpu_fp8turns_s19.py on the GPU."""

import pytest

import fagen
from fagen.spec.kernel import KernelSpec
from _env import ON_GPU
from test_fp8_wgs import full_128, variant
from test_hopper_compile import build_sm90


@pytest.fixture(autouse=True)
def _full_128():  # the 128-key full-mask loop ([Note] fp8 full-mask 192-key steps: FP8_FULL_N192 off here)
    yield from full_128()


def render(mask="causal", dtype="fp8_e4m3", head_dim=128, **fields):
    return fagen.generate(KernelSpec(backend="gluon", head_dim=head_dim, mask=mask, dtype=dtype, **fields))


def _step(src):
    i = src.index("def _consumer_step(")
    return src[i:src.index("\n\n\n", i)]


def test_renders_only_where_on():
    with variant(fp8_turns=0):
        before, bf16, d64 = render(), render(dtype="bf16"), render(mask="none", head_dim=64)
    assert "_turn" not in before and "[Note] fp8 warpgroup turns" not in before
    for mode in (1, 2, 3, 4, 5):
        with variant(fp8_turns=mode):
            src = render()
            assert render(dtype="bf16") == bf16 and render(mask="none", head_dim=64) == d64  # d64: three warpgroups
            assert "_turn" in render(window=True) and "_turn" in render(mask="none")
            assert src.count("CAUSAL, WG)") == 2 or mode == 4  # both step loops pass the warpgroup
            assert ("def _turn_dep(" in src) == (mode == 4)
        with variant(fp8_turns=mode, fp8_s_ahead=1):
            assert "_turn" not in render(mask="none")
        with variant(fp8_turns=mode, fp8_n192=1):  # the 192-key step takes the same turns
            step = render(mask="none")
            step = step[step.index("def _consumer_step192("):]
            step = step[:step.index("\n\n\n")]
            assert ("_turn(n, " in step) == (mode != 4) and ("CAUSAL, 1 + WG)" in step) == (mode == 4)


def test_the_step_places_its_barriers():
    with variant(fp8_turns=1):
        step = _step(render())
    assert step.index('_turn(n, "sync", _BAR_TURN + WG)') < step.index("s_tok = warpgroup_mma(")
    assert step.index("o_tok = warpgroup_mma(") < step.index('_turn(n, "arrive", _BAR_TURN + 1 - WG)') < \
        step.index("warpgroup_mma_wait(")
    with variant(fp8_turns=2):
        step = _step(render())
    first, second = (step.index('_turn(n, "sync", _BAR_TURN)', i) for i in (0, step.index("o_tok = warpgroup_mma(")))
    assert step.rindex("if WG == 1:", 0, first) > step.index("mbarrier.wait(") and first < step.index("s_tok = ")
    assert step.rindex("if WG == 0:", 0, second) > step.index("o_tok = ") and second < step.index("warpgroup_mma_wait(")
    with variant(fp8_turns=3):
        step = _step(render())
    assert step.index("if WG == 0:") < step.index("mbarrier.wait(k_ready") < step.index("mbarrier.wait(v_ready") < \
        step.index('_turn(n, "sync"')
    with variant(fp8_turns=4):
        src = render()
    assert "CAUSAL, 1 + WG)" in _step(src)
    soft = src[src.index("def _softmax("):]
    assert soft.index("m_use = _turn_dep(m_use)") < soft.index("p = gl.exp2(") < soft.index("l_i = _turn_dep(l_i)")


_SCRIPT = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
import fagen
from fagen import backends
backends.gluon.FP8_FULL_N192 = False  # the 128-key full-mask loop ([Note] fp8 full-mask 192-key steps)
backends.gluon.FP8_N256.clear()  # and not the 256-key steps ([Note] fp8 256-key steps)
from fagen.spec.kernel import KernelSpec
from fagen.codegen import render
from fagen.runtime.loader import load_source
from sm90 import ptxas, sass_step_loops, step_barriers

out = {}
for key, fields in json.loads(sys.argv[2]).items():
    fields = dict(fields)
    backends.GLUON.variant["fp8_turns"] = fields.pop("turns", 0)
    backends.GLUON.variant["fp8_n192"] = fields.pop("n192", 0)
    qgmma = {0: 8, 1: 14, 2: 18}[backends.GLUON.variant["fp8_n192"]]  # a step's S and P V (2: S in three parts)
    spec = KernelSpec(backend="gluon", **{"head_dim": 128, "dtype": "fp8_e4m3", **fields})
    render.render.cache_clear()
    mod = load_source(fagen.generate(spec), spec.name + "_" + key)
    res, log, dump = ptxas(mod.compile_for().asm["ptx"], sass=True)
    r = res["_attn_fwd_hopper"]
    out[key] = dict(spills=r.spill_stores + r.spill_loads, stack=r.stack, serialized="serialized" in log,
                    loops=[step_barriers(b) for b in sass_step_loops(dump, qgmma)],
                    named={op: dump.count(f"BAR.{op}") for op in ("SYNC.DEFER_BLOCKING 0xe, 0x100",
                                                                    "SYNC.DEFER_BLOCKING 0xf, 0x100",
                                                                    "ARV 0xe, 0x100", "ARV 0xf, 0x100",
                                                                    "RED.POPC.DEFER_BLOCKING 0xe, 0x100")})
print("RESULT " + json.dumps(out))
"""
MODULES = {"product": dict(mask="none"), "t1": dict(mask="none", turns=1), "t2": dict(mask="none", turns=2),
           "t2_causal": dict(mask="causal", turns=2), "t3": dict(mask="none", turns=3),
           "t4": dict(mask="none", turns=4), "t5": dict(mask="none", turns=5),
           "t4_causal": dict(mask="causal", turns=4),
           "n192_t2": dict(mask="none", turns=2, n192=1), "n192_t4": dict(mask="none", turns=4, n192=1),
           "n192_3_t4": dict(mask="none", turns=4, n192=2)}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_sm90(tmp_path_factory, _SCRIPT, MODULES, "fp8-turns-sm90")


@pytest.mark.skipif(ON_GPU, reason="a CPU test: sm_90 builds by ptxas, no kernel runs")
@pytest.mark.parametrize("key", list(MODULES))
def test_builds_without_spills_four_step_loops(built, key):
    r = built[key]
    assert r["spills"] == 0 and r["stack"] == 0 and not r["serialized"], r
    assert sorted(loop["wg"] for loop in r["loops"]) == [0, 0, 1, 1], r  # two step loops a warpgroup


def _no_named(loop):
    return not (loop["sync"] or loop["arrive"] or loop["red"])


@pytest.mark.skipif(ON_GPU, reason="a CPU test: sm_90 builds by ptxas, no kernel runs")
def test_product_takes_no_turns(built):
    assert all(_no_named(loop) for loop in built["product"]["loops"])
    assert not any(built["product"]["named"].values())


@pytest.mark.skipif(ON_GPU, reason="a CPU test: sm_90 builds by ptxas, no kernel runs")
@pytest.mark.parametrize("key", ["t1", "t3"])
def test_fa3_turns_sync_own_before_the_issues_and_hand_over_after(built, key):
    r = built[key]
    for loop in r["loops"]:
        (i, own), = loop["sync"]
        (j, other), = loop["arrive"]
        assert own == 14 + loop["wg"] and other == 15 - loop["wg"], loop  # its own barrier, then the other's
        assert i < loop["qgmma"][0] and loop["qgmma"][-1] < j < loop["waits"][0], loop
        assert not loop["red"]
        if key == "t3":  # warpgroup 1 takes no K / V ready wait in its steps; warpgroup 0 both
            assert loop["phasechk"] == (2 if loop["wg"] == 0 else 0), loop
    # a sync and an arrive a step loop; warpgroup 1's one arrive on 14 before its tiles primes warpgroup 0's turn
    n = r["named"]
    assert (n["SYNC.DEFER_BLOCKING 0xe, 0x100"], n["SYNC.DEFER_BLOCKING 0xf, 0x100"], n["ARV 0xe, 0x100"],
            n["ARV 0xf, 0x100"]) == (2, 2, 3, 2), n


@pytest.mark.skipif(ON_GPU, reason="a CPU test: sm_90 builds by ptxas, no kernel runs")
@pytest.mark.parametrize("key", ["t2", "t2_causal", "n192_t2", "t5"])
def test_cudnn_turn_at_the_wgmma(built, key):
    """One bar.sync 14 a step in each warpgroup (the pairs match: the same loops), no arrive: warpgroup 1 before its
    issues, warpgroup 0 after its issues and before its S wait and every exponential."""
    r = built[key]
    for loop in r["loops"]:
        (i, bar), = loop["sync"]
        assert bar == 14 and not loop["arrive"] and not loop["red"], loop
        if loop["wg"] == 1:
            assert i < loop["qgmma"][0], loop
            assert loop["phasechk"] == (0 if key == "t5" else 2), loop  # 5: no K / V ready wait in warpgroup 1
        else:
            assert loop["qgmma"][-1] < i < loop["waits"][0] < loop["mufu"][0], loop
    assert r["named"]["SYNC.DEFER_BLOCKING 0xe, 0x100"] == 4 and sum(r["named"].values()) == 4, r["named"]


@pytest.mark.skipif(ON_GPU, reason="a CPU test: sm_90 builds by ptxas, no kernel runs")
@pytest.mark.parametrize("key", ["t4", "t4_causal", "n192_t4", "n192_3_t4"])
def test_cudnn_exact_places(built, key):
    """One bar.red 14 a step in each warpgroup: warpgroup 0's before every exponential (after its row max),
    warpgroup 1's after every exponential."""
    r = built[key]
    for loop in r["loops"]:
        (i, bar), = loop["red"]
        assert bar == 14 and _no_named({**loop, "red": []}), loop
        assert len(loop["mufu"]) == (98 if key.startswith("n192") else 66), loop  # P's and alpha's
        if loop["wg"] == 0:
            assert loop["qgmma"][-1] < i < loop["mufu"][0], loop
        else:
            assert loop["mufu"][-1] < i, loop
    assert r["named"]["RED.POPC.DEFER_BLOCKING 0xe, 0x100"] == 4 and sum(r["named"].values()) == 4, r["named"]
