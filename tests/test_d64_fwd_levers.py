"""The bf16/fp16 Gluon forward's measurement levers, twenty-third session ([Note] The d64 forward's levers in
fagen/templates/gluon/attention.py.j2; GluonBackend.variant fwd_exp_poly K / fwd_exp_deg, fwd_turns M, fwd_s_ahead 1,
fwd_wgs 3; all off in the product). Here: the render only where on (plain bf16/fp16 specs; the switches, mods, padding
masks, MLA and fp8 renders unchanged), the rendered polynomial run in numpy against 2**x in float64 and its share's
split and join, the three-warpgroup host's tile rows, and the sm_90 builds (no spills in the step loops, the MUFU
count down by the share in the unmasked steps only, the turns' barriers). The kernels against float64 and their times:
scripts/gpu_d64fwd_s23.py on the GPU (docs/hopper.md, "The d64 forward (twenty-third session)")."""

import re

import numpy as np
import pytest

import fagen
from fagen.spec.kernel import KernelSpec
from _env import ON_GPU
from test_fp8_wgs import variant
from test_hopper_compile import build_sm90

REL = {2: 2.1e-3, 3: 1.2e-4}  # the polynomial's relative error over f in [-0.5, 0.5], with float32's rounding
OFF = dict(fwd_exp_poly=0, fwd_turns=0, fwd_s_ahead=0, fwd_wgs=2)
LEVERS = (dict(fwd_exp_poly=2), dict(fwd_exp_poly=4, fwd_exp_deg=2), dict(fwd_turns=2), dict(fwd_turns=4),
          dict(fwd_s_ahead=1), dict(fwd_wgs=3))


def render(mask="causal", head_dim=64, **fields):
    return fagen.generate(KernelSpec(backend="gluon", head_dim=head_dim, mask=mask, **{"dtype": "bf16", **fields}))


def func(src, name):
    i = src.index(f"def {name}(")
    return src[i:src.index("\n\n\n", i)]


OTHERS = (dict(softcap=True), dict(window=True), dict(mask="causal+padding"), dict(dtype="fp8_e4m3"),
          dict(dtype="fp8_e4m3", mask="none"), dict(head_dim=192, head_dim_v=128))


def test_off_renders_none_of_them_and_other_specs_ignore_them():
    with variant(**OFF):
        plain = render()
        others = [render(**f) for f in OTHERS]
    for name in ("_fexp2_poly", "_fexp2_mix", "_consumer_step_ahead", "_BAR_TURN", "The d64 forward's levers"):
        assert name not in plain, name
    assert "n_m = _cdiv(sq, 2 * BLOCK_M)" in plain
    for lever in LEVERS:
        with variant(**lever):
            assert render() != plain, lever
            assert [render(**f) for f in OTHERS] == others, lever  # plain bf16/fp16 forwards only


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_the_polynomial_only_in_unmasked_steps(k):
    with variant(fwd_exp_poly=k):
        src = render(mask="none", dtype="fp16")
    soft = func(src, "_softmax")
    masked, unmasked = soft.split("    if MASKED:\n        p = gl.exp2(")[1].split("    else:\n        p = _fexp2_mix(")
    assert "s_acc * qk_scale - m_use[:, None]" in masked and "alpha = gl.exp2(m_i - m_use)" in unmasked
    mix = func(src, "_fexp2_mix")
    assert mix.count("_fexp2_poly(") == bin(k).count("1") and ("gl.exp2(" in mix) == (k < 8)


def test_three_warpgroups_host_and_tiles():
    with variant(fwd_wgs=3):
        src = render()
    assert "n_m = _cdiv(sq, 3 * BLOCK_M)" in src and "m_blk * (3 * BLOCK_M)" in src
    assert "CONSUMER_REGS = 160" in src and "_consumer2" in src
    # one O staging buffer a warpgroup (round A's builds faulted with two: warpgroup 2 stored past them)
    assert "o_smem = gl.allocate_shared_memory(dtype, [3, BLOCK_M, HEAD_DIM], q_layout)" in src


class _GL:
    maximum = staticmethod(lambda x, y: np.fmax(x, np.float32(y)))
    fma = staticmethod(lambda a, b, c: (np.float64(a) * np.float64(b) + np.float64(c)).astype(np.float32))


def _np_poly(src):
    """The rendered _fexp2_poly as a numpy function on float32 arrays (max.f32 drops NaN as np.fmax; one rounding per
    fma; bitcasts as views; int32 arithmetic wraps)."""
    body = func(src, "_fexp2_poly").replace(".to(gl.int32, bitcast=True)", ".view(np.int32)").replace(
        ".to(gl.float32, bitcast=True)", ".view(np.float32)")
    assert "bitcast" not in body and "@" not in body
    ns = {"np": np, "gl": _GL}
    exec(body, ns)  # noqa: S102 (the repo's own render)
    return lambda x: ns["_fexp2_poly"](np.asarray(x, np.float32))


def _xs():
    g = np.random.default_rng(0)
    return np.concatenate([np.linspace(-127, 8, 200001), g.uniform(-127, 8, 100000), np.arange(-127, 9),
                           np.arange(-127, 8) + 0.5, np.arange(-127, 8) - 0.5]).astype(np.float32)


def _poly_error(f, x):
    """(the largest relative error where 2^x is normal (x >= -125), the largest absolute error below)"""
    with np.errstate(over="ignore", invalid="ignore"):
        got = f(x).astype(np.float64)
    want = np.exp2(x.astype(np.float64))
    hi = x >= -125
    return float(np.max(np.abs(got[hi] - want[hi]) / want[hi])), float(np.max(np.abs(got[~hi] - want[~hi])))


@pytest.mark.parametrize("deg", [2, 3])
def test_the_polynomial_against_2_to_the_x(deg):
    with variant(fwd_exp_poly=4, fwd_exp_deg=deg):
        src = render()
    f = _np_poly(src)
    rel, low = _poly_error(f, _xs())
    assert rel <= REL[deg] and low <= 2.0 ** -125, (rel, low)
    out = f(np.array([-np.inf, -127.0, -128.0, -1000.0, -3e38], np.float32))  # c0 = 1: exactly +0.0 below the clamp
    assert (out.view(np.int32) == 0).all(), out
    assert f(np.array([0.0, 8.0, -1.0, 3.0], np.float32)).tolist() == [1.0, 256.0, 0.5, 8.0]
    # red when the round's magic constant, the exponent's shift or a coefficient is off
    for bad in (src.replace("12582912.0", "8388608.0"), src.replace("<< 23)", "<< 22)"),
                re.sub(r"(p = gl\.fma\(f, )(\d\.\d+)", lambda m: m.group(1) + str(float(m.group(2)) * 1.01), src, 1),
                re.sub(r"(p = gl\.fma\(f, [0-9.]+, )(\d\.\d+)", lambda m: m.group(1) + str(float(m.group(2)) * 1.003),
                       src, 1)):
        assert bad != src
        rel_b, low_b = _poly_error(_np_poly(bad), _xs())
        assert rel_b > REL[deg] or low_b > 2.0 ** -125, (rel_b, low_b)


class _Tagged:
    """gl for _fexp2_mix in numpy: gl.exp2 keeps an element's sign, _fexp2_poly flips it, so the output shows which
    path each element took and where it landed."""
    split = staticmethod(lambda x: (x[..., 0], x[..., 1]))
    join = staticmethod(lambda a, b: np.stack([a, b], -1))
    permute = staticmethod(lambda x, p: np.transpose(x, p))
    reshape = staticmethod(lambda x, s: np.reshape(x, s))
    exp2 = staticmethod(lambda x: x + 0.0)
    convert_layout = staticmethod(lambda x, layout: x)
    static_assert = staticmethod(lambda c: None)
    constexpr = object


@pytest.mark.parametrize("k", [1, 2, 3, 4, 6, 8])
def test_the_share_is_k_eighths_of_every_thread_and_each_element_returns_to_its_place(k):
    with variant(fwd_exp_poly=k):
        body = func(render(), "_fexp2_mix")
    body = body.replace("M: gl.constexpr = x.shape[0]", "M = x.shape[0]").replace(
        "N: gl.constexpr = x.shape[1]", "N = x.shape[1]").replace("x.type.layout", "None")
    ns = {"gl": _Tagged, "_fexp2_poly": lambda x: -x}
    exec(body, ns)  # noqa: S102
    m, n = 64, 128
    x = (np.arange(m * n, dtype=np.float64) + 1).reshape(m, n)
    out = ns["_fexp2_mix"](x)
    assert out.shape == (m, n) and (np.abs(out) == x).all()  # every element back in its place
    poly = out < 0
    cols = np.arange(n)  # a thread holds column bits 0, 3.. in registers; bits 1, 2 are its lane's
    for lane_cols in range(4):
        assert (poly[:, (cols >> 1) % 4 == lane_cols].sum(1) == 4 * k).all()
    assert (poly.sum(0) % m == 0).all()  # by column: the same columns in every row


_SCRIPT = r"""
import json, os, re, sys
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
sys.path.insert(0, os.path.join(sys.argv[1], "scripts"))
import fagen
from fagen import backends
from fagen.spec.kernel import KernelSpec
from fagen.codegen import render
from fagen.runtime.loader import load_source
from sm90 import ptxas
from gpu_d64fwd_s23 import step_loops

out = {}
for key, fields in json.loads(sys.argv[2]).items():
    fields = dict(fields)
    for name in ("fwd_exp_poly", "fwd_turns", "fwd_s_ahead"):
        backends.GLUON.variant[name] = fields.pop(name, 0)
    spec = KernelSpec(backend="gluon", head_dim=64, dtype="bf16", **fields)
    render.render.cache_clear()
    mod = load_source(fagen.generate(spec), spec.name + "_" + key)
    res, log, dump = ptxas(mod.compile_for().asm["ptx"], sass=True)
    r = next(iter(res.values()))
    out[key] = dict(regs=r.registers, spills=r.spill_stores + r.spill_loads, serialized="serialized" in log,
                    steps=[s for s in step_loops(dump) if s["HGMMA"] == 12])
print("RESULT " + json.dumps(out))
"""
MODULES = {"product": dict(mask="causal"), "poly2": dict(mask="causal", fwd_exp_poly=2),
           "turns2_full": dict(mask="none", fwd_turns=2), "ahead": dict(mask="causal", fwd_s_ahead=1)}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_sm90(tmp_path_factory, _SCRIPT, MODULES, "d64-fwd-levers-sm90")


@pytest.mark.skipif(ON_GPU, reason="an sm_90 build on the CPU (the GPU script runs the kernels)")
@pytest.mark.parametrize("key", list(MODULES))
def test_sm90_no_spills_and_the_mufu_count_drops_by_the_share(built, key):
    r, k = built[key], MODULES[key].get("fwd_exp_poly", 0)
    assert r["spills"] == 0 and not r["serialized"], r
    steps = r["steps"]
    if key == "ahead":  # the prologue's S and the peeled last step: the loops' S issues 4 wgmmas a step more or less
        assert steps and all(s["MUFU"] == 66 for s in steps[:4]), r
        return
    # two consumer warpgroups x (unmasked, masked) step loops (d64: 4 + 8 wgmmas a step): 66 MUFU a step (64 exp2 of
    # P, 2 of alpha); the unmasked ones lose 64 k / 8 exp2, the masked ones keep them
    assert len(steps) == 4, r
    assert sorted(s["MUFU"] for s in steps) == sorted([66 - 8 * k] * 2 + [66] * 2), r
    # the turns: mode 2 one bar.sync a step in each warpgroup's loop, beside triton's own 3
    assert all(s["BAR"] == (4 if key.startswith("turns2") else 3) for s in steps), r
    assert all(s["LDL"] + s["STL"] == 0 for s in steps), r
