"""The prefix-LM mask in one Gluon backward ([Note] Prefix rows in the backward in
fagen/templates/gluon/backward.py.j2, variant bwd_prefix; [Note] Prefix rows in one backward in fagen/mods/split.py):
the render's own _bwd_tile, run as plain Python on ints, visits every (query block, key block) that holds a visible
pair (row i sees key j iff j <= i or j < P), runs unmasked only steps whose pairs are all visible, and the key blocks
that add to a query block are a prefix of them (so the fixed-order dQ's turn is the key block); the render threads
`prefix` through every partition and the host, and the default render is unchanged. The kernels themselves run in
scripts/gpu_modsmask_s10.py (H100)."""

import types

import pytest

import fagen
from fagen import backends
from fagen.codegen import render
from fagen.runtime.loader import load_source
from fagen.spec.kernel import KernelSpec

SPEC = dict(backend="gluon", direction="bwd", head_dim=128, mask="causal", dtype="bf16")


def _source(**lever):
    saved = dict(backends.GLUON.variant)
    backends.GLUON.variant.update(lever)
    render.render.cache_clear()
    try:
        return fagen.generate(KernelSpec(**SPEC))
    finally:
        backends.GLUON.variant.clear()
        backends.GLUON.variant.update(saved)
        render.render.cache_clear()


@pytest.fixture(scope="module")
def tile():
    src = _source(bwd_prefix=1)
    mod = load_source(src, "gluon_bwd_prefix_test")
    assert mod.BWD_PREFIX == 1
    mod.gl = types.SimpleNamespace(maximum=max, minimum=min, where=lambda c, a, b: a if c else b)
    return types.SimpleNamespace(fn=mod._bwd_tile.fn, bm=mod.BWD_BLOCK_M, bn=mod.BWD_BLOCK_N)


# (S, P): lengths off the blocks, P inside a key block, on a key block's edge, 0 (plain causal), 1, S - 1
CASES = [(700, 83), (700, 256), (700, 0), (700, 1), (700, 699), (333, 200), (129, 128), (1000, 640), (64, 63)]


@pytest.mark.parametrize("s,p", CASES, ids=lambda x: str(x))
def test_prefix_tiles_cover_the_mask_and_mask_every_partial_step(tile, s, p):
    bm, bn = tile.bm, tile.bn
    n_kblk = -(-s // bn)
    visitors = {}
    for n in range(n_kblk):
        n_blk, _, _, _, lo, split, hi = tile.fn(n, 1, 1, s, s, p, bm, bn, 1, True)
        assert n_blk == n and 0 <= lo <= split <= hi and lo % bm == 0 and hi == -(-s // bm) * bm
        n0 = n * bn
        keys = range(n0, min(n0 + bn, s))
        for m0 in range(0, hi, bm):
            rows = range(m0, min(m0 + bm, s))
            seen = any(j <= i or j < p for i in rows for j in keys)
            if m0 < lo:
                assert not seen, (n, m0)  # skipped: no visible pair
                continue
            visitors.setdefault(m0, []).append(n)
            if m0 >= split:  # unmasked: every pair of the real rows and keys visible, no key tail
                assert n0 + bn <= s and all(j <= i or j < p for i in rows for j in keys), (n, m0)
    for m0, ns in visitors.items():  # the fixed-order dQ: key blocks [0, c) add to each query block
        assert ns == list(range(len(ns))), m0
    assert set(visitors) == set(range(0, -(-s // bm) * bm, bm))  # key 0 is seen by every row


def test_the_render_threads_prefix_and_the_default_is_unchanged():
    src, base = _source(bwd_prefix=1), _source()
    assert "prefix" not in base.replace("BWD_PREFIX = 0", "").split("def _bwd_tile(")[1].split("\n")[0]
    assert "BWD_PREFIX = 0" in base and "(keys[:, None] < prefix)" not in base
    assert src.count("(keys[:, None] < prefix)") == 2  # both compute partitions (deterministic, unordered)
    assert src.count('"sq_pad", "prefix"]') == 2  # both main kernels: not specialized on P
    assert "None, (0, ))" in src  # the public backward passes P = 0 (the plain causal mask)
    other = _source(bwd_prefix=1, bwd_spt=1)  # a lever that sets the turns: no prefix
    assert "BWD_PREFIX = 0" in other


def test_the_prefix_render_builds_for_sm_90():
    mod = load_source(_source(bwd_prefix=1), "gluon_bwd_prefix_build")
    for det in (True, False):
        assert mod.compile_backward_for(deterministic=det).metadata.shared > 0
