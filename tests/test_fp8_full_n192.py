"""The fp8 forward's full-mask flip, twenty-first session (issue 28): fagen.backends.gluon.FP8_FULL_N192 ([Note] fp8
full-mask 192-key steps): True gives a plain fp8 d128 MHA full-mask forward (no window, switch or mod) the keys
fp8_n192 1 + fp8_turns 4 through GluonBackend.variant_for, so the product path (fagen.load, fagen.attention, the
bench's rows) renders the 192-key steps with cuDNN's warpgroup turns there; causal and every other spec render as
before. The switch's value (on) is pinned here. The kernels run against float64 and the product on the GPU in
scripts/gpu_fp8fwd_s21.py; the sm_90 build of the same render (no spills, 14 QGMMA a step, one bar.red a
warpgroup a step) is tests/test_fp8_turns.py's n192_t4, which the render's equality below ties to the flip. Since the
twenty-second session FP8_N256 ({"none": 3}: the 256-key steps) takes precedence on the full mask; the switch fixture
empties it here (tests/test_fp8_n256.py tests that rule)."""

import contextlib

import pytest

import fagen
from fagen import backends
from fagen.backends import gluon
from fagen.codegen import render as codegen_render
from fagen.spec.axes import SpecError
from fagen.spec.kernel import KernelSpec
from test_fp8_wgs import full_switch as switch, variant


def spec(mask="none", dtype="fp8_e4m3", head_dim=128, **fields):
    return KernelSpec(backend="gluon", head_dim=head_dim, mask=mask, dtype=dtype, **fields)


def test_switch_pinned():
    assert gluon.FP8_FULL_N192 is True  # on since round A of the twenty-first session (docs/hopper.md: full +3.4%)


def _others():
    """Specs the switch must leave alone: causal, the window, GQA, bf16, d64, 64-key blocks, softcap (where taken)."""
    out = [spec("causal"), spec(window=True), spec(gqa=2), spec(dtype="bf16"), spec(head_dim=64),
           spec("causal", window=True), spec(block_n=64)]
    with contextlib.suppress(SpecError, ValueError):
        out.append(spec(softcap=True))
    return out


def test_rule_only_the_plain_full_mask():
    with switch(True):
        assert backends.GLUON.fp8_n192(spec()) and backends.GLUON.variant_for(spec())["fp8_turns"] == 4
        assert not any(backends.GLUON.fp8_n192(s) for s in _others())
        assert all(backends.GLUON.variant_for(s)["fp8_turns"] == 0 for s in _others())
    with switch(False):
        assert not backends.GLUON.fp8_n192(spec()) and backends.GLUON.variant_for(spec())["fp8_turns"] == 0


def test_renders_the_measured_variant_and_leaves_the_rest():
    with switch(False):
        off = fagen.generate(spec())
        others = [fagen.generate(s) for s in _others()]
        with variant(fp8_n192=1, fp8_turns=4):
            measured = fagen.generate(spec())
    assert "def _consumer_step192(" not in off and "def _consumer_step192(" in measured
    with switch(True):
        on = fagen.generate(spec())
        assert [fagen.generate(s) for s in _others()] == others  # causal and the rest unchanged
    assert on == measured  # the nineteenth / twentieth sessions' build, bit for bit the same source


def test_smem_follows_the_switch():
    with switch(False):
        off = backends.GLUON.smem_bytes(spec())
    with switch(True):
        on = backends.GLUON.smem_bytes(spec())
        with variant(fp8_n192=1):
            assert on == backends.GLUON.smem_bytes(spec())
    assert on != off


@pytest.mark.parametrize("mask", ["none", "causal"])
def test_loader_keys_on_the_switch(mask):
    """The loader's memo and render index key on the render's variant (render_state): a module loaded with the switch
    off is never served with it on (the full mask), and the causal one is the same render either way."""
    with switch(False):
        off = codegen_render.render_state(spec(mask))
    with switch(True):
        on = codegen_render.render_state(spec(mask))
    assert (on != off) == (mask == "none")
