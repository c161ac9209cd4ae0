"""The d128 full backward's split tail (variant bwd_full_levers' bwd_tail P, twentieth session; [Note] Split tail in
fagen/templates/gluon/backward.py.j2, docs/hopper.md "The d128 full backward's last wave (twentieth session)"):
renders only where on (a plain full render's unordered kernel), the host's plan against a lock-step simulation, the
sum kernel bitwise against a torch sum in piece order (interpreter; its mutant red), and the sm_90 builds: the whole
tiles' kernel (TAIL 1) is the product's build (same registers, spills and step loops), the pieces' (TAIL P) builds.
On an H200: scripts/gpu_bwdfull_s21.py."""

import functools
import heapq
import os
import subprocess
import sys
import textwrap

import pytest

import fagen
from fagen import backends
from fagen.codegen import render

from _env import ON_GPU

D128 = {"bwd_fixed": 1, "bwd_fixed_tma": 1, "bwd_sections": 4}
LEVERS = {"bwd_named": 2, "bwd_epi_tma": 1}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _source(tail=None, mask="none", levers=None, **fields):
    """The d128 bf16 backward render with bwd_full_levers = the default's (+ bwd_tail `tail`)."""
    from fagen.spec.kernel import KernelSpec
    levers = dict(LEVERS if levers is None else levers, **({} if tail is None else {"bwd_tail": tail}))
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


def _kernels(src):
    return src[src.index("def _bwd_producer("):src.index("\n_BWD_KERNELS = ")]


def test_renders_only_where_on():
    off, on = _source(), _source(3)
    assert "\nBWD_TAIL = 0" in off and "TAIL" not in _kernels(off) and "def _bwd_tail_sum(" not in off
    assert "\nBWD_TAIL = 3" in on and "def _bwd_tail_sum(" in on and "def _bwd_tail_plan(" in on
    u = on[on.index("def _bwd_producer_u("):on.index("\n_BWD_KERNELS = ")]
    plain = on[on.index("def _bwd_producer("):on.index("def _bwd_producer_u(")]
    assert u.count("TAIL: gl.constexpr = 0") == 4 and "TAIL" not in plain  # the unordered kernel only
    assert "_bwd_launch_dependents(num_tiles)" in u and "_bwd_grid_wait(num_tiles)" in u
    # the product's kernels, the host aside: the lever's render differs from the default only where TAIL is read
    assert _source(0) == off
    for spec in (dict(mask="causal"), dict(softcap=True)):  # causal and switched renders do not read the key
        assert _source(3, **spec) == _source(None, **spec)
    assert "\nBWD_TAIL = 0" in _source(3, levers={**LEVERS, "bwd_persist": 1})  # not on the persistent grid


@functools.lru_cache(maxsize=None)
def _module(tail):
    from fagen.runtime.loader import load_source
    return load_source(_source(tail), f"bwd_tail_test_{tail}")


def _lockstep(num_tiles, sms, pieces, split):
    """Makespan in piece units of a list schedule: the whole tiles, then the pieces, each to the SM that
    frees first (ties: any)."""
    free = [0] * sms
    for cost in [pieces] * (num_tiles - split) + [1] * (split * pieces):
        heapq.heapreplace(free, free[0] + cost)
    return max(free)


@pytest.mark.parametrize("num_tiles,sms,pieces", [(2048, 132, 3), (2048, 132, 5), (2048, 132, 16), (48, 5, 3),
                                                  (24, 7, 3), (18, 7, 4), (15, 9, 3), (4, 3, 3), (264, 132, 3)])
def test_plan_is_the_fewest_tiles_at_the_shortest_lockstep_makespan(num_tiles, sms, pieces):
    """Among splits of up to 4 waves of tiles (seen red with ties going to the larger split)."""
    plan = _module(3)._bwd_tail_plan
    split = plan(num_tiles, sms, pieces)
    spans = {s: _lockstep(num_tiles, sms, pieces, s) for s in range(0, min(num_tiles, 3 * sms + sms - 1) + 1)}
    best = min(spans.values())
    if spans[0] == best:
        assert split == 0
    else:
        assert spans[split] == best and split == min(s for s in spans if spans[s] == best)
    if (num_tiles, sms) == (2048, 132):
        assert split == 68  # the last wave's tiles: 15 + 2 / 3, 15 + 3 / 5, 15 + 9 / 16 tile times against 16
    assert plan(num_tiles, sms, pieces, blocks=pieces - 1) == 0  # tiles of fewer query blocks than pieces


def _piece_bounds(src):
    """The kernel's piece bounds (the `if TAIL >= 2:` block after _bwd_tile in every partition, all alike) as a
    Python function (nb, P, piece) -> (lo, hi) in query blocks, gl.minimum as min."""
    blocks = set()
    for part in src.split("        if TAIL >= 2:  # the piece's query blocks")[1:]:
        lines = part.split("\n")[1:]
        blocks.add("\n".join(lines[:next(i for i, x in enumerate(lines) if not x.startswith(" " * 12))]))
    assert len(blocks) == 1, blocks
    code = compile(textwrap.dedent(blocks.pop()), "piece bounds", "exec")

    def bounds(nb, tail, item):
        env = dict(gl=type("gl", (), {"minimum": staticmethod(min)}), hi=nb, lo=0, BLOCK_M=1, TAIL=tail, item=item)
        exec(code, env)
        return env["lo"], env["hi"]
    return bounds


def test_pieces_partition_the_tile_where_the_plan_splits():
    """Where the plan splits tiles of nb query blocks into P pieces, the kernel's bounds (its text, run in Python)
    give P non-empty pieces covering [0, nb) in order; and the plan splits wherever they would (nb >= P, no empty
    piece). Seen red with the plan's s20 guard (blocks < pieces: P 5 at 16 blocks leaves piece 4 empty)."""
    m, bounds = _module(3), _piece_bounds(_source(3))
    for tail in (2, 3, 4, 5, 8, 16):
        for nb in range(1, 300):
            cuts = [bounds(nb, tail, p) for p in range(tail)]
            whole = all(lo < hi for lo, hi in cuts) and cuts[0][0] == 0 and cuts[-1][1] == nb and all(
                a[1] == b[0] for a, b in zip(cuts, cuts[1:]))
            gain = bool(m._bwd_tail_plan(2048, 132, tail))  # P 2 gains nothing there
            assert bool(m._bwd_tail_plan(2048, 132, tail, nb)) == (whole and gain), (tail, nb, cuts)
    assert bounds(256, 5, 4) == (208, 256) and bounds(256, 3, 1) == (86, 172)  # the real shape's (s16k) pieces


_SUM = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {tests!r})
    from test_gluon_bwd_tail import _source
    from fagen.runtime.loader import load_source
    src = _source(3)
    if {mutant}:
        src = src.replace("for p in tl.static_range(1, P):", "for p in tl.static_range(2, P):")
    m = load_source(src, "bwd_tail_sum_{mutant}")
    ok = True
    for P, split, b, h, sk in ((3, 5, 2, 3, 300), (5, 4, 1, 4, 333), (3, 1, 1, 1, 1)):
        nblk = -(-sk // 128)
        num_bh, tail0 = b * h, nblk * b * h - split
        part = torch.randn(split * P * 2 * 128 * 128, generator=torch.Generator().manual_seed(P))
        dk, dv = torch.full((b, h, sk, 128), 7.0), torch.full((b, h, sk, 128), 7.0)
        m._bwd_tail_sum[(split, 4)](part, dk, dv, tail0, num_bh, sk, P=P, SECTIONS=4, HEAD_DIM=128, BLOCK_N=128,
                                    ROWS=32)
        pr = part.view(split, P, 2, 128, 128)
        want = pr[:, 0]
        for p in range(1, P):
            want = want + pr[:, p]
        seen = torch.zeros(num_bh, sk, dtype=torch.bool)
        for t in range(split):  # _bwd_tile's L2 sections of 4 heads
            tile = tail0 + t
            span = 4 * nblk
            sec = tile // span
            hs = min(num_bh - sec * 4, 4)
            n, bh = (tile - sec * span) // hs, sec * 4 + (tile - sec * span) % hs
            rows = min(128, sk - n * 128)
            ok &= torch.equal(dk.view(num_bh, sk, 128)[bh, n * 128:n * 128 + rows], want[t, 0, :rows])
            ok &= torch.equal(dv.view(num_bh, sk, 128)[bh, n * 128:n * 128 + rows], want[t, 1, :rows])
            seen[bh, n * 128:n * 128 + rows] = True
        ok &= bool((dk.view(num_bh, sk, 128)[~seen] == 7).all())  # nothing else written
    print("SUM", ok)
""")


@pytest.mark.skipif(ON_GPU, reason="the interpreter's run (CPU)")
@pytest.mark.parametrize("mutant", [False, True])
def test_sum_is_bitwise_the_piece_order_sum_and_its_mutant_fails(mutant, tmp_path):
    """The sum kernel in the interpreter: float32 outputs (no rounding) bitwise equal to ((p0 + p1) + p2) ..., at
    the rows of _bwd_tile's tile (L2 sections of 4 heads, a last section of 2) and nowhere else; the mutant (piece 1
    left out) gives False. Seen red: ROWS' offset dropped from `rows` (the tests' False on the first shape)."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT, TRITON_CACHE_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", _SUM.format(tests=os.path.join(ROOT, "tests"), mutant=mutant)],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"SUM {not mutant}" in r.stdout, r.stdout + r.stderr[-2000:]


_BUILD = textwrap.dedent(r"""
    import sys, json, re
    sys.path.insert(0, {tests!r})
    from test_gluon_bwd_tail import _module
    from sm90 import ptxas
    def reloads(dump):  # LDL in the SASS step loops: the innermost loops holding HGMMA
        ins = [(int(a, 16), x.strip()) for a, x in re.findall(r"/\*([0-9a-f]{{4,}})\*/\s+([^;]*);", dump)]
        at = {{a: i for i, (a, _) in enumerate(ins)}}
        spans = []
        for j, (_, x) in enumerate(ins):
            b = re.search(r"\bBRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", x)
            if b and int(b.group(1), 16) in at and at[int(b.group(1), 16)] < j:
                spans.append((at[int(b.group(1), 16)], j))
        has = lambda r: any("HGMMA" in y for _, y in ins[r[0]:r[1] + 1])
        inner = [r for r in spans if has(r) and not any(o != r and r[0] <= o[0] and o[1] <= r[1] and has(o)
                                                        for o in spans)]
        return [sum("LDL" in y for _, y in ins[r[0]:r[1] + 1]) for r in inner]
    out = {{}}
    for tail in (0, 1, 3, 5):
        m = _module(5 if tail == 5 else 3)
        for det in (True, False):
            ck = m.compile_backward_for(deterministic=det, tail=tail)
            res, _, dump = ptxas(ck.asm["ptx"], sass=True)
            res = next(iter(res.values()))
            ptx = ck.asm["ptx"]
            out[f"{{tail}} {{det}}"] = [res.registers, res.spill_stores, res.spill_loads, ck.metadata.shared,
                                        ptx.count("griddepcontrol.launch_dependents"),
                                        ptx.count("griddepcontrol.wait"), reloads(dump)]
    print("BUILD " + json.dumps(out))
""")


@pytest.mark.skipif(ON_GPU, reason="faked sm_90 build (CPU)")
def test_sm90_builds_whole_tiles_as_the_product(tmp_path):
    """TAIL 1 (the whole tiles, launch_dependents) has TAIL 0's (the product's) registers, spill bytes, shared
    memory and step-loop reloads; TAIL 3 and 5 (the pieces) build, with griddepcontrol.wait, in the same shared
    memory, their step loops reloading no more than the product's (twenty-first session's piece bounds; seen red
    with the s20 bounds, 4-5 reloads a step more, and with `item % TAIL` for the piece, 3 more at P 3)."""
    import json
    env = dict(os.environ, PYTHONPATH=ROOT, TRITON_CACHE_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", _BUILD.format(tests=os.path.join(ROOT, "tests"))], env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.split("BUILD ", 1)[1])
    for det in (True, False):
        plain, whole, piece, five = got[f"0 {det}"], got[f"1 {det}"], got[f"3 {det}"], got[f"5 {det}"]
        assert whole[:4] == plain[:4] and whole[6] == plain[6] and plain[4:6] == [0, 0] and whole[4:6] == [1, 0]
        for p in (piece, five):  # the pieces' step loops reload no more than the product's
            assert p[3] == plain[3] and p[4:6] == [0, 1] and len(p[6]) == len(plain[6])
            assert plain[6] and all(a <= b for a, b in zip(p[6], plain[6])), (p[6], plain[6])
