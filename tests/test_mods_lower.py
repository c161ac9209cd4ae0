"""Mod lowering (fagen/mods/lower.py): a mask_mod or score_mod that is exactly a built-in mask, window or softcap
runs on that switch's kernel (the same bits as calling the switch), agrees with the unlowered mods and the float64
reference, keeps closure numbers runtime values (a changed one traces and loads nothing), and near-misses are not
lowered or are lowered to what they mean."""

import pytest
import torch

import fagen
from fagen.bench import gym_mods as g
from fagen.mods import lower as lowering
from fagen.mods.trace import trace
from _env import DEVICE
from mods_kernel import TOL
from fagen.runtime import loader, modded, mods as trace_cache
from fagen.runtime.resolve import AttentionError
from fagen.verify import reference
from fagen.verify.layouts import cu_seqlens

W = 5  # a module global: a runtime scalar in the mods below


def _decide(mask="none", sq=40, sk=40, scores=(), block_mask=False, same_lengths=True, slopes_ok=True, **mods):
    t = trace(**mods)
    fields = (t.score_text, t.mask_text, t.tensors, t.scalars)
    p = lowering.plan(fields, t.score_mod, t.mask_mod)
    if p is None:
        return None
    lengths = object()
    offset = lowering.alignment(mask, sq, sk, lengths, lengths if same_lengths else object(), False)
    low = lowering.lower(p, fields, (t.score_mod, t.mask_mod), t.values, mask=mask, offset=offset,
                         scores=dict.fromkeys(scores), block_mask=block_mask, slopes_ok=lambda t: slopes_ok)
    if low is None:
        return None
    named = {k: "slopes" if k == "alibi_slopes" and v is t.values["slopes"] else v for k, v in low.scores.items()}
    return low.mask, named, low.fields and low.fields[:2]


def _window(w):
    return lambda b, h, q_idx, kv_idx: (q_idx - kv_idx <= w) & (q_idx >= kv_idx)


@pytest.mark.parametrize("mask_mod, mask, sq, sk, want", [
    (g.causal_mask, "none", 40, 40, ("causal", {}, None)),
    (lambda b, h, q_idx, kv_idx: kv_idx <= q_idx, "none", 40, 40, ("causal", {}, None)),
    (lambda b, h, q_idx, kv_idx: ~(q_idx < kv_idx), "none", 40, 40, ("causal", {}, None)),
    (g.causal_mask, "causal", 40, 40, ("causal", {}, None)),
    (g.causal_mask, "padding", 40, 40, ("causal+padding", {}, None)),
    (g.causal_mask, "none", 40, 50, None),  # Flex's rows see fewer keys than bottom-right causal: no built-in
    (g.causal_mask, "causal", 40, 50, None),
    (g.causal_mask, "none", 50, 40, ("none", {"window": (None, 10)}, None)),  # i_aligned = q_idx - 10
    (g.causal_mask, "causal", 50, 40, ("causal", {}, None)),  # the built-in causal is the tighter one
    (g.causal_mask, "tree", 40, 40, None),
    (lambda b, h, q_idx, kv_idx: q_idx > kv_idx, "none", 40, 40, None),  # the diagonal hidden: no built-in
    (g.generate_sliding_window(7), "none", 40, 40, ("causal", {"window": (7, 0)}, None)),
    (g.generate_sliding_window(7), "none", 37, 40, None),
    (g.generate_sliding_window(7), "none", 43, 40, ("none", {"window": (4, 3)}, None)),
    (lambda b, h, q_idx, kv_idx: (q_idx - kv_idx < W) & (kv_idx <= q_idx), "none", 40, 40,
     ("causal", {"window": (W - 1, 0)}, None)),
    (lambda b, h, q_idx, kv_idx: (kv_idx - q_idx <= 3) & (kv_idx - q_idx >= -W), "none", 40, 40,
     ("none", {"window": (W, 3)}, None)),
    (lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx <= W + 2) & (q_idx - kv_idx <= 4 + W),
     "none", 40, 40, ("causal", {"window": (W + 2, 0)}, None)),
    (lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (h == 1), "none", 40, 40, ("causal", {}, (None, "h == 1"))),
    (lambda b, h, q_idx, kv_idx: torch.abs(q_idx - kv_idx) <= W, "none", 40, 40, ("none", {"window": (W, W)}, None)),
    (lambda b, h, q_idx, kv_idx: W > torch.abs(kv_idx - q_idx + 2), "none", 40, 40,
     ("none", {"window": (W + 1, W - 3)}, None)),  # -W < kv - q + 2 < W
    (lambda b, h, q_idx, kv_idx: torch.abs(q_idx - kv_idx) >= W, "none", 40, 40, None),  # outside a band
    (g.generate_dilated_sliding_window(6, 2), "none", 40, 40,
     ("none", {"window": (6, 6)}, (None, "abs(q_idx - kv_idx) % dilation == 0"))),
    (lambda b, h, q_idx, kv_idx: q_idx - kv_idx <= -1, "none", 40, 40, None),  # a negative extent
    (lambda b, h, q_idx, kv_idx: q_idx >= kv_idx + 0 * h, "none", 40, 40, None),  # reads h: not an interval atom
])
def test_mask_mods_lower_to_the_builtin_that_equals_them(mask_mod, mask, sq, sk, want):
    assert _decide(mask, sq, sk, mask_mod=mask_mod) == want


def test_what_keeps_a_mask_mod_as_it_is():
    # two length tensors (their values may differ per sequence), a window of the call's own, numbers past 2**24,
    # a block mask describing comparisons that would stay a mask_mod
    assert _decide("causal+padding", same_lengths=False, mask_mod=g.causal_mask) is None
    assert _decide(scores=("window",), mask_mod=g.generate_sliding_window(7)) is None
    assert _decide(scores=("window",), mask_mod=g.causal_mask) == ("causal", {}, None)
    assert _decide(mask_mod=g.generate_sliding_window(2 ** 25)) is None
    assert _decide(mask_mod=g.generate_sliding_window(-3)) is None
    partial = lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (h == 1)  # noqa: E731
    assert _decide(block_mask=True, mask_mod=partial) is None
    assert _decide(block_mask=True, mask_mod=g.causal_mask) == ("causal", {}, None)


@pytest.mark.parametrize("score_mod, scores, want", [
    (g.generate_tanh_softcap(30.0), (), 30.0),
    (g.generate_tanh_softcap(30), (), 30.0),  # attention-gym's int cap
    (lambda s, b, h, q_idx, kv_idx: torch.tanh(s / 7.5) * 7.5, (), 7.5),
    (lambda s, b, h, q_idx, kv_idx: W * torch.tanh(s * (1 / W)), (), float(W)),
    (g.generate_tanh_softcap(30.0), ("softcap",), None),  # the mod would cap the capped score
    (g.generate_tanh_softcap(30.0), ("alibi_slopes",), None),  # the mod sees the score after ALiBi
    (g.generate_tanh_softcap(-30.0), (), None),
    (g.generate_tanh_softcap(0.0), (), None),
    (lambda s, b, h, q_idx, kv_idx: 30.0 * torch.tanh(s / 31.0), (), None),
    (lambda s, b, h, q_idx, kv_idx: torch.tanh(s / 30.0), (), None),
    (lambda s, b, h, q_idx, kv_idx: 30.0 * torch.tanh(s / 30.0) + 1.0, (), None),
    (lambda s, b, h, q_idx, kv_idx: 30.0 * torch.tanh(s / 30.0 + h), (), None),
])
def test_score_mods_lower_to_the_softcap_switch_only_when_exact(score_mod, scores, want):
    got = _decide(scores=scores, score_mod=score_mod)
    assert got == (None if want is None else ("none", {"softcap": want}, None))


slopes = torch.rand(4, device=DEVICE)


@pytest.mark.parametrize("score_mod, mask, sq, sk, scores, ok, want", [
    (lambda s, b, h, q_idx, kv_idx: s - slopes[h] * torch.abs(q_idx - kv_idx), "none", 40, 40, (), True,
     ("none", {"alibi_slopes": "slopes"}, None)),
    (lambda s, b, h, q_idx, kv_idx: s - torch.abs(kv_idx - q_idx) * slopes[h], "padding", 40, 47, ("softcap",), True,
     ("padding", {"alibi_slopes": "slopes"}, None)),  # the mod sees the capped score: the switches' order
    (lambda s, b, h, q_idx, kv_idx: s - slopes[h] * torch.abs(q_idx - kv_idx), "none", 40, 47, (), True, None),
    (lambda s, b, h, q_idx, kv_idx: s - slopes[h] * torch.abs(q_idx - kv_idx), "none", 40, 40, (), False, None),
    (lambda s, b, h, q_idx, kv_idx: s - slopes[h] * torch.abs(q_idx - kv_idx), "none", 40, 40, ("alibi_slopes",),
     True, None),
    (lambda s, b, h, q_idx, kv_idx: s + slopes[h] * (kv_idx - q_idx), "none", 40, 40, (), True, None),  # no |.|
    (lambda s, b, h, q_idx, kv_idx: s + slopes[h] * (kv_idx - q_idx), "causal", 40, 40, (), True,
     ("causal", {"alibi_slopes": "slopes"}, None)),
    (lambda s, b, h, q_idx, kv_idx: s - (q_idx - kv_idx) * slopes[h], "causal", 47, 40, (), True, None),
    (lambda s, b, h, q_idx, kv_idx: s + slopes[h] * (q_idx - kv_idx), "causal", 40, 40, (), True, None),  # sign
    (lambda s, b, h, q_idx, kv_idx: s - slopes[h] * torch.abs(q_idx - kv_idx - 1), "none", 40, 40, (), True, None),
    (lambda s, b, h, q_idx, kv_idx: s - slopes[b] * torch.abs(q_idx - kv_idx), "none", 40, 40, (), True, None),
    (g.generate_alibi_bias(4), "causal", 40, 40, (), True, None),  # slopes made in the mod: host_slopes (none here)
])
def test_score_mods_lower_to_the_alibi_switch_only_when_exact(score_mod, mask, sq, sk, scores, ok, want):
    assert _decide(mask, sq, sk, scores=scores, slopes_ok=ok, score_mod=score_mod) == want


def test_a_causal_mask_mod_lets_the_alibi_without_abs_lower():
    got = _decide(score_mod=lambda s, b, h, q_idx, kv_idx: s + slopes[h] * (kv_idx - q_idx), mask_mod=g.causal_mask)
    assert got == ("causal", {"alibi_slopes": "slopes"}, None)


def _qkv(b, hq, hkv, sq, sk, d=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, sq, d, generator=gen).to(DEVICE).requires_grad_()
    k, v = (torch.randn(b, hkv, sk, d, generator=gen).to(DEVICE).requires_grad_() for _ in range(2))
    return q, k, v, torch.randn(b, hq, sq, d, generator=gen).to(DEVICE)


def _run(q, k, v, do, **kw):
    out = fagen.attention(q, k, v, **kw)
    return (out, *torch.autograd.grad(out, (q, k, v), do))


def _no_modded_module(monkeypatch):
    def refuse(*args, **kw):
        raise AssertionError("a lowered call built a modded module")
    monkeypatch.setattr(modded, "module_for", refuse)


@pytest.mark.parametrize("name", ["causal", "window", "softcap", "causal+softcap", "alibi", "causal+alibi"])
def test_a_lowered_mod_runs_the_switch_kernel_and_agrees_with_the_mods(name, monkeypatch):
    q, k, v, do = _qkv(1, 4, 2, 45, 45)
    switch_kw, mod_kw, label = {
        "causal": (dict(mask="causal"), dict(mask_mod=g.causal_mask), "causal"),
        "window": (dict(mask="causal", window=(9, 0)), dict(mask_mod=g.generate_sliding_window(9)),
                   "causal+window(9,0)"),
        "softcap": (dict(softcap=6.0), dict(score_mod=g.generate_tanh_softcap(6.0)), "softcap"),
        "causal+softcap": (dict(mask="causal", softcap=6.0),
                           dict(mask_mod=g.causal_mask, score_mod=g.generate_tanh_softcap(6)), "causal+softcap"),
        "alibi": (dict(alibi_slopes=slopes),
                  dict(score_mod=lambda s, b, h, q_idx, kv_idx: s - slopes[h] * torch.abs(kv_idx - q_idx)), "alibi"),
        "causal+alibi": (dict(mask="causal", alibi_slopes=slopes),
                         dict(mask_mod=g.causal_mask,
                              score_mod=lambda s, b, h, q_idx, kv_idx: s + slopes[h] * (kv_idx - q_idx)),
                         "causal+alibi"),
    }[name]
    want = _run(q, k, v, do, **switch_kw)
    monkeypatch.setattr(lowering, "ENABLED", False)
    unlowered = _run(q, k, v, do, **mod_kw)
    assert modded.LOWERED[0] is None
    monkeypatch.setattr(lowering, "ENABLED", True)
    with monkeypatch.context() as m:
        _no_modded_module(m)
        got = _run(q, k, v, do, **mod_kw)
    assert modded.LOWERED[0] == label
    assert all(torch.equal(a, b) for a, b in zip(got, want))  # the switch kernel itself: the same bits
    assert max((a - b).abs().max().item() for a, b in zip(got, unlowered)) < 2e-5
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = reference.attention(*leaves, **mod_kw)[0]
    ref = (ref, *torch.autograd.grad(ref, leaves, do.double()))
    for a, b in zip(got, ref):
        assert (a.double() - b).abs().max().item() < 4 * TOL[torch.float32]


def test_a_changed_closure_number_traces_and_loads_nothing_and_still_lowers(monkeypatch):
    q, k, v, _ = _qkv(1, 2, 2, 33, 33)
    with torch.no_grad():
        fagen.attention(q, k, v, mask_mod=g.generate_sliding_window(4))
        traces, modules = trace_cache.TRACES[0], len(loader._loaded)
        _no_modded_module(monkeypatch)
        for w in (16, 1, 0, 40):
            out = fagen.attention(q, k, v, mask_mod=g.generate_sliding_window(w))
            assert modded.LOWERED[0] == f"causal+window({w},0)"
            assert torch.equal(out, fagen.attention(q, k, v, mask="causal", window=(w, 0)))
    assert trace_cache.TRACES[0] == traces and len(loader._loaded) == modules


@pytest.mark.parametrize("sq, sk, kw, label", [
    (40, 47, dict(mask_mod=lambda b, h, q_idx, kv_idx: q_idx > kv_idx), None),
    (40, 47, dict(mask_mod=g.causal_mask), None),  # Sq < Sk: Flex's rows hide keys the built-in shows
    (40, 47, dict(mask_mod=g.generate_sliding_window(6), mask="causal"), None),
    (40, 47, dict(mask_mod=lambda b, h, q_idx, kv_idx: (q_idx - kv_idx < 6) & (kv_idx <= q_idx + 7)),
     "causal+window(12,0)"),  # i_aligned = q_idx + 7
    (47, 40, dict(mask_mod=g.causal_mask), "window(None,7)"),  # i_aligned = q_idx - 7
    (47, 40, dict(mask_mod=g.generate_sliding_window(6)), None),  # would need a left extent of -1
    (47, 40, dict(mask_mod=lambda b, h, q_idx, kv_idx: (kv_idx - q_idx <= 2) & (q_idx - kv_idx <= 9)),
     "window(2,9)"),
    (40, 40, dict(mask_mod=lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (h % 2 == 0)), "causal"),
    (40, 40, dict(mask_mod=g.generate_dilated_sliding_window(6, 3)), "window(6,6)"),  # the % stays a mask_mod
    (42, 40, dict(mask_mod=lambda b, h, q_idx, kv_idx: torch.abs(q_idx - kv_idx) < W), "window(2,6)"),
])
def test_near_misses_and_other_shapes_match_the_reference(sq, sk, kw, label):
    q, k, v, do = _qkv(1, 2, 2, sq, sk)
    got = _run(q, k, v, do, **kw)
    assert modded.LOWERED[0] == label
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = reference.attention(*leaves, **kw)[0]
    ref = (ref, *torch.autograd.grad(ref, leaves, do.double()))
    for a, b in zip(got, ref):
        assert (a.double() - b).abs().max().item() < 4 * TOL[torch.float32]


def test_padding_and_varlen_lower_only_with_one_lengths_tensor(monkeypatch):
    q, k, v, do = _qkv(2, 2, 2, 40, 40)
    lengths = torch.tensor([33, 17], device=DEVICE)
    for lengths_k, label in ((lengths, "causal+padding"), (lengths.clone(), None)):
        kw = dict(mask="padding", seqlens_q=lengths, seqlens_k=lengths_k, mask_mod=g.causal_mask)
        got = fagen.attention(q, k, v, **kw)
        assert modded.LOWERED[0] == label
        want = reference.attention(q.double(), k.double(), v.double(), **kw)[0]
        valid = torch.arange(40, device=DEVICE)[None, None, :, None] < lengths[:, None, None, None]
        assert ((got.double() - want) * valid).abs().max().item() < TOL[torch.float32]
    lens = [19, 33]
    qp, kp, vp = (torch.randn(sum(lens), 2, 32, generator=torch.Generator().manual_seed(i)).to(DEVICE)
                  for i in range(3))
    cu = cu_seqlens(lens, DEVICE)
    for cu_k, label in ((cu, "causal+window(4,0)"), (cu.clone(), None)):
        kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu_k, max_seqlen_q=33, max_seqlen_k=33)
        got = fagen.attention(qp, kp, vp, mask_mod=g.generate_sliding_window(4), **kw)
        assert modded.LOWERED[0] == label
        want, _ = reference.packed_attention(qp.double(), kp.double(), vp.double(), cu.cpu(), cu.cpu(),
                                             mask_mod=g.generate_sliding_window(4))
        assert (got.double() - want).abs().max().item() < TOL[torch.float32]


def test_a_block_mask_of_a_lowered_mask_mod_is_checked_then_unused():
    q, k, v, _ = _qkv(1, 2, 2, 40, 40)
    good = fagen.create_block_mask(g.causal_mask, None, None, 40, 40, device=DEVICE, block_size=16)
    other = fagen.create_block_mask(g.generate_sliding_window(3), None, None, 40, 40, device=DEVICE, block_size=16)
    with torch.no_grad():
        out = fagen.attention(q, k, v, mask_mod=g.causal_mask, block_mask=good)
        assert modded.LOWERED[0] == "causal"
        assert torch.equal(out, fagen.attention(q, k, v, mask="causal"))
        with pytest.raises(AttentionError, match="^block_mask: built for mask_mod"):
            fagen.attention(q, k, v, mask_mod=g.causal_mask, block_mask=other)


def test_a_partly_lowered_mask_mod_keeps_the_rest_and_its_tensors():
    q, k, v, do = _qkv(1, 2, 2, 45, 45)
    doc = torch.tensor([0] * 20 + [1] * 25, device=DEVICE)
    bias = torch.randn(2, 45, device=DEVICE)

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[h, kv_idx]

    got = _run(q, k, v, do, mask_mod=mask_mod, score_mod=score_mod)
    assert modded.LOWERED[0] == "causal"
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = reference.attention(*leaves, mask_mod=mask_mod, score_mod=score_mod)[0]
    ref = (ref, *torch.autograd.grad(ref, leaves, do.double()))
    for a, b in zip(got, ref):
        assert (a.double() - b).abs().max().item() < 4 * TOL[torch.float32]


def test_sinks_and_rows_that_see_no_key_agree_lowered_and_not(monkeypatch):
    q, k, v, do = _qkv(1, 2, 2, 47, 40)  # mask="causal" at Sq > Sk: rows 0..6 see no key
    sinks = torch.randn(2, device=DEVICE).requires_grad_()
    kw = dict(mask="causal", sinks=sinks, mask_mod=g.generate_sliding_window(9))
    got = fagen.attention(q, k, v, **kw)
    assert modded.LOWERED[0] == "causal+window(2,0)"  # i_aligned = q_idx - 7
    got = (got, *torch.autograd.grad(got, (q, k, v, sinks), do))
    monkeypatch.setattr(lowering, "ENABLED", False)
    want = fagen.attention(q, k, v, **kw)
    want = (want, *torch.autograd.grad(want, (q, k, v, sinks), do))
    assert got[0][:, :, :7].abs().max() == 0
    assert max((a - b).abs().max().item() for a, b in zip(got, want)) < 2e-5


def test_a_softcap_lowers_beside_a_mask_mod_and_its_block_mask():
    q, k, v, do = _qkv(2, 2, 2, 45, 45)  # B = 2: the document mask stays a mod (no varlen split)
    mask_mod = g.generate_doc_mask_mod(g.causal_mask, g.length_to_offsets([13, 32], DEVICE))
    block_mask = fagen.create_block_mask(mask_mod, None, None, 45, 45, device=DEVICE, block_size=16)
    kw = dict(score_mod=g.generate_tanh_softcap(5.0), mask_mod=mask_mod)
    got = _run(q, k, v, do, block_mask=block_mask, **kw)
    assert modded.LOWERED[0] == "softcap"  # the block mask still serves the document mask
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = reference.attention(*leaves, **kw)[0]
    ref = (ref, *torch.autograd.grad(ref, leaves, do.double()))
    for a, b in zip(got, ref):
        assert (a.double() - b).abs().max().item() < 4 * TOL[torch.float32]


@pytest.mark.parametrize("value, enabled", [("0", False), ("off", False), ("1", True), ("", True)])
def test_the_environment_turns_lowering_off(value, enabled):
    import os
    import subprocess
    import sys

    env = dict(os.environ, FAGEN_MOD_LOWERING=value)
    res = subprocess.run([sys.executable, "-c", "from fagen.mods import lower; print(lower.ENABLED)"], env=env,
                         capture_output=True, text=True, check=True)
    assert res.stdout.strip() == str(enabled)


def test_slopes_that_want_a_gradient_keep_the_mod():
    q, k, v, do = _qkv(1, 4, 2, 40, 40)
    learned = slopes.clone().requires_grad_()
    out = fagen.attention(q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx: s - learned[h] * torch.abs(q_idx - kv_idx))
    assert modded.LOWERED[0] is None
    (grad,) = torch.autograd.grad(out, (learned,), do)
    assert grad.abs().max() > 0
    with torch.no_grad():
        fagen.attention(q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx: s - learned[h] * torch.abs(q_idx - kv_idx))
    assert modded.LOWERED[0] == "alibi"  # no gradient asked: the switch


def test_the_modded_path_lowers_too_where_the_fast_check_is_skipped(monkeypatch):
    """Under torch.compile fagen.attention skips its eager lowering check and calls the modded path (a graph break),
    which lowers the same mods and hands them back to the plain path."""
    q, k, v, _ = _qkv(1, 2, 2, 40, 40)
    with torch.no_grad():
        want = fagen.attention(q, k, v, mask="causal", window=(6, 0))
        monkeypatch.setattr(fagen.runtime.api, "_as_switches", lambda *a: None)
        got = fagen.attention(q, k, v, mask_mod=g.generate_sliding_window(6))
    assert modded.LOWERED[0] == "causal+window(6,0)" and torch.equal(got, want)


def test_a_score_mod_the_gluon_forward_would_serve_stays_a_mod(monkeypatch):
    """[Note] Score mods on the gluon forward: where that forward serves a score_mod alone (an H100, no gradient),
    the softcap stays a mod; a causal mask_mod beside it still lowers, and the switch serves with a gradient."""
    q, k, v, do = _qkv(1, 2, 2, 40, 40)
    kept = []
    monkeypatch.setattr(modded, "_gluon_serves", lambda mods, q, k, v, mask: kept.append(mask) or True)
    with torch.no_grad():
        got = fagen.attention(q, k, v, score_mod=g.generate_tanh_softcap(5.0))
        assert modded.LOWERED[0] is None and set(kept) == {"none"}
        got_causal = fagen.attention(q, k, v, score_mod=g.generate_tanh_softcap(5.0), mask_mod=g.causal_mask)
        assert modded.LOWERED[0] == "causal" and set(kept) == {"none", "causal"}
    want = reference.attention(q.double(), k.double(), v.double(), score_mod=g.generate_tanh_softcap(5.0))[0]
    assert (got.double() - want).abs().max().item() < TOL[torch.float32]
    want = reference.attention(q.double(), k.double(), v.double(), score_mod=g.generate_tanh_softcap(5.0),
                               mask_mod=g.causal_mask)[0]
    assert (got_causal.double() - want).abs().max().item() < TOL[torch.float32]
    monkeypatch.undo()
    assert not modded._gluon_serves(trace_cache.prepare(score_mod=g.generate_tanh_softcap(5.0)), q, k, v, "none")
