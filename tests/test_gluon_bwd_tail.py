"""The d128 full backward's split tail (variant bwd_full_levers' bwd_tail P, twentieth session; [Note] Split tail in
fagen/templates/gluon/backward.py.j2, docs/hopper.md "The d128 full backward's last wave (twentieth session)"):
renders only where on (a plain full render's unordered kernel), the host's plan against a lock-step simulation, the
sum kernel bitwise against a torch sum in piece order (interpreter; its mutant red), and the sm_90 builds: the whole
tiles' kernel (TAIL 1) is the product's build (same registers, spills and step loops), the pieces' (TAIL P) builds.
On an H200: scripts/gpu_bwdfull_s20.py."""

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


_BUILD = textwrap.dedent("""
    import sys, json
    sys.path.insert(0, {tests!r})
    from test_gluon_bwd_tail import _module
    from sm90 import ptxas
    m = _module(3)
    out = {{}}
    for tail in (0, 1, 3):
        for det in (True, False):
            ck = m.compile_backward_for(deterministic=det, tail=tail)
            res = next(iter(ptxas(ck.asm["ptx"])[0].values()))
            ptx = ck.asm["ptx"]
            out[f"{{tail}} {{det}}"] = [res.registers, res.spill_stores, res.spill_loads, ck.metadata.shared,
                                        ptx.count("griddepcontrol.launch_dependents"),
                                        ptx.count("griddepcontrol.wait")]
    print("BUILD " + json.dumps(out))
""")


@pytest.mark.skipif(ON_GPU, reason="faked sm_90 build (CPU)")
def test_sm90_builds_whole_tiles_as_the_product(tmp_path):
    """TAIL 1 (the whole tiles, launch_dependents) has TAIL 0's (the product's) registers, spill bytes and shared
    memory; TAIL 3 (the pieces) builds, with griddepcontrol.wait, in the same shared memory."""
    import json
    env = dict(os.environ, PYTHONPATH=ROOT, TRITON_CACHE_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", _BUILD.format(tests=os.path.join(ROOT, "tests"))], env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.split("BUILD ", 1)[1])
    for det in (True, False):
        plain, whole, piece = got[f"0 {det}"], got[f"1 {det}"], got[f"3 {det}"]
        assert whole[:4] == plain[:4] and plain[4:] == [0, 0] and whole[4:] == [1, 0]
        assert piece[3] == plain[3] and piece[4:] == [0, 1]
