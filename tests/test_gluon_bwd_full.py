"""The Gluon backward's full-mask levers (variant bwd_full_levers, twelfth session; docs/hopper.md, "The d128 full
rows"): a plain full spec's own unordered kernel `_attn_bwd_hopper_u`, which serves DQ_MODE 1 and 2, with the causal
kernel's levers; the d128 full default has it (bwd_d128's named barriers 2 + TMA epilogue), causal and switched or
modded full specs do not read the key, and bwd_persist puts modes 1 and 2 on the persistent grid. The sm_90 builds:
tests/test_gluon_bwd_compile.py; on an H100: scripts/gpu_bwdfull_s12.py."""

import fagen
from fagen import backends
from fagen.codegen import render
from fagen.spec.kernel import KernelSpec

D128 = {"bwd_fixed": 1, "bwd_fixed_tma": 1, "bwd_sections": 4}


def _source(levers=None, mask="none", **fields):
    """The d128 bf16 backward render; `levers`: bwd_full_levers, in bwd_d128 and at the top level (which a switched
    spec reads: bwd_d128 is for plain specs), None: the default's."""
    saved = dict(backends.GLUON.variant)
    if levers is not None:
        backends.GLUON.variant.update(bwd_d128={**D128, "bwd_full_levers": levers}, bwd_full_levers=levers)
    render.render.cache_clear()
    try:
        return fagen.generate(KernelSpec(backend="gluon", direction="bwd", head_dim=128, mask=mask, dtype="bf16",
                                         **fields))
    finally:
        backends.GLUON.variant.clear()
        backends.GLUON.variant.update(saved)
        render.render.cache_clear()


def test_the_full_default_runs_both_modes_on_the_levers_kernel():
    src = _source()
    assert "_BWD_KERNELS = {0: (_attn_bwd_hopper, 0), 1: (_attn_bwd_hopper_u, 1)}" in src  # the TMA epilogue
    assert "_BWD_KERNELS[2] = _BWD_KERNELS[1]" in src and "\nBWD_DET_MODE = 2" in src  # deterministic: mode 2
    u = src[src.index("def _bwd_producer_u("):src.index("def _attn_bwd_hopper_u(")]
    plain = src[src.index("def _bwd_producer("):src.index("def _bwd_producer_u(")]
    assert '_named_bar(j, "sync", _BAR_DS, 256)' in u and "_named_bar(" not in plain  # named 2 in _u only
    assert "tma.async_copy_shared_to_global(DK," in u and "tma.async_copy_shared_to_global(DK," not in plain
    assert "\nBWD_GRID_ALL = 1" in src  # one program per tile (L2 sections)


def test_off_renders_no_levers_kernel_and_causal_ignores_the_key():
    plain = _source({})
    assert "_attn_bwd_hopper_u" not in plain and "_named_bar" not in plain
    causal = _source({"bwd_named": 1}, mask="causal")  # the causal kernel takes bwd_unordered_levers (named 2)
    assert '_named_bar(j, "sync", _BAR_DS, 256)' in causal
    assert "_attn_bwd_hopper_u" not in _source({"bwd_named": 2}, softcap=True)  # switched specs: the plain kernel


def test_persist_puts_modes_1_and_2_on_the_persistent_grid():
    """bwd_persist 1: BWD_GRID_ALL 0 (the host launches at most one program per SM for every mode); causal keeps 1."""
    assert "\nBWD_GRID_ALL = 0" in _source({"bwd_named": 2, "bwd_persist": 1})
    assert "\nBWD_GRID_ALL = 1" in _source({"bwd_named": 2})
    assert "\nBWD_GRID_ALL = 1" in _source({"bwd_persist": 1}, mask="causal")
