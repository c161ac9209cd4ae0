"""The bf16/fp16 Gluon forward's levers, twenty-third session ([Note] The d64 forward's levers in
fagen/templates/gluon/attention.py.j2; GluonBackend.variant fwd_turns M, fwd_s_ahead 1, fwd_wgs 3). fwd_s_ahead is on
for plain d64 MHA forwards (GluonBackend.variant_for, D64_S_AHEAD) and the rule selects the d64 causal one; the others
are off. Here: the render only where on (plain bf16/fp16 specs; the switches, mods, padding masks, MLA and fp8 renders
unchanged), the rule and the variant, the three-warpgroup host's tile rows, and the sm_90 builds (no spills in the
step loops, the turns' barriers). The kernels against float64 and their times: scripts/gpu_d64fwd_s23.py on the GPU
(docs/hopper.md, "The d64 forward (twenty-third session)")."""

import pytest

import fagen
from fagen.backends import gluon as gluon_backend
from fagen.codegen import render as render_mod
from fagen.spec.kernel import KernelSpec
from _env import ON_GPU
from test_fp8_wgs import variant
from test_hopper_compile import build_sm90

OFF = dict(fwd_turns=0, fwd_s_ahead=0, fwd_wgs=2)
LEVERS = (dict(fwd_turns=2), dict(fwd_turns=4), dict(fwd_s_ahead=1), dict(fwd_wgs=3))


@pytest.fixture(autouse=True)
def _no_d64_rule(monkeypatch):
    """The levers' renders at d64 with the product's rule (fwd_s_ahead over every plain d64 MHA forward) off."""
    monkeypatch.setattr(gluon_backend, "D64_S_AHEAD", False)
    render_mod.render.cache_clear()
    yield
    render_mod.render.cache_clear()


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
    for name in ("_consumer_step_ahead", "_BAR_TURN"):
        assert name not in plain, name
    assert "n_m = _cdiv(sq, 2 * BLOCK_M)" in plain
    for lever in LEVERS:
        with variant(**lever):
            assert render() != plain, lever
            assert [render(**f) for f in OTHERS] == others, lever  # plain bf16/fp16 forwards only


def test_three_warpgroups_host_and_tiles():
    with variant(fwd_wgs=3):
        src = render()
    assert "n_m = _cdiv(sq, 3 * BLOCK_M)" in src and "m_blk * (3 * BLOCK_M)" in src
    assert "CONSUMER_REGS = 160" in src and "_consumer2" in src
    # one O staging buffer a warpgroup (round A's builds faulted with two: warpgroup 2 stored past them)
    assert "o_smem = gl.allocate_shared_memory(dtype, [3, BLOCK_M, HEAD_DIM], q_layout)" in src


_SCRIPT = r"""
import json, os, re, sys
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
sys.path.insert(0, os.path.join(sys.argv[1], "scripts"))
import fagen
from fagen import backends
from fagen.backends import gluon as gluon_backend
from fagen.spec.kernel import KernelSpec
from fagen.codegen import render
from fagen.runtime.loader import load_source
from sm90 import ptxas
from gpu_d64fwd_s23 import step_loops

gluon_backend.D64_S_AHEAD = False  # the levers as the variant says (the product's rule puts S ahead at d64)
out = {}
for key, fields in json.loads(sys.argv[2]).items():
    fields = dict(fields)
    for name in ("fwd_turns", "fwd_s_ahead"):
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
MODULES = {"plain": dict(mask="causal"), "turns2_full": dict(mask="none", fwd_turns=2),
           "ahead": dict(mask="causal", fwd_s_ahead=1)}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_sm90(tmp_path_factory, _SCRIPT, MODULES, "d64-fwd-levers-sm90")


@pytest.mark.skipif(ON_GPU, reason="an sm_90 build on the CPU (the GPU script runs the kernels)")
@pytest.mark.parametrize("key", list(MODULES))
def test_sm90_no_spills_and_the_step_loops(built, key):
    r = built[key]
    assert r["spills"] == 0 and not r["serialized"], r
    steps = r["steps"]
    if key == "ahead":  # the prologue's S and the peeled last step: the loops' S issues 4 wgmmas a step more or less
        assert steps and all(s["MUFU"] == 66 for s in steps[:4]), r
        return
    # two consumer warpgroups x (unmasked, masked) step loops (d64: 4 + 8 wgmmas a step): 66 MUFU a step (64 exp2 of
    # P, 2 of alpha)
    assert len(steps) == 4, r
    assert all(s["MUFU"] == 66 for s in steps), r
    # the turns: mode 2 one bar.sync a step in each warpgroup's loop, beside triton's own 3
    assert all(s["BAR"] == (4 if key.startswith("turns2") else 3) for s in steps), r
    assert all(s["LDL"] + s["STL"] == 0 for s in steps), r


def test_the_rule_selects_the_d64_causal_mha_forward_with_s_ahead(monkeypatch):
    """D64_S_AHEAD ([Note] The d64 forward's levers): the rule takes the plain d64 bf16 causal MHA forward (H200, 1.067x
    the Triton forward, 1.02x cuDNN over 36 passes), and every plain d64 MHA forward render (causal or none, bf16 or
    fp16) reads fwd_s_ahead 1; GQA, switches, mods, padding, fp8 and d128 keep their variant and the rule's answer."""
    from fagen.runtime import hopper

    def spec(**kw):
        return KernelSpec(**{"head_dim": 64, "mask": "causal", "dtype": "bf16", **kw})
    for on in (True, False):
        monkeypatch.setattr(gluon_backend, "D64_S_AHEAD", on)
        assert hopper.selected(spec()) is on
        assert not hopper.selected(spec(mask="none")) and not hopper.selected(spec(gqa=2))
        assert not hopper.selected(spec(window=True)) and not hopper.selected(spec(dtype="fp16"))
        assert hopper.selected(spec(head_dim=128))  # d128's rule as before
        v = fagen.backends.GLUON.variant_for
        for kw in ({}, dict(mask="none"), dict(dtype="fp16")):
            assert v(spec(backend="gluon", **kw))["fwd_s_ahead"] == int(on), kw
        for kw in (dict(gqa=2), dict(softcap=True), dict(mask="causal+padding"), dict(head_dim=128),
                   dict(dtype="fp8_e4m3"), dict(direction="bwd")):
            assert v(spec(backend="gluon", **kw)).get("fwd_s_ahead", 0) == 0, kw
    monkeypatch.setattr(gluon_backend, "D64_S_AHEAD", True)
    render_mod.render.cache_clear()
    with variant(fwd_s_ahead=0):  # the rule's variant reaches the render: the S-ahead step, not the plain loop
        src = render()
    assert "_consumer_step_ahead" in src and "_consumer_step_ahead" not in render(head_dim=128)
