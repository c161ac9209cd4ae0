"""ALiBi whose slopes are an expression of h ([Note] Host slopes in fagen/mods/lower.py): attention-gym's
`generate_alibi_bias(H)` under a causal mask runs on the ALiBi switch with slopes evaluated on the host per query
head, agrees with the unlowered mod kernel and the float64 reference (GQA, lengths off the block), and a changed
closure number gives the new slopes without tracing or loading anything."""

import math

import pytest
import torch

import fagen
from fagen.bench import gym_mods as g
from fagen.mods import lower as lowering
from fagen.mods.trace import trace
from _env import DEVICE
from mods_kernel import TOL
from fagen.runtime import loader, modded, mods as trace_cache
from fagen.verify import reference

M = 0.75  # a module global float: a runtime scalar of the mods below


def _qkv(hq=4, hkv=2, sq=45, sk=45, d=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, hq, sq, d, generator=gen).to(DEVICE).requires_grad_()
    k, v = (torch.randn(1, hkv, sk, d, generator=gen).to(DEVICE).requires_grad_() for _ in range(2))
    return q, k, v, torch.randn(1, hq, sq, d, generator=gen).to(DEVICE)


def _run(q, k, v, do, **kw):
    out = fagen.attention(q, k, v, **kw)
    return (out, *torch.autograd.grad(out, (q, k, v), do))


def _gym_slopes(h):
    return torch.exp2(-((torch.arange(h, dtype=torch.float32) + 1) * 8.0 / h)).to(DEVICE)


def _slope_tree(score_mod):
    t = trace(score_mod=score_mod)
    p = lowering.plan((t.score_text, None, t.tensors, t.scalars), t.score_mod, None)
    return p, t


@pytest.mark.parametrize("score_mod, heads, want", [
    (g.generate_alibi_bias(8), 8, [2.0 ** -((h + 1) * 8.0 / 8) for h in range(8)]),
    (lambda s, b, h, q_idx, kv_idx: s + (kv_idx - q_idx) * (h % 3 + M), 5, [h % 3 + M for h in range(5)]),
    (lambda s, b, h, q_idx, kv_idx: s - torch.abs(q_idx - kv_idx) * (torch.sqrt(h + 1.0) / 4), 3,
     [math.sqrt(h + 1.0) / 4 for h in range(3)]),
    (lambda s, b, h, q_idx, kv_idx: s + (kv_idx - q_idx) * 0.5, 2, [0.5, 0.5]),  # no h at all: one slope
])
def test_the_host_evaluates_the_slope_expression_per_head(score_mod, heads, want):
    p, t = _slope_tree(score_mod)
    assert p is not None and not isinstance(p.alibi[0], str)
    got = lowering.head_slopes(p.alibi[0], heads, t.values)
    assert got is not None and max(abs(a - b) for a, b in zip(got, want)) <= 1e-12 * max(map(abs, want))


@pytest.mark.parametrize("score_mod", [
    lambda s, b, h, q_idx, kv_idx: s + (kv_idx - q_idx) * (1.0 / (h - 1)),  # a division by zero at h = 1
    lambda s, b, h, q_idx, kv_idx: s + (kv_idx - q_idx) * torch.exp(h * 100.0),  # not finite past h = 0
    lambda s, b, h, q_idx, kv_idx: s + (kv_idx - q_idx) * torch.log(h - 1.0),  # log of a negative at h = 0
    lambda s, b, h, q_idx, kv_idx: s + (kv_idx - q_idx) * ((h + 0.5) // 2),  # float floor division
    lambda s, b, h, q_idx, kv_idx: s + (kv_idx - q_idx) * (h * 20000000 + 1),  # past 2**24: int32 could wrap
])
def test_slopes_the_host_cannot_match_keep_the_mod(score_mod):
    p, t = _slope_tree(score_mod)
    assert p is not None and lowering.head_slopes(p.alibi[0], 3, t.values) is None
    q, k, v, do = _qkv(hq=3, hkv=3, sq=20, sk=20)
    with torch.no_grad():
        fagen.attention(q, k, v, score_mod=score_mod, mask_mod=g.causal_mask)
    assert modded.LOWERED[0] == "causal"  # the mask lowered, the score_mod stayed a mod as written


@pytest.mark.parametrize("score_mod", [
    lambda s, b, h, q_idx, kv_idx: s + (kv_idx - q_idx) * (b + 1.0),  # b, not h
    lambda s, b, h, q_idx, kv_idx: s + (kv_idx - q_idx) * torch.where(h > 1, 0.5, 0.25),  # where: not evaluated
    lambda s, b, h, q_idx, kv_idx: s + (kv_idx - q_idx) * (q_idx + 1.0),  # not per head
])
def test_slopes_of_more_than_h_are_not_alibi(score_mod):
    p, _ = _slope_tree(score_mod)
    assert p is None or p.alibi is None


@pytest.mark.parametrize("mask_kw", [dict(mask_mod=g.causal_mask), dict(mask="causal")])
def test_gym_alibi_under_a_causal_mask_runs_the_switch_and_agrees_with_the_mod(mask_kw, monkeypatch):
    q, k, v, do = _qkv()  # GQA 4 / 2, 45 rows: not a multiple of any block
    mods = dict(score_mod=g.generate_alibi_bias(4), **mask_kw)
    want = _run(q, k, v, do, mask="causal", alibi_slopes=_gym_slopes(4))
    monkeypatch.setattr(lowering, "ENABLED", False)
    unlowered = _run(q, k, v, do, **mods)
    assert modded.LOWERED[0] is None
    monkeypatch.setattr(lowering, "ENABLED", True)
    with monkeypatch.context() as m:
        m.setattr(modded, "module_for", lambda *a, **kw: pytest.fail("a lowered call built a modded module"))
        got = _run(q, k, v, do, **mods)
    assert modded.LOWERED[0] == ("causal+alibi" if "mask_mod" in mask_kw else "alibi")
    assert all(torch.equal(a, b) for a, b in zip(got, want))  # the switch kernel with the host's slopes
    assert max((a - b).abs().max().item() for a, b in zip(got, unlowered)) < 2e-5
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = reference.attention(*leaves, **mods)[0]
    ref = (ref, *torch.autograd.grad(ref, leaves, do.double()))
    for a, b in zip(got, ref):
        assert (a.double() - b).abs().max().item() < 4 * TOL[torch.float32]


@pytest.mark.parametrize("hq, hkv, sq, sk", [(4, 2, 45, 45), (2, 2, 37, 50)])
def test_gym_alibi_without_a_causal_mask_drops_its_row_term(hq, hkv, sq, sk, monkeypatch):
    """[Note] ALiBi without its row term: kv_idx - q_idx is not -|kv_idx - q_idx| here (no switch); the mod left is
    `score + kv_idx * S`, with the same out and gradients as the mod as written and the float64 reference."""
    q, k, v, do = _qkv(hq, hkv, sq, sk)
    mods = dict(score_mod=g.generate_alibi_bias(hq))
    monkeypatch.setattr(lowering, "ENABLED", False)
    unlowered = _run(q, k, v, do, **mods)
    monkeypatch.setattr(lowering, "ENABLED", True)
    specs = []
    real = modded._bwd_module
    monkeypatch.setattr(modded, "_bwd_module", lambda key, spec, args: specs.append(spec) or real(key, spec, args))
    got = _run(q, k, v, do, **mods)
    assert modded.LOWERED[0] == "alibi-rowfree"
    assert {s.score_mod for s in specs} == {"score + kv_idx * exp2(-((h + 1) * 8.0 / H))"}
    assert max((a - b).abs().max().item() for a, b in zip(got, unlowered)) < 2e-5
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = reference.attention(*leaves, **mods)[0]
    ref = (ref, *torch.autograd.grad(ref, leaves, do.double()))
    for a, b in zip(got, ref):
        assert (a.double() - b).abs().max().item() < 4 * TOL[torch.float32]


def _alibi(m):
    def mod(score, b, h, q_idx, kv_idx):
        return score + (kv_idx - q_idx) * torch.exp2(-(h + 1) * m)
    return mod


def test_a_changed_closure_number_gives_new_slopes_and_compiles_nothing(monkeypatch):
    q, k, v, _ = _qkv(sq=33, sk=33)
    with torch.no_grad():
        fagen.attention(q, k, v, score_mod=_alibi(1.0), mask_mod=g.causal_mask)
        traces, modules = trace_cache.TRACES[0], len(loader._loaded)
        monkeypatch.setattr(modded, "module_for", lambda *a, **kw: pytest.fail("a modded module was built"))
        for m in (0.5, 2.0, 1.0, 0.25):
            got = fagen.attention(q, k, v, score_mod=_alibi(m), mask_mod=g.causal_mask)
            assert modded.LOWERED[0] == "causal+alibi"
            slopes = torch.tensor([2.0 ** (-(h + 1) * m) for h in range(4)], dtype=torch.float32, device=DEVICE)
            assert torch.equal(got, fagen.attention(q, k, v, mask="causal", alibi_slopes=slopes))
    assert trace_cache.TRACES[0] == traces and len(loader._loaded) == modules


def test_a_changed_closure_number_in_the_row_free_mod_compiles_nothing():
    q, k, v, _ = _qkv(sq=33, sk=33)
    with torch.no_grad():
        fagen.attention(q, k, v, score_mod=_alibi(1.0))
        traces, modules = trace_cache.TRACES[0], len(loader._loaded)
        for m in (0.5, 0.125):
            got = fagen.attention(q, k, v, score_mod=_alibi(m))
            assert modded.LOWERED[0] == "alibi-rowfree"
            ref = reference.attention(q.double(), k.double(), v.double(), score_mod=_alibi(m))[0]
            assert (got.double() - ref).abs().max().item() < TOL[torch.float32]
    assert trace_cache.TRACES[0] == traces and len(loader._loaded) == modules
