"""The lab backward's tile and wave-order helpers (lab/gluon_bwd.py) run as plain Python on ints: every query
block gets every add once, in a fixed order, without deadlock. Lab-side (tests/ must not import the lab, see
tests/test_repo.py); run it as `python -m pytest lab/test_wave_order.py` from the repository root."""

import contextlib
import sys
import types
from collections import defaultdict
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# -- [Note] Wave order, on scalars ----------------------------------------------------------------------------
_JIT = ("_bwd_query_range", "_bwd_tile", "_v1_order", "_v1_visit", "_v1_turn", "_v1_snake", "_v1_sched", "_dq_adds")


@contextlib.contextmanager
def _scalar_helpers(programs):
    """The kernel's tile and order helpers as plain Python on ints (their gl calls through a scalar shim; set
    shim.pid to the program). Every integer division in them has non-negative operands, where Python's // and the
    GPU's agree."""
    from lab import gluon_bwd as gb
    shim = types.SimpleNamespace(maximum=max, minimum=min, where=lambda c, a, b: a if c else b,
                                 num_programs=lambda axis: programs, pid=0)
    shim.program_id = lambda axis: shim.pid
    saved = {n: getattr(gb, n) for n in _JIT + ("gl", )}
    try:
        gb.gl = shim
        for n in _JIT:
            setattr(gb, n, saved[n].fn)
        yield gb
    finally:
        for n, f in saved.items():
            setattr(gb, n, f)


def _schedule(b, hkv, gqa, sq, sk, causal, order, programs=132, bm=64, bn=128, snake=0, headrot=0, dq_split=1,
              spt=0, hgroup=0):
    """Per program of the persistent grid, its steps in order: (the counter's key, the turn it waits for).
    programs=None: one program per tile (GRID 1), in launch order."""
    n_kblk, num_bh = -(-sk // bn), b * hkv
    num_tiles = n_kblk * num_bh
    P = min(programs or num_tiles, num_tiles)
    progs = []
    with _scalar_helpers(P) as k:
        for p in range(P):
            prog = []
            k.gl.pid = p
            for tile0 in range(p, num_tiles, P):
                tile = k._v1_sched(k._v1_snake(tile0, num_tiles, snake), num_tiles, num_bh, spt, hgroup)
                n_blk, off_b, off_hkv, h0, lo, split, hi = k._bwd_tile(tile, num_tiles, num_bh, hkv, sq, sk, bm, bn,
                                                                     gqa, causal, 0)
                steps = (hi - lo) // bm
                T = gqa * steps
                off, D, n_lo, n_hi = k._v1_order(tile, n_blk, off_b * hkv + off_hkv, num_bh, n_kblk, T, causal,
                                                 order, gqa, headrot)
                for i in range(T):
                    f = k._v1_visit(i, off, T)
                    m0 = lo + (f % steps) * bm
                    turn = k._v1_turn(n_blk, i, m0, off, D, n_lo, n_hi, T, n_kblk, sk - sq, bm, bn, causal, order,
                                      dq_split, spt)
                    prog.append((((n_blk % dq_split) * b + off_b, h0 + f // steps, m0), turn))  # the writer's `ob`
            progs.append(prog)
    return progs


def _simulate(progs, lag=2, stall=None):
    """Each program takes one step a tick once its counter equals its turn (program p also stalls on the ticks in
    stall[p]); an add counts `lag` ticks later. The ticks until all are done, or None on a deadlock."""
    stall = stall or {}
    sem, pending, pos, t, idle = defaultdict(int), defaultdict(list), [0] * len(progs), 0, 0
    while any(p < len(prog) for p, prog in zip(pos, progs)):
        for key in pending.pop(t, []):
            sem[key] += 1
        moved = False
        for p, prog in enumerate(progs):
            if pos[p] < len(prog) and sem[prog[pos[p]][0]] == prog[pos[p]][1] and t not in stall.get(p, ()):
                pending[t + lag].append(prog[pos[p]][0])
                pos[p] += 1
                moved = True
        idle = 0 if moved else idle + 1
        if idle > lag + 1 and not any(pending.values()):
            return None
        t += 1
    return t


def _simulate_grid(tiles, slots=132, lag=2):
    """GRID 1: `tiles` in launch order (each a list of steps); a free slot (SM) takes the next tile; a step runs
    once its counter equals its turn; an add counts `lag` ticks later. The ticks until all are done, or None on a
    deadlock."""
    sem, pending, t, idle = defaultdict(int), defaultdict(list), 0, 0
    nxt, run = 0, []  # run: [tile index, position]
    while nxt < len(tiles) or run:
        for key in pending.pop(t, []):
            sem[key] += 1
        run = [r for r in run if r[1] < len(tiles[r[0]])]
        while len(run) < slots and nxt < len(tiles):
            run.append([nxt, 0])
            nxt += 1
        moved = False
        for r in run:
            if r[1] < len(tiles[r[0]]) and sem[tiles[r[0]][r[1]][0]] == tiles[r[0]][r[1]][1]:
                pending[t + lag].append(tiles[r[0]][r[1]][0])
                r[1] += 1
                moved = True
        idle = 0 if moved else idle + 1
        if idle > lag + 1 and not any(pending.values()):
            return None
        t += 1
    return t


# (B, Hkv, GQA, Sq, Sk, causal): one and several waves of tiles on 132 programs, lengths not multiples of the
# blocks, Sq < Sk and Sq > Sk (rows that see no key), GQA 1 and 4
SCHEDULES = [(1, 16, 1, 4096, 4096, False), (2, 8, 1, 1000, 1333, False), (3, 5, 4, 700, 700, False),
             (1, 16, 1, 4096, 4096, True), (4, 8, 4, 2048, 2048, True), (4, 16, 4, 257, 390, True),
             (1, 4, 2, 1000, 600, True), (2, 4, 1, 600, 1000, True)]


@pytest.mark.parametrize("order,snake,headrot,split,spt,hgroup", [
    (0, 0, 0, 1, 0, 0), (1, 0, 0, 1, 0, 0), (2, 0, 0, 1, 0, 0), (3, 1, 0, 1, 0, 0), (0, 1, 1, 1, 0, 0),
    (0, 0, 0, 2, 0, 0), (0, 1, 0, 4, 0, 0), (0, 0, 0, 1, 1, 0), (0, 0, 0, 1, 0, 3), (0, 0, 0, 1, 1, 2)])
@pytest.mark.parametrize("shape", SCHEDULES, ids=lambda s: "B{}H{}g{}_{}x{}_{}".format(*s[:5], "c" if s[5] else "f"))
def test_each_block_gets_every_add_once_in_a_fixed_order_without_deadlock(shape, order, snake, headrot, split, spt,
                                                                          hgroup):
    """(HEADROT is for unordered adds, which wait for no turn: the turns here only show each pair visited once.)
    With DQ_SPLIT the counters are per accumulator: key (split x B + batch, head, block). SPT and HGROUP
    ([Note] Launch order) also on GRID 1's model: one tile per CTA, handed out in index order."""
    progs = _schedule(*shape, order, snake=snake, headrot=headrot, dq_split=split, spt=spt, hgroup=hgroup)
    tiles = -(-shape[4] // 128) * shape[0] * shape[1]
    assert sum(len(p) for p in progs) == sum(len(p) for p in _schedule(*shape, 0)), tiles  # every tile once
    turns = defaultdict(list)
    for prog in progs:
        for key, turn in prog:
            turns[key].append(turn)
    bad = {key: sorted(v) for key, v in turns.items() if sorted(v) != list(range(len(v)))}
    assert not bad, list(bad.items())[:3]  # the turns of a block are 0 .. (its adds - 1), each once
    assert _simulate(progs) is not None
    assert _simulate(progs, lag=3, stall={p: range(5 * p, 5 * p + 7) for p in range(0, len(progs), 7)}) is not None
    if order == 0 and split == 1:
        tiles = _schedule(*shape, 0, programs=None, spt=spt, hgroup=hgroup)
        assert _simulate_grid(tiles, slots=132) is not None
        assert _simulate_grid(tiles, slots=5, lag=3) is not None


def test_the_wave_order_spaces_the_full_masks_neighbours_apart():
    """With the full mask, v1's order makes each key block of a wave wait for the one before it at every step;
    the wave order starts them T / W steps apart. One program stalled for 30 ticks: with ORDER 0 every key block
    after it in its wave waits; with ORDER 1 the others have slack."""
    shape = (1, 16, 1, 4096, 4096, False)
    stall = {3: range(40, 70)}
    t0, t1 = (_simulate(_schedule(*shape, o), lag=2, stall=stall) for o in (0, 1))
    assert t1 < t0, (t0, t1)


def test_the_snake_balances_the_causal_tiles_over_the_programs():
    """GQA 32/8 causal B4 s4k (1024 tiles on 132 programs, key block major: a tile's steps shrink with its key
    block): in v1's order the busiest program has 12% more steps than the mean; taking odd waves in reverse
    brings it within 4% (the model: 12.5% and 3.1%)."""
    shape = (4, 8, 4, 4096, 4096, True)
    mean = sum(len(p) for p in _schedule(*shape, 0)) / 132
    busiest = [max(len(p) for p in _schedule(*shape, 0, snake=s)) / mean for s in (0, 1)]
    assert busiest[0] > 1.1 and busiest[1] < 1.04, busiest


@pytest.mark.parametrize("shape", SCHEDULES, ids=lambda s: "B{}H{}g{}_{}x{}_{}".format(*s[:5], "c" if s[5] else "f"))
@pytest.mark.parametrize("bm", [64, 128])
def test_the_postprocess_counts_each_query_blocks_adds(shape, bm):
    """[Note] FMA rounding, FIXED_FMA 2: the postprocess takes _dq_adds(m0) x 0x4B400000 out of each row, so it must
    be the number of adds the schedule makes into query block m0 of every (batch, query head), rows that see no
    key (Sq > Sk causal: 0) included."""
    b, hkv, gqa, sq, sk, causal = shape
    made = defaultdict(int)
    for prog in _schedule(*shape, 0, bm=bm):
        for key, _ in prog:
            made[key] += 1
    with _scalar_helpers(132) as k:
        for off_b in range(b):
            for h in range(hkv * gqa):
                for m0 in range(0, -(-sq // bm) * bm, bm):
                    assert made[(off_b, h, m0)] == k._dq_adds(m0, sq, sk, bm, 128, causal), (off_b, h, m0)
