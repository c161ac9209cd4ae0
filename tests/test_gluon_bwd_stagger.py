"""Staggered walks in the Gluon backward ([Note] Staggered walks in fagen/templates/gluon/backward.py.j2; variant
bwd_full_levers' bwd_stagger, twelfth session): the rendered module's own `_bwd_stagger` and `_bwd_visit`, run as
plain Python on ints, make every tile of a full-mask problem visit each of its (query head, query block) pairs once;
key blocks that run side by side are at different pairs at every step; the producer, the compute warpgroups and the
dQ warp of the unordered kernel walk the same way; the render without the key has none of it."""

import re
import types

import pytest

import fagen
from fagen import backends
from fagen.codegen import render
from fagen.runtime.loader import load_source
from fagen.spec.kernel import KernelSpec

D128 = {"bwd_fixed": 1, "bwd_fixed_tma": 1, "bwd_sections": 4}


def _source(levers, mask="none", gqa=1):
    saved = dict(backends.GLUON.variant)
    backends.GLUON.variant.update(bwd_d128={**D128, "bwd_full_levers": levers},
                                  bwd_full_levers=levers if gqa > 1 else {})
    render.render.cache_clear()
    try:
        return fagen.generate(KernelSpec(backend="gluon", direction="bwd", head_dim=128, mask=mask, dtype="bf16",
                                         gqa=gqa))
    finally:
        backends.GLUON.variant.clear()
        backends.GLUON.variant.update(saved)
        render.render.cache_clear()


@pytest.fixture(scope="module")
def helpers():
    src = _source({"bwd_stagger": 2})
    mod = load_source(src, "attn_bwd_full_stagger_test")
    mod.gl = types.SimpleNamespace(maximum=max, minimum=min, where=lambda c, a, b: a if c else b)
    return types.SimpleNamespace(stagger=mod._bwd_stagger.fn, visit=mod._bwd_visit.fn, tile=mod._bwd_tile.fn,
                                 bm=mod.BWD_BLOCK_M, bn=mod.BWD_BLOCK_N, src=src)


# (B, Hkv, GQA, Sq, Sk): lengths not multiples of the blocks, Sq > Sk and Sq < Sk, one query block, GQA 1-4
SHAPES = [(1, 3, 1, 700, 1000), (2, 2, 4, 257, 390), (1, 2, 1, 1000, 600), (1, 1, 1, 64, 64), (1, 2, 2, 3000, 2000)]


@pytest.mark.parametrize("s", [1, 2, 8])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}H{}g{}_{}x{}".format(*s))
def test_every_tile_visits_each_pair_once(helpers, shape, s):
    b, hkv, gqa, sq, sk = shape
    num_bh, n_kblk = b * hkv, -(-sk // helpers.bn)
    for tile in range(n_kblk * num_bh):
        n_blk, _, _, _, lo, _, hi = helpers.tile(tile, num_bh, hkv, sq, sk, helpers.bm, helpers.bn, gqa, False)
        steps = (hi - lo) // helpers.bm
        off = helpers.stagger(n_blk, gqa * steps, s)
        assert 0 <= off < max(gqa * steps, 1)
        seen = [helpers.visit(i, off, gqa * steps) for i in range(gqa * steps)]
        assert sorted(seen) == list(range(gqa * steps)), (tile, off, seen)


@pytest.mark.parametrize("s", [1, 2])
def test_side_by_side_key_blocks_walk_apart(helpers, s):
    """The lever's point: at s16k (256 query blocks a head) the ~33 key blocks of a head in one wave are at 33
    different query blocks at every step (unstaggered they were all at the same one)."""
    T = 16384 // helpers.bm
    for n_first in (0, 40, 100):
        for i in (0, 17, 255):
            at = {helpers.visit(i, helpers.stagger(n, T, s), T) for n in range(n_first, n_first + 33)}
            assert len(at) == 33, (n_first, i, sorted(at))


def test_the_three_partitions_walk_alike(helpers):
    """The unordered kernel's producer, compute warpgroups and dQ warp each start at _bwd_stagger's pair and step
    through _bwd_visit (a partition left unstaggered adds dQ into another block's rows: the GPU script's mutant)."""
    u = helpers.src[helpers.src.index("def _bwd_producer_u"):helpers.src.index("def _attn_bwd_hopper_u")]
    assert len(re.findall(r"off = _bwd_stagger\(n_blk, GQA \* steps, 2\)", u)) == 3
    assert len(re.findall(r"f = _bwd_visit\(i, off, GQA \* steps\)", u)) == 3
    # the deterministic-mode table points at the unordered kernel: DQ_MODE 2 takes the walk too
    assert "1: (_attn_bwd_hopper_u, 0)}" in helpers.src and "_BWD_KERNELS[2] = _BWD_KERNELS[1]" in helpers.src
    # mode 0's kernel (the fixed-order chain, whose turns assume ascending walks) keeps its plain walk
    plain = helpers.src[helpers.src.index("def _bwd_producer("):helpers.src.index("def _bwd_producer_u")]
    assert "_bwd_stagger(" not in plain and "_bwd_visit(" not in plain


def test_off_renders_nothing_and_causal_ignores_the_key():
    """bwd_full_levers {} (the default) renders no unordered kernel at full; the causal render takes
    bwd_unordered_levers, never bwd_full_levers (its walks start at the diagonal already)."""
    plain = _source({})
    assert "_bwd_stagger" not in plain and "_attn_bwd_hopper_u" not in plain
    causal = _source({"bwd_stagger": 2}, mask="causal")
    assert "_bwd_stagger" not in causal and "_attn_bwd_hopper_u" in causal
    gqa = _source({"bwd_stagger": 2}, gqa=2)  # bwd_full_levers at top level reaches a full GQA render
    assert gqa.count("off = _bwd_stagger(n_blk, GQA * steps, 2)") == 3


def test_persist_puts_modes_1_and_2_on_the_persistent_grid():
    """bwd_full_levers' bwd_persist 1: the full render's BWD_GRID_ALL is 0 (the host launches at most one program
    per SM for every mode), 1 without it (sections: one program per tile in modes 1 and 2); causal keeps 1."""
    assert "\nBWD_GRID_ALL = 0" in _source({"bwd_persist": 1})
    assert "\nBWD_GRID_ALL = 1" in _source({"bwd_stagger": 2})
    assert "\nBWD_GRID_ALL = 1" in _source({"bwd_persist": 1}, mask="causal")
