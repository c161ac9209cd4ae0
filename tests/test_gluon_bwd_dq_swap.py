"""The d128 full backward's dQ column swap (variant bwd_full_levers' bwd_dq_swap 1, twenty-second session; [Note] dQ
column swap in fagen/templates/gluon/backward.py.j2, docs/hopper.md "The d128 full backward: the profile
(twenty-second session)"): it renders only where on; the kernels' relabelling (`_dq_swap`, run here with torch's
reshape and permute, which Gluon's follow) and _dq_convert's read-back (`src`, run on ints) are inverse, taken from
the render's own text; the wgmma layout's STS.64 into the 128 B swizzled float32 slot, modelled per half-warp,
conflicts 2-way without the swap and not with it. On an H200: scripts/gpu_bwdfull_s22.py (float64, its mutant)."""

import re

import pytest
import torch

import fagen
from fagen import backends
from fagen.codegen import render

D128 = {"bwd_fixed": 1, "bwd_fixed_tma": 1, "bwd_sections": 4}
LEVERS = {"bwd_named": 2, "bwd_epi_tma": 1}


def _source(swap=None, mask="none", **fields):
    """The d128 bf16 backward render with bwd_full_levers = the default's (+ bwd_dq_swap `swap`)."""
    from fagen.spec.kernel import KernelSpec
    levers = dict(LEVERS, **({} if swap is None else {"bwd_dq_swap": swap}))
    saved = dict(backends.GLUON.variant)
    backends.GLUON.variant.update(bwd_d128={**D128, "bwd_full_levers": levers}, bwd_full_levers=levers)
    render.render.cache_clear()
    try:
        return fagen.generate(KernelSpec(backend="gluon", direction="bwd", head_dim=128, mask=mask, dtype="bf16",
                                         **fields))
    finally:
        backends.GLUON.variant.clear()
        backends.GLUON.variant.update(saved)
        render.render.cache_clear()


def test_renders_only_where_on():
    """Off is the default render; on, both kernels stage `_dq_swap(dq)` and the conversion reads `src`; causal and
    switched renders do not read the key."""
    off, on = _source(), _source(1)
    assert _source(0) == off and "_dq_swap" not in off and "src[None, :]" not in off
    assert on.count(".store(_dq_swap(dq))") == 2  # the deterministic-chain kernel and the unordered one
    assert "def _dq_swap(x):" in on and "+ src[None, :])" in on
    for spec in (dict(mask="causal"), dict(softcap=True)):
        assert _source(1, **spec) == _source(None, **spec)


def _swap_and_src(src):
    """The render's `_dq_swap` body and `src` expression, as Python callables on torch tensors."""
    body = re.search(r"def _dq_swap\(x\):\n(?:.*\n)*?    return (.*)\n", src).group(1)
    expr = re.search(r"\n    src = (.*?)  #", src).group(1)
    return (lambda x: eval(body, {"M": x.shape[0], "N": x.shape[1], "x": x}),  # noqa: S307 - the render's text
            lambda cols: eval(expr, {"cols": cols}))  # noqa: S307


@pytest.mark.parametrize("width", [64, 32])
def test_convert_reads_back_what_the_kernels_staged(width):
    """x [64, width] staged as _dq_swap(x) (the accumulator's columns, TMA copies them as they are), then read by
    the conversion at src: x again, for a dQ half of 64 columns (d128) and of 32 (d64). Seen red with the
    conversion's bit masks 4 and 16 exchanged."""
    swap, src = _swap_and_src(_source(1))
    x = torch.arange(64 * width).reshape(64, width)
    staged = swap(x)
    assert not torch.equal(staged, x)  # the swap moves columns
    assert torch.equal(staged[:, src(torch.arange(width))], x)


def _wavefronts(column):
    """Per STS.64 of the wgmma float32 accumulator layout (a warp: rows l // 4, columns 8 j + 2 (l % 4) and one
    more) into the 128 B swizzled [64, 64] float32 slot (columns in 32-wide blocks, 16 B unit u of row r at
    u ^ (r % 8)): the largest number of 8 B stores on one bank pair within a half-warp, over every j and row group;
    `column` maps a register's column to its slot column."""
    worst = 0
    for j in range(8):
        for r0 in (0, 8):
            for half in (range(16), range(16, 32)):
                hits = {}
                for lane in half:
                    r, c = r0 + lane // 4, column(8 * j + 2 * (lane % 4))
                    byte = (c // 32) * 8192 + r * 128 + ((((c % 32) // 4) ^ (r % 8)) * 16) + (c % 4) * 4
                    bank = (byte // 8) % 16  # 8 B stores: bank pairs
                    hits[bank] = hits.get(bank, 0) + 1
                worst = max(worst, max(hits.values()))
    return worst


def test_staged_stores_without_bank_conflicts():
    """The model gives the default's 2-way conflict (ncu's 135.6 M shared-store conflicts, about 2 per STS.64) and
    none with the render's swap. Seen red with the permute's order the identity (no swap)."""
    swap, _ = _swap_and_src(_source(1))
    perm = swap(torch.arange(64).reshape(1, 64))[0]  # slot column c holds register column perm[c]
    where = {int(v): c for c, v in enumerate(perm)}
    assert _wavefronts(lambda c: c) == 2
    assert _wavefronts(lambda c: where[c]) == 1


def test_the_d128_full_default_takes_the_swap():
    """Flipped on round B (bwd_d128's bwd_full_levers): the d128 MHA full default stages _dq_swap(dq) in both
    kernels and converts back; the d128 causal default and the d64 full default do not."""
    from fagen.spec.kernel import KernelSpec
    render.render.cache_clear()
    spec = dict(backend="gluon", direction="bwd", dtype="bf16")
    full = fagen.generate(KernelSpec(head_dim=128, mask="none", **spec))
    assert backends.GLUON.variant["bwd_d128"]["bwd_full_levers"].get("bwd_dq_swap") == 1
    assert full.count(".store(_dq_swap(dq))") == 2 and "+ src[None, :])" in full
    for other in (KernelSpec(head_dim=128, mask="causal", **spec), KernelSpec(head_dim=64, mask="none", **spec)):
        assert "_dq_swap" not in fagen.generate(other)
