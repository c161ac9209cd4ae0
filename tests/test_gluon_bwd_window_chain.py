"""The window's deterministic backward as the fixed-order chain walking down ([Note] Window chain in
fagen/templates/gluon/backward.py.j2; variant bwd_window_chain, seventeenth session): the render (mode 0 on the
unordered kernel's levers, descending steps; 2: the first adder's store), the turns of the render's own _bwd_tile and
_bwd_first run as plain Python on ints against a model of the descending walk, the host's first-store condition
(_bwd_win_visited) against brute force, and the fast path's fill (the counters only where the store covers every
query block) with the kernels faked. The kernels run in scripts/gpu_window_s17.py (H100)."""

import types

import pytest
import torch
import triton

import fagen
from _env import ON_GPU
from fagen import backends
from fagen.codegen import render
from fagen.runtime.loader import load_source
from test_gluon_bwd_host import MAIN_META, _bwd_args, _JIT
from test_gluon_bwd_window_host import _Bound
from test_hostpath import _Fill

WINDOW_SPEC = dict(backend="gluon", direction="bwd", head_dim=128, mask="causal", dtype="bf16", window=True)
CHAIN = {"bwd_window_desc": 1, "bwd_window_chain": 1}
STORE = {"bwd_window_desc": 1, "bwd_window_chain": 2}


def _source(window=None, **over):
    """The window render with variant bwd_window = `window` (None: the product's) and top-level keys `over`."""
    saved = dict(backends.GLUON.variant)
    backends.GLUON.variant.update(over, **({} if window is None else {"bwd_window": window}))
    render.render.cache_clear()
    try:
        return fagen.generate(fagen.KernelSpec(**WINDOW_SPEC))
    finally:
        backends.GLUON.variant.clear()
        backends.GLUON.variant.update(saved)
        render.render.cache_clear()


def _module(window, name):
    return load_source(_source(window), f"{fagen.KernelSpec(**WINDOW_SPEC).name}_chain_test_{name}")


def _writer(src, sfx=""):
    return src.split(f"def _bwd_dq_writer{sfx}(")[1].split("\n@gluon.jit")[0]


def test_the_chain_renders_mode_0_on_the_unordered_levers_and_the_product_is_unchanged():
    prod, chain, store = _source(), _source(CHAIN), _source(STORE)
    for src in (chain, store):
        assert "BWD_DET_MODE = 0" in src and "GQA * steps - 1 - i" in src
        # the deterministic kernel has the unordered one's levers: named barriers, dK/dV by TMA, snake
        assert "_named_bar(j, \"sync\", _BAR_DQ_FULL + w, 160)" in _writer(src)
        assert "_BWD_KERNELS = {0: (_attn_bwd_hopper, 1), 1: (_attn_bwd_hopper_u, 1)}" in src
        assert "tile = _bwd_snake(tile0, num_tiles)" in _writer(src)
        assert "_bwd_publish(prev, m0, 2)" in _writer(src)
    assert "BWD_WIN_CHAIN = 1" in chain and "if first:" not in chain
    assert "BWD_WIN_CHAIN = 2" in store and "if first:" in _writer(store) and "if first:" in _writer(store, "_u")
    assert "first = turn == 0" in _writer(store)
    # the product since the eighteenth session's flip: the store chain, pending 0, the turn spun in one asm loop, the
    # conversion as the main kernel's programmatic dependent (tests/test_gluon_bwd_window_pdl.py)
    assert "BWD_DET_MODE = 0" in prod and "BWD_WIN_CHAIN = 2" in prod and "if first:" in _writer(prod)
    assert "_bwd_publish(sem, m0, 0)" in _writer(prod) and "_bwd_spin(sem, turn)" in prod
    assert "BWD_WIN_PDL = 1" in prod
    # the fixed-point render it replaced: mode 2, no store, no chain levers in its (unused) mode-0 kernel
    fixed = _source({"bwd_window_fixed": 1, "bwd_fixed_tma": 1})
    assert "BWD_DET_MODE = 2" in fixed and "BWD_WIN_CHAIN = 0" in fixed and "if first:" not in fixed
    assert "_named_bar(" not in _writer(fixed)
    # with the fixed-point dQ on, the chain key renders nothing
    assert _source({"bwd_window_fixed": 1, "bwd_fixed_tma": 1, "bwd_window_chain": 2}) == fixed
    # bwd_window_pending 0: the step's own adds published once complete, no drain
    p0 = _writer(_source({**STORE, "bwd_window_pending": 0}))
    assert "_bwd_publish(sem, m0, 0)" in p0 and "_bwd_publish(prev" not in p0
    # bwd_window_relaxed 1: the turn polled by relaxed loads (no acquire: no L1 invalidation a poll)
    relax = _writer(_source({**STORE, "bwd_window_pending": 0, "bwd_window_relaxed": 1}))
    assert 'sem="relaxed"' in relax and 'sem="acquire"' not in relax
    assert 'sem="acquire"' in p0 and 'sem="relaxed"' not in p0
    assert 'sem="relaxed"' not in _source({"bwd_window_fixed": 1, "bwd_fixed_tma": 1, "bwd_window_relaxed": 1})
    # bwd_window_relaxed 2: the relaxed polls in one inline asm loop (a `while` in the dQ warp cost warpgroup 1's
    # step loop 13 spill reloads: sm_90 SASS)
    spin = _source({**STORE, "bwd_window_pending": 0, "bwd_window_relaxed": 2})
    assert "_bwd_spin(sem, turn)" in _writer(spin) and "while seen != turn" not in _writer(spin)
    assert "ld.relaxed.gpu.global.b32" in spin and "def _bwd_spin" not in relax and "def _bwd_spin" not in p0


@pytest.fixture(scope="module")
def walk():
    mod = _module(STORE, "walk")
    mod.gl = types.SimpleNamespace(maximum=max, minimum=min, where=lambda c, a, b: a if c else b)
    return types.SimpleNamespace(tile=mod._bwd_tile.fn, first=mod._bwd_first.fn, bm=mod.BWD_BLOCK_M,
                                 bn=mod.BWD_BLOCK_N, visited=mod._bwd_win_visited)


# (Sq, Sk, left, right): lengths off the blocks, Sq < Sk, Sq > Sk (rows that see nothing), windows under and over
# a key block, right > 0 (cut to 0 by the causal mask)
CASES = [(333, 333, 37, 0), (1000, 1000, 130, 0), (1000, 1000, 1024, 0), (700, 1000, 37, 0), (1000, 700, 130, 0),
         (129, 129, 0, 0), (640, 640, 300, 5), (2000, 2000, 1024, 0), (65, 300, 1, 0), (1000, 1000, 129, 0)]


def _visits(walk, sq, sk, left, right):
    """{query block m0: [key blocks visiting it, in tile order]}, {n: (lo, hi)}."""
    bm, bn = walk.bm, walk.bn
    visits, ranges = {}, {}
    for n in range(-(-sk // bn)):
        n_blk, _, _, _, lo, split, hi, top = walk.tile(n, 1, 1, sq, sk, left, right, bm, bn, 1, True)
        ranges[n] = (lo, hi)
        for m0 in range(lo, hi, bm):
            visits.setdefault(m0, []).append(n)
    return visits, ranges


@pytest.mark.parametrize("case", CASES, ids=str)
def test_the_turns_count_from_the_first_visitor_and_descending_arrives_in_turn(walk, case):
    """Each query block's visitors are consecutive key blocks from _bwd_first's, so the turns n - first are 0, 1, ..
    in key-block order; walking down (step i of tile n at query block hi_n - (i + 1) BLOCK_M), tiles started
    together, key block n reaches a block it shares with n - 1 BLOCK_N / BLOCK_M steps after it wherever n's walk
    is not cut at the last query block (the chain's order is the order of arrival: no turn waits)."""
    sq, sk, left, right = case
    bm, bn = walk.bm, walk.bn
    visits, ranges = _visits(walk, sq, sk, left, right)
    sq_pad = -(-sq // bm) * bm
    for m0, ns in visits.items():
        first = walk.first(m0, sq, sk, left, bn)
        assert ns == list(range(first, first + len(ns))), (m0, first, ns)
        turns = [n - first for n in ns]
        assert turns == list(range(len(ns)))
    for n in range(1, len(ranges)):
        (lo0, hi0), (lo1, hi1) = ranges[n - 1], ranges[n]
        for m0 in set(range(lo0, hi0, bm)) & set(range(lo1, hi1, bm)):
            t0, t1 = (hi0 - m0) // bm - 1, (hi1 - m0) // bm - 1
            assert t1 >= t0, (n, m0)  # never before n - 1
            if hi1 < sq_pad:
                assert t1 - t0 == bn // bm, (n, m0, t0, t1)


def _sees_a_key(sq, sk, left, right):
    return all(any(i + sk - sq - left <= j <= i + sk - sq + min(right, 0) for j in range(sk)) for i in range(sq))


@pytest.mark.parametrize("case", CASES + [(300, 100, 37, 0), (100, 300, 0, 0), (64, 64, 0, -1), (200, 64, 500, 0)],
                         ids=str)
def test_the_first_store_covers_every_query_block_where_the_host_skips_the_fill(walk, case):
    """_bwd_win_visited is brute force's "every row sees a key"; where it holds, every query block of the padded
    accumulator has a turn-0 adder (_bwd_first's key block) that visits it, so its store replaces the fill."""
    sq, sk, left, right = case
    ok = walk.visited(sq, sk, left, right)
    assert ok == _sees_a_key(sq, sk, left, right), case
    if ok:
        visits, ranges = _visits(walk, sq, sk, left, right)
        for m0 in range(0, -(-sq // walk.bm) * walk.bm, walk.bm):
            first = walk.first(m0, sq, sk, left, walk.bn)
            lo, hi = ranges.get(first, (0, 0))
            assert lo <= m0 < hi, (m0, first)


@pytest.fixture
def store_fast(monkeypatch):
    """(module, fakes) of the store render with fast launches and its kernels faked (test_gluon_bwd_window_fast's
    fixture, modes 0 and 1)."""
    mod = _module(STORE, "fast")
    extra = (37, 0, 0.0)
    real, epi_tma = mod._BWD_KERNELS[0]
    fakes = {"pre": _JIT(mod._bwd_preprocess, (7, 12)), "conv": _JIT(mod._dq_convert, (5, 8)),
             "main": _JIT(real, 18 + len(extra), MAIN_META + ([dict(MAIN_META[0])] * 2 if epi_tma else [])),
             "extra": extra}
    main = mod._gluon(fakes["main"])
    for name, value in (("_FAST_LAUNCH", True), ("_KERNELS", {}), ("_BWD_WS", type(mod._BWD_WS)()),
                        ("_GLUON_FAST", True), ("_raw_stream", lambda device: 77),
                        ("_bwd_preprocess", fakes["pre"]), ("_dq_convert", fakes["conv"]),
                        ("_BWD_KERNELS", {0: (fakes["main"], epi_tma), 1: (fakes["main"], epi_tma)}),
                        ("_fast_bwd_preprocess", mod._gluon(fakes["pre"])),
                        ("_fast_dq_convert", mod._gluon(fakes["conv"])),
                        ("_fast_bwd_kernels", {0: (main, epi_tma), 1: (main, epi_tma)}),
                        ("_fast_kv_bound", _Bound(mod, fakes))):
        monkeypatch.setattr(mod, name, value)
    monkeypatch.setitem(mod._NUM_SMS, -1, 132)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: -1)
    monkeypatch.setattr(triton.runtime.driver, "_active", _Fill())
    return mod, fakes


@pytest.mark.skipif(ON_GPU, reason="host fakes")
@pytest.mark.parametrize("sq,sk,mode,filled", [(300, 333, 0, False), (333, 300, 0, True), (300, 333, 1, True)])
def test_the_fast_path_fills_the_counters_only_where_the_store_covers_the_accumulator(store_fast, sq, sk, mode,
                                                                                       filled):
    """Mode 0 of the store render where every row sees a key: the counters zeroed, the accumulator left as it was
    (the first adders' stores overwrite it); rows that see nothing (Sq > Sk, causal) or mode 1: both zeroed."""
    mod, fakes = store_fast
    args, grads = _bwd_args(sq=sq, sk=sk, b=2, h=2)
    for call in range(2):  # the second call on kept views, its accumulator and counters dirty from the first
        mod._run_backward_fast(*args, *grads, mode, None, fakes["extra"])
        launch = fakes["main"].compiles[0][1]  # the views are kept: the first launch's tensors are the second's
        acc, sem = launch[6].base, launch[9]
        assert len(fakes["main"].compiles) == 1 and launch[-len(fakes["extra"]):] == fakes["extra"]
        assert sem.dtype == torch.int32 and torch.count_nonzero(sem) == 0
        if call:
            assert (torch.count_nonzero(acc) == 0) == filled, filled
        acc.fill_(3.0)
        sem.fill_(5)


@pytest.mark.skipif(ON_GPU, reason="host fakes")
@pytest.mark.parametrize("window", [CHAIN, STORE], ids=["chain", "store"])
def test_the_chain_s_modes_take_the_fast_path(monkeypatch, window):
    """_bwd_host sends a chain render's calls (modes 0 and 1, the window's values) down the fast path, as the
    product's fixed-point window (not the plain path's per-call descriptors and torch.zeros)."""
    mod = _module(window, "host")
    assert mod.BWD_FIXED_TMA == 0 and mod.BWD_WIN_CHAIN == window["bwd_window_chain"]
    taken = []
    monkeypatch.setattr(mod, "_run_backward", lambda *a, **k: taken.append(("plain", a[10])))
    monkeypatch.setattr(mod, "_run_backward_fast", lambda *a, **k: taken.append(("fast", a[10], a[11:])))
    args, grads = _bwd_args()
    extra = (37, 0, 0.0)
    for mode in (0, 1):
        mod._bwd_host(*args, *grads, mode, None, extra)
    assert taken == [("fast", 0, (None, extra)), ("fast", 1, (None, extra))]


SPIN = {"bwd_window_desc": 1, "bwd_window_chain": 2, "bwd_window_pending": 0, "bwd_window_relaxed": 2}


@pytest.mark.skipif(ON_GPU, reason="sm_90 faked on CPU tensors")
@pytest.mark.parametrize("window,mode,chain", [(None, 0, 2), ({"bwd_window_fixed": 1, "bwd_fixed_tma": 1}, 2, 0),
                                               (SPIN, 0, 2)], ids=["product", "fixed", "spin"])
def test_the_mods_suite_s_row_resolves_the_render_of_variant_bwd_window(monkeypatch, window, mode, chain):
    """The mods suite's sliding-window row (fagen.attention with attention-gym's mask_mod and fagen's block mask,
    with gradients; eighteenth session, issue 26): lowered to the window switch, it resolves the Gluon bwd module of
    the render that variant bwd_window names, the product's (the pdl chain since the flip), the fixed-point render's
    or the spin chain's (the module's device check then refuses
    the CPU tensors: nothing runs). The resolved module is memoised per spec (resolve._module), not per variant: a
    script that sets the variant in-process clears it, as scripts/gpu_window_s18.py's use() does."""
    from fagen.bench import gym_mods
    from fagen.runtime import api, hopper, modded, resolve

    monkeypatch.setattr(hopper, "is_hopper", lambda device: True)
    monkeypatch.setattr(hopper, "gluon_missing", lambda: None)
    monkeypatch.delenv(hopper.ENV, raising=False)
    monkeypatch.setattr(resolve, "_FAST", {})
    monkeypatch.setattr(api, "_FAST", resolve._FAST)
    monkeypatch.setattr(hopper, "BWD_WINDOW_MIN_WORK", 100)
    if window is not None:
        monkeypatch.setitem(backends.GLUON.variant, "bwd_window", window)
    resolve._module.cache_clear()
    try:
        s = 256
        q, k, v = (torch.randn(1, 2, s, 128, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        mm = gym_mods.generate_sliding_window(64)
        bm = fagen.create_block_mask(mm, None, None, s, s, device="cpu")
        with pytest.raises(ValueError, match="Gluon kernel"):
            fagen.attention(q, k, v, mask_mod=mm, block_mask=bm)
        assert modded.LOWERED[0] == "causal+window(64,0)"
        (mod, ) = [m for m in resolve._FAST.values() if hasattr(m, "BWD_WIN_CHAIN")]
        assert mod.NAME.endswith("_win_bf16_gluon")
        assert (mod.BWD_DET_MODE, mod.BWD_WIN_CHAIN) == (mode, chain)
    finally:
        resolve._module.cache_clear()
