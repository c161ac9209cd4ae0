"""The product Gluon backward's launch order ([Note] Launch order in fagen/templates/gluon/backward.py.j2, variant
bwd_spt): the rendered module's own tile and turn helpers, run as plain Python on ints, give every (batch, query
head, query block) its adds' turns 0 .. n - 1 once, and each add waits only for an add of a tile launched before
its own. With tiles handed out in launch order (CUDA's 1-D grid, bwd_grid 1) or taken in increasing order by each
program of the persistent grid, the unfinished tile launched first can always go on: no deadlock."""

import types
from collections import defaultdict

import pytest

import fagen
from fagen import backends
from fagen.codegen import render
from fagen.runtime.loader import load_source
from fagen.spec.kernel import KernelSpec

# (B, Hkv, GQA, Sq, Sk): lengths not multiples of the blocks, Sq > Sk (rows that see no key) and Sq < Sk, GQA 1-4
SHAPES = [(1, 3, 1, 700, 700), (2, 2, 4, 257, 390), (1, 2, 2, 1000, 600), (2, 1, 1, 600, 1000), (1, 2, 1, 64, 64)]


@pytest.fixture(scope="module")
def helpers():
    """The causal render with bwd_spt and bwd_fixed_fma 2 on: its _bwd_spt, _bwd_spt_turn, _bwd_tile and _bwd_adds
    ([Note] FMA rounding) as plain functions, their gl calls through a scalar shim (every integer division in them
    has non-negative operands, where Python's // and the GPU's agree)."""
    saved = dict(backends.GLUON.variant)
    backends.GLUON.variant.update(bwd_spt=1, bwd_grid=1, bwd_fixed=1, bwd_fixed_fma=2)
    render.render.cache_clear()
    try:
        spec = KernelSpec(backend="gluon", direction="bwd", head_dim=128, mask="causal", dtype="bf16")
        mod = load_source(fagen.generate(spec), f"{spec.name}_spt_order")
    finally:
        backends.GLUON.variant.clear()
        backends.GLUON.variant.update(saved)
        render.render.cache_clear()
    assert mod.BWD_DET_GRID == 1
    mod.gl = types.SimpleNamespace(maximum=max, minimum=min)
    return types.SimpleNamespace(spt=mod._bwd_spt.fn, turn=mod._bwd_spt_turn.fn, tile=mod._bwd_tile.fn,
                                 adds=mod._bwd_adds.fn, bm=mod.BWD_BLOCK_M, bn=mod.BWD_BLOCK_N)


def adds(h, b, hkv, gqa, sq, sk, spt=True):
    """(launch position, counter key, turn) of every dQ add, in launch order: the dQ warp's loop of the render."""
    n_kblk, num_bh = -(-sk // h.bn), b * hkv
    num_tiles = n_kblk * num_bh
    out = []
    for pos in range(num_tiles):
        tile = h.spt(pos, num_tiles, num_bh) if spt else pos
        n_blk, off_b, _, h0, lo, _, hi = h.tile(tile, num_bh, hkv, sq, sk, h.bm, h.bn, gqa, True)
        steps = (hi - lo) // h.bm
        for i in range(gqa * steps):
            g = i // steps
            m0 = lo + (i - g * steps) * h.bm
            turn = h.turn(n_blk, m0, sk - sq, n_kblk, h.bm, h.bn) if spt else n_blk
            out.append((pos, (off_b, h0 + g, m0), turn))
    return out


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}H{}g{}_{}x{}".format(*s))
def test_turns_count_down_once_and_wait_only_on_earlier_launches(helpers, shape):
    got = adds(helpers, *shape)
    assert len(got) == len(adds(helpers, *shape, spt=False))  # every tile once, every step once
    by_key = defaultdict(dict)
    for pos, key, turn in got:
        assert turn not in by_key[key], (key, turn)
        by_key[key][turn] = pos
    for key, turns in by_key.items():
        assert sorted(turns) == list(range(len(turns))), (key, sorted(turns))  # 0 .. n - 1, each once
        # the add before this one comes from a tile launched earlier (a higher key block: shortest tiles first)
        assert all(turns[t - 1] < turns[t] for t in range(1, len(turns))), (key, turns)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}H{}g{}_{}x{}".format(*s))
def test_the_postprocess_counts_each_query_blocks_adds(helpers, shape):
    """bwd_fixed_fma 2 ([Note] FMA rounding): the postprocess takes _bwd_adds(m0) x 0x4B400000 out of every row of
    query block m0, so it must be the number of adds the schedule makes there (0 for blocks that see no key)."""
    b, hkv, gqa, sq, sk = shape
    made = defaultdict(int)
    for _, key, _ in adds(helpers, *shape):
        made[key] += 1
    for off_b in range(b):
        for h in range(hkv * gqa):
            for m0 in range(0, -(-sq // helpers.bm) * helpers.bm, helpers.bm):
                assert made[(off_b, h, m0)] == helpers.adds(m0, sq, sk, helpers.bm, helpers.bn), (off_b, h, m0)


def test_the_fma_mutant_edits_the_fma_render_only(monkeypatch):
    """gluon-bwd-fixed-fma-no-scale ([Note] FMA rounding) edits the renders with bwd_fixed and bwd_fixed_fma on;
    gluon-bwd-fixed-no-scale (cvt.rni) the fixed renders without FMA rounding."""
    from fagen.verify.mutants import GLUON_MUTANTS
    fma, cvt = (next(m for m in GLUON_MUTANTS if m.name == n)
                for n in ("gluon-bwd-fixed-fma-no-scale", "gluon-bwd-fixed-no-scale"))
    spec = KernelSpec(backend="gluon", direction="bwd", head_dim=128, dtype="bf16", mask="none")
    monkeypatch.setitem(backends.GLUON.variant, "bwd_d128", {})  # MHA d128's own keys (bwd_fixed 1)
    for fixed, on in ((1, 1), (1, 0), (0, 1)):
        monkeypatch.setitem(backends.GLUON.variant, "bwd_fixed", fixed)
        monkeypatch.setitem(backends.GLUON.variant, "bwd_fixed_fma", on)
        render.render.cache_clear()
        source = fagen.generate(spec)
        assert fma.applies(spec) and (fma.old in source) == bool(fixed and on)
        assert (cvt.old in source) == bool(fixed and not on)
    render.render.cache_clear()


def _simulate(progs, lag=2):
    """Each program of the persistent grid takes one step a tick once its counter equals its turn; an add counts
    `lag` ticks later. The ticks until all are done, or None on a deadlock."""
    sem, pending, pos, t, idle = defaultdict(int), defaultdict(list), [0] * len(progs), 0, 0
    while any(p < len(prog) for p, prog in zip(pos, progs)):
        for key in pending.pop(t, []):
            sem[key] += 1
        moved = False
        for p, prog in enumerate(progs):
            if pos[p] < len(prog) and sem[prog[pos[p]][0]] == prog[pos[p]][1]:
                pending[t + lag].append(prog[pos[p]][0])
                pos[p] += 1
                moved = True
        idle = 0 if moved else idle + 1
        if idle > lag + 1 and not any(pending.values()):
            return None
        t += 1
    return t


@pytest.mark.parametrize("order", [1, 4])
@pytest.mark.parametrize("shape", [(1, 16, 1, 4000, 1333), (2, 3, 4, 700, 700), (2, 8, 1, 600, 2000)],
                         ids=lambda s: "B{}H{}g{}_{}x{}".format(*s))
def test_the_full_masks_wave_order_d_steps_apart_is_a_fixed_order_without_deadlock(order, shape):
    """bwd_order d ([Note] Wave order, full mask): on the persistent grid (132 programs, several waves), the render's
    _bwd_order / _bwd_visit / _bwd_turn give every block its turns 0 .. n - 1 once and the grid finishes."""
    b, hkv, gqa, sq, sk = shape
    saved = dict(backends.GLUON.variant)
    backends.GLUON.variant.update(bwd_order=order)
    render.render.cache_clear()
    try:
        spec = KernelSpec(backend="gluon", direction="bwd", head_dim=128, mask="none", dtype="bf16")
        mod = load_source(fagen.generate(spec), f"{spec.name}_order{order}")
    finally:
        backends.GLUON.variant.clear()
        backends.GLUON.variant.update(saved)
        render.render.cache_clear()
    shim = types.SimpleNamespace(maximum=max, minimum=min, where=lambda c, x, y: x if c else y)
    mod.gl = shim
    order_fn, visit, turn_fn, tile_fn = (getattr(mod, n).fn for n in ("_bwd_order", "_bwd_visit", "_bwd_turn",
                                                                       "_bwd_tile"))
    bm, bn = mod.BWD_BLOCK_M, mod.BWD_BLOCK_N
    n_kblk, num_bh = -(-sk // bn), b * hkv
    num_tiles = n_kblk * num_bh
    P = min(132, num_tiles)
    shim.num_programs = lambda axis: P
    progs, turns = [], defaultdict(list)
    for p in range(P):
        prog = []
        for tile in range(p, num_tiles, P):
            n_blk, off_b, off_hkv, h0, lo, _, hi = tile_fn(tile, num_bh, hkv, sq, sk, bm, bn, gqa, False)
            steps = (hi - lo) // bm
            T = gqa * steps
            off, D, n_lo, n_hi = order_fn(tile, n_blk, off_b * hkv + off_hkv, num_bh, n_kblk, T, False, order)
            for i in range(T):
                f = visit(i, off, T)
                m0 = lo + (f % steps) * bm
                key = (off_b, h0 + f // steps, m0)
                turn = turn_fn(n_blk, i, m0, off, D, n_lo, n_hi, T, n_kblk, sk - sq, bm, bn, False)
                prog.append((key, turn))
                turns[key].append(turn)
        progs.append(prog)
    assert all(sorted(v) == list(range(len(v))) for v in turns.values())
    assert len(turns) == b * hkv * gqa * -(-sq // bm)
    assert _simulate(progs) is not None and _simulate(progs, lag=3) is not None
