"""The prefix-LM mask in one Gluon backward ([Note] Prefix rows in the backward in
fagen/templates/gluon/backward.py.j2, variant bwd_prefix; [Note] Prefix rows in one backward in fagen/mods/split.py):
the render's own _bwd_tile, run as plain Python on ints, visits every (query block, key block) that holds a visible
pair (row i sees key j iff j <= i or j < P), runs unmasked only steps whose pairs are all visible, and the key blocks
that add to a query block are a prefix of them (so the fixed-order dQ's turn is the key block); the render threads
`prefix` through every partition and the host, and the default render is unchanged. The kernels themselves run in
scripts/gpu_modsmask_s10.py (H100)."""

import types

import torch

import pytest

import fagen
from fagen import backends
from fagen.codegen import render
from fagen.runtime.loader import load_source
from fagen.spec.kernel import KernelSpec

SPEC = dict(backend="gluon", direction="bwd", head_dim=128, mask="causal", dtype="bf16")


def _source(spec=None, tma=False, **lever):
    """The render with variant keys set; bwd_d128 {} (the chain's render) unless tma (the d128 default, qmul rows by
    TMA, whose prefix needs bwd_prefix_tma)."""
    saved = dict(backends.GLUON.variant)
    backends.GLUON.variant.update({**({} if tma else {"bwd_d128": {}}), **lever})
    render.render.cache_clear()
    try:
        return fagen.generate(KernelSpec(**{**SPEC, **(spec or {})}))
    finally:
        backends.GLUON.variant.clear()
        backends.GLUON.variant.update(saved)
        render.render.cache_clear()


@pytest.fixture(scope="module", params=["chain", "tma"])
def tile(request):
    """_bwd_tile of the chain's prefix render and of the d128 default's with bwd_prefix_tma (eleventh session)."""
    tma = request.param == "tma"
    src = _source(tma=tma, bwd_prefix=1, **({"bwd_prefix_tma": 1} if tma else {}))
    mod = load_source(src, "gluon_bwd_prefix_test_" + request.param)
    assert mod.BWD_PREFIX == 1 and mod.BWD_FIXED_TMA == int(tma)
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


def test_the_render_threads_prefix_and_without_it_the_render_has_none():
    src, base = _source(bwd_prefix=1), _source(bwd_prefix=0)
    assert "prefix" not in base.split("def _bwd_tile(")[1].split("\n")[0]
    assert "BWD_PREFIX = 0" in base and "(keys[:, None] < prefix)" not in base
    assert src.count("(keys[:, None] < prefix)") == 2  # both compute partitions (deterministic, unordered)
    assert src.count('"sq_pad", "prefix"]') == 2  # both main kernels: not specialized on P
    assert "None, (0, ))" in src  # the public backward passes P = 0 (the plain causal mask)
    two = _source(bwd_prefix=2)  # the fixed-point dQ beside the chain, for the prefix call only
    assert "BWD_PREFIX_MODE = 2" in two and "BWD_DET_MODE = 0" in two and "_BWD_KERNELS[2] = " in two
    assert "BWD_PREFIX_MODE = BWD_DET_MODE" in src
    assert "BWD_PREFIX_MODE = 2" in _source()  # the default: bwd_prefix 2
    other = _source(bwd_prefix=1, bwd_spt=1)  # a lever that sets the turns: no prefix
    assert "BWD_PREFIX = 0" in other
    for spec in (dict(gqa=2), dict(head_dim=64), dict(mask="none"), dict(window=True)):  # these keep two calls
        assert "BWD_PREFIX = 0" in _source(spec, bwd_prefix=1), spec


def test_the_d128_default_carries_the_prefix_with_bwd_prefix_tma():
    """The d128 default (qmul rows by TMA): without bwd_prefix_tma no prefix (the split's two calls), with it the
    prefix in both kernels and the prefix call in mode 2, which is its deterministic mode too (eleventh session)."""
    off, on = _source(tma=True, bwd_prefix_tma=0), _source(tma=True, bwd_prefix_tma=1)
    assert "BWD_FIXED_TMA = 1" in off and "BWD_PREFIX = 0" in off and "(keys[:, None] < prefix)" not in off
    assert "BWD_FIXED_TMA = 1" in on and "BWD_PREFIX = 1" in on and on.count("(keys[:, None] < prefix)") == 2
    assert "BWD_DET_MODE = 2" in on and "BWD_PREFIX_MODE = 2" in on and "None, (0, ))" in on
    assert "if DQ_MODE == 2:  # the rows' qmul too" in on  # the producer's TMA rows stay


_BUILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from fagen.runtime.loader import load_source
out = {}
for key, path in json.loads(sys.argv[2]).items():
    mod = load_source(open(path).read(), "gluon_bwd_prefix_build_" + key)
    assert mod.BWD_PREFIX == 1
    out[key] = [mod.compile_backward_for(deterministic=det).metadata.shared for det in (True, False)]
print("RESULT " + json.dumps(out))
"""


def test_the_prefix_render_builds_for_sm_90(tmp_path_factory):
    """Both prefix renders build for sm_90 within shared memory, in a fresh process (build_sm90: an interpreted
    kernel earlier in this process leaves triton's language patched, and a Gluon build then fails)."""
    from test_hopper_compile import build_sm90

    paths = {}
    for key, tma in (("chain", False), ("tma", True)):
        path = tmp_path_factory.mktemp("prefix-src") / f"{key}.py"
        path.write_text(_source(tma=tma, bwd_prefix=1, **({"bwd_prefix_tma": 1} if tma else {})))
        paths[key] = str(path)
    built = build_sm90(tmp_path_factory, _BUILD, paths, "gluon-bwd-prefix")
    assert set(built) == {"chain", "tma"}
    assert all(0 < shared <= 227 * 1024 for sizes in built.values() for shared in sizes), built


def _attention64(q, k, v, visible, scale):
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.softmax(s, -1) @ v, lse


@pytest.fixture(scope="module")
def prefix_render():
    """The chain's prefix render (bwd_prefix 1), loaded on the CPU: its launch_prefix_backward is what _one_backward
    calls."""
    mod = load_source(_source(bwd_prefix=1), "gluon_bwd_prefix_entry_test")
    assert mod.BWD_PREFIX == 1
    return mod


class _FakeLow:
    """The causal call's module as _Prefix and _one_backward use it: a float64 forward (bottom-right causal) and the
    render's own launch_prefix_backward, its _bwd_host replaced by one that computes the prefix mask's gradients from
    (out, lse) the way the kernels do (P from lse, delta from out), recording what it was given."""
    BWD_PREFIX = 1

    def __init__(self, render):
        self.calls, self.render = [], render

    def launch_prefix_backward(self, *args, **kw):
        saved = self.render._bwd_host
        self.render._bwd_host = self._bwd_host
        try:
            return self.render.launch_prefix_backward(*args, **kw)
        finally:
            self.render._bwd_host = saved

    def forward(self, q, k, v, **kw):
        i = torch.arange(q.shape[2])[:, None] + k.shape[2] - q.shape[2]
        return _attention64(q, k, v, torch.arange(k.shape[2])[None, :] <= i, kw.get("scale", 0.125))

    def _bwd_host(self, do, q, k, v, out, lse, scale, dq, dk, dv, mode, qk_scale, extra):
        self.calls.append((mode, qk_scale, extra, out, lse))
        (p, ) = extra
        i, j = torch.arange(q.shape[2])[:, None], torch.arange(k.shape[2])[None, :]
        pm = torch.exp((q @ k.transpose(-1, -2)) * scale - lse[..., None]).masked_fill(~((j <= i) | (j < p)), 0.0)
        ds = pm * (do @ v.transpose(-1, -2) - (do * out).sum(-1, keepdim=True))
        dq.copy_(ds @ k * scale), dk.copy_(ds.transpose(-1, -2) @ q * scale), dv.copy_(pm.transpose(-1, -2) @ do)


class _FakeTop:
    def forward(self, q, k, v, **kw):
        return _attention64(q, k, v, torch.ones(q.shape[2], k.shape[2], dtype=torch.bool), kw.get("scale", 0.125))


@pytest.mark.parametrize("p", [1, 37, 64, 99])
def test_prefix_one_backward_passes_the_whole_problem_and_p(monkeypatch, p, prefix_render):
    """_Prefix with PREFIX_ONE_BWD and a causal module with BWD_PREFIX: through the render's launch_prefix_backward,
    one _bwd_host call with the concatenated out and lse and (P, ) in BWD_PREFIX_MODE, whose gradients (computed the
    kernels' way) equal autograd of the prefix-LM mask."""
    from fagen.mods import split

    monkeypatch.setattr(split, "PREFIX_ONE_BWD", True)
    torch.manual_seed(p)
    q, k, v, do = (torch.randn(2, 3, 100, 16, dtype=torch.float64) for _ in range(4))
    low = _FakeLow(prefix_render)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out = split._Prefix.apply(qg, kg, vg, p, (_FakeTop(), low), {"scale": 0.125})
    got = torch.autograd.grad(out, (qg, kg, vg), do)
    i, j = torch.arange(100)[:, None], torch.arange(100)[None, :]
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = _attention64(qr, kr, vr, (j <= i) | (j < p), 0.125)
    want = torch.autograd.grad(ref_out, (qr, kr, vr), do)
    assert torch.allclose(out, ref_out, atol=1e-12)
    assert len(low.calls) == 1 and low.calls[0][:3] == (prefix_render.BWD_PREFIX_MODE, None, (p, ))
    assert torch.allclose(low.calls[0][4], ref_lse, atol=1e-12)  # the two calls' lse in row order
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-10)
