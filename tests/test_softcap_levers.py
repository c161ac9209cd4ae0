"""The softcap forward's schedule levers, twenty-third session ([Note] Softcap forward levers in
fagen/templates/gluon/attention.py.j2): GluonBackend.variant cap_turns (the fp8 forward's warpgroup turns in the
bf16/fp16 softcap forward), cap_max_first (the unmasked step's row max on the scaled scores, before the tanh) and
pv_overlap (the softmax under its own P V, a measurement key since the tenth session); the fixed shift
(cap_fixed_max) failed its float64 checks on the H200 and left the template. Here: every lever renders only
where on (the softcap forward; the plain, window and fp8 renders byte for byte the defaults'), what each changes in
the softmax, and the sm_90 build (no spills; in the SASS the P V wait after the exponentials with pv_overlap and
turns 4's warpgroup 1, two MUFU.TANH more a step with cap_max_first). The kernels against float64 and the timing run
in scripts/gpu_softcap_s23.py on the GPU."""

import pytest

import fagen
from fagen import backends
from fagen.spec.kernel import KernelSpec
from _env import ON_GPU
from test_fp8_wgs import variant
from test_hopper_compile import build_sm90

LEVERS = ({"cap_turns": 1}, {"cap_turns": 2}, {"cap_turns": 4}, {"cap_max_first": 1},
          {"cap_turns": 4, "cap_max_first": 1})


def render(mask="causal", **fields):
    return fagen.generate(KernelSpec(backend="gluon", mask=mask, **{"head_dim": 128, "dtype": "bf16", **fields}))


def func(src, name):
    i = src.index(f"def {name}(")
    return src[i:src.index("\n\n\n", i)]


def _others():
    return [render(), render(mask="none"), render(window=True), render(dtype="fp16"), render(head_dim=64),
            render(mask="none", dtype="fp8_e4m3"), render(softcap=True, window=True)]


def test_the_levers_render_only_in_the_softcap_forward():
    with variant(cap_max_first=0):
        base, cap = _others(), render(softcap=True)
    assert "s_x" not in cap and "_turn(" not in cap and "_BAR_TURN" not in cap  # all off
    for lever in LEVERS:
        with variant(**{"cap_max_first": 0, **lever}):
            assert _others() == base, lever  # plain, window, fp16, d64, fp8, softcap with the window: unchanged
            assert render(softcap=True) != cap, lever


def test_max_first_is_the_product():
    """CAP_MAX_FIRST (H200, twenty-third session: the suite's softcap row 1.021x / 1.022x per pass in rounds A / B, out
    and lse bit for bit the product's before it): main's softcap render takes the max before the tanh; the plain
    and window renders are those of cap_max_first 0 byte for byte."""
    from fagen.backends import gluon
    assert gluon.CAP_MAX_FIRST == 1 and backends.GLUON.variant["cap_max_first"] == gluon.CAP_MAX_FIRST
    assert "s_acc = _tanh(s_x)" in func(render(softcap=True), "_softmax")
    base = _others()
    with variant(cap_max_first=0):
        assert _others() == base and "s_x" not in render(softcap=True)


def test_max_first_takes_the_unmasked_max_before_the_tanh():
    with variant(cap_max_first=1):
        soft = func(render(softcap=True), "_softmax")
    assert "s_x = s_acc * cap_in" in soft and "s_acc = _tanh(s_x)" in soft
    masked, unmasked = soft.split("    if MASKED:\n")[1].split("    else:\n", 1)
    # the masked step keeps the max on the tanh (a masked score is -inf only after it); the unmasked one takes the
    # tanh of the row max of the scaled scores (tanh is monotonic: the same m)
    assert "gl.max(s_acc, 1) * qk_scale" in masked and "s_x" not in masked
    assert "m_new = gl.maximum(m_i, _tanh(gl.max(s_x, 1)) * qk_scale)" in unmasked


@pytest.mark.parametrize("turns", [1, 2, 3, 4, 5])
def test_turns_in_the_bf16_softcap_forward(turns):
    with variant(cap_turns=turns):
        src = render(softcap=True)
    step = func(src, "_consumer_step")
    assert "_BAR_TURN = gl.constexpr(14)" in src and "WG: gl.constexpr" in step
    soft = func(src, "_softmax")
    # turns 4: warpgroup 0 meets warpgroup 1 after its row max, warpgroup 1 after its exponentials (both present, or
    # bar.red 14 waits for a partner that never comes)
    assert (soft.count("_turn_dep(") == 2) == (turns == 4), soft
    assert ("_turn(n, \"sync\", _BAR_TURN + WG)" in step) == (turns in (1, 3))


_SCRIPT = r"""
import json, os, re, sys
from collections import Counter
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
sys.path.insert(0, os.path.join(sys.argv[1], "scripts"))
import fagen
from fagen import backends
from fagen.spec.kernel import KernelSpec
from fagen.codegen import render
from fagen.runtime.loader import load_source
from sm90 import ptxas
from gpu_softcap_s23 import step_loops

out = {}
saved = dict(backends.GLUON.variant)
for key, changes in json.loads(sys.argv[2]).items():
    backends.GLUON.variant.clear()
    backends.GLUON.variant.update({**saved, **changes})
    spec = KernelSpec(backend="gluon", head_dim=128, mask="causal", softcap=True, dtype="bf16")
    render.render.cache_clear()
    mod = load_source(fagen.generate(spec), spec.name + "_" + key)
    res, log, dump = ptxas(mod.compile_for().asm["ptx"], sass=True)
    r = next(iter(res.values()))
    steps = []
    for body in step_loops(dump):
        ops = Counter(re.sub(r"^@!?U?P\w+\s+", "", y).split(" ")[0] for y in body)
        ex2 = [i for i, y in enumerate(body) if "MUFU.EX2" in y]
        pv = [i for i, y in enumerate(body) if "DEPBAR.LE gsb0, 0x0" in y]
        steps.append(dict(hgmma=sum("HGMMA" in y for y in body), ex2=len(ex2), tanh=ops["MUFU.TANH"],
                          pv_after=sum(i < pv[0] for i in ex2) if pv else -1, red=sum("BAR.RED" in y for y in body),
                          fmnmx=ops["FMNMX"]))
    out[key] = dict(spills=r.spill_stores + r.spill_loads, serialized="serialized" in log,
                    steps=[s for s in steps if s["hgmma"] == 16])
print("RESULT " + json.dumps(out))
"""
MODULES = {"main": {"cap_max_first": 0}, "pv": {"pv_overlap": 1, "cap_max_first": 0},
           "turns4": {"cap_turns": 4, "cap_max_first": 0}, "maxfirst": {}}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_sm90(tmp_path_factory, _SCRIPT, MODULES, "softcap-levers-sm90")


@pytest.mark.skipif(ON_GPU, reason="an sm_90 build on the CPU (the GPU script runs the kernels)")
@pytest.mark.parametrize("key", list(MODULES))
def test_sm90_no_spills_and_where_the_p_v_wait_sits(built, key):
    r = built[key]
    assert r["spills"] == 0 and not r["serialized"] and len(r["steps"]) == 4, r
    unmasked = [s for s in r["steps"] if s["tanh"] >= 64 and s["ex2"] == 66]
    assert len(unmasked) == 4, r  # two warpgroups x (unmasked, masked): 64 tanh and 66 exp2 a step (64 P, 2 alpha)
    tanh = sorted(s["tanh"] for s in r["steps"])
    after = sorted(s["pv_after"] for s in r["steps"])
    if key == "main":  # ptxas waits for P V before the exponentials ([Note] V release)
        assert tanh == [64] * 4 and max(after) <= 2, r
    if key == "pv":  # the softmax in its own block: the wait after every exponential
        assert tanh == [64] * 4 and after == [66] * 4, r
    if key == "turns4":  # warpgroup 1's bar.red after its exponentials pins its P V wait behind them
        assert all(s["red"] == 1 for s in r["steps"]) and after.count(66) >= 2, r
    if key == "maxfirst":  # (the product) one tanh of the row max a row (a thread's two rows) in the unmasked loops
        assert tanh == [64, 64, 66, 66] and max(after) <= 2, r
