"""A step-level model of the Gluon backward's schedule at GQA and d64 (ninth session, docs/hopper.md "GQA and d64 in
the Gluon backward (ninth session)"): one step a tick per program; with the chain ([Note] Fixed-order dQ) a step
runs once its (head, query block) counter equals its key block, and an add counts `lag` ticks later. Tile orders:
key block major (the product), L2 sections of (batch, KV head) pairs; steps head major or query block major; the
persistent grid (tiles round robin over 132 programs) or GRID 1 (a free SM takes the next tile in index order).

    python lab/gqa_schedule_model.py gqa     # GQA 32/8 causal B4 s4k (32 pairs x 32 key blocks, 4 heads)
    python lab/gqa_schedule_model.py d64     # d64 causal B1 H32 s16k (32 heads x 128 key blocks); a few minutes
"""
import sys
from collections import defaultdict


def tiles_of(num_bh, nk, gqa, nm, query_major=False, sections=0, causal=True):
    """Each tile's steps in order, as (counter key, turn); tiles in index order."""
    if sections:
        order = [(n, s0 + i) for s0 in range(0, num_bh, sections) for n in range(nk)
                 for i in range(min(sections, num_bh - s0))]
    else:
        order = [(n, bh) for n in range(nk) for bh in range(num_bh)]
    tiles = []
    for n, bh in order:
        ms = range(2 * n if causal else 0, nm)  # 128 keys, 64-query blocks: key block n sees blocks 2n ..
        pairs = [(g, m) for m in ms for g in range(gqa)] if query_major else [(g, m) for g in range(gqa) for m in ms]
        tiles.append([((bh, g, m), n) for g, m in pairs])
    return tiles


def simulate(tiles, slots=132, lag=3, grid=False, chain=True):
    """Ticks until every step is done."""
    sem, pending, t = defaultdict(int), defaultdict(list), 0
    if grid:
        run, nxt = [], 0
    else:
        progs = [tiles[p::slots] for p in range(slots)]
        cur = [[0, 0] for _ in range(slots)]
    while True:
        for key in pending.pop(t, []):
            sem[key] += 1
        if grid:
            run = [r for r in run if r[1] < len(r[0])]
            while len(run) < slots and nxt < len(tiles):
                run.append([tiles[nxt], 0])
                nxt += 1
            if not run:
                return t
            for r in run:
                key, turn = r[0][r[1]]
                if not chain or sem[key] == turn:
                    pending[t + lag].append(key)
                    r[1] += 1
        else:
            done = True
            for p in range(slots):
                ti, pos = cur[p]
                if ti >= len(progs[p]):
                    continue
                done = False
                key, turn = progs[p][ti][pos]
                if not chain or sem[key] == turn:
                    pending[t + lag].append(key)
                    cur[p] = [ti + 1, 0] if pos + 1 >= len(progs[p][ti]) else [ti, pos + 1]
            if done:
                return t
        t += 1


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "gqa"
    num_bh, nk, gqa, nm = (32, 32, 4, 64) if which == "gqa" else (32, 128, 1, 256)
    print(which, "ideal", sum(map(len, tiles_of(num_bh, nk, gqa, nm))) / 132)
    for qm in ((False, True) if gqa > 1 else (False, )):
        for sec in (0, 8):
            for grid in (False, True):
                for chain in (True, False):
                    ticks = simulate(tiles_of(num_bh, nk, gqa, nm, qm, sec), grid=grid, chain=chain)
                    print(f"query_major={qm} sections={sec} grid1={grid} chain={chain}: {ticks}", flush=True)
    if gqa > 1:
        for split in (2, 4):  # bwd_gqa_split: split x the pairs, gqa / split heads each
            for grid in (False, True):
                for chain in (True, False):
                    ticks = simulate(tiles_of(num_bh * split, nk, gqa // split, nm), grid=grid, chain=chain)
                    print(f"split={split} grid1={grid} chain={chain}: {ticks}", flush=True)
