"""Captured-tensor gradients pre-reduced per tile ([Note] Gradient index classes in fagen/mods/grad.py, [Note]
Deterministic captured-tensor gradients in fagen/templates/triton/mods.j2): the classification of each load's index
(proven on the tree, traps included), and the gradients of one tensor per class (tile, row, column, diagonal, and
the per-score path) against the float64 reference of the user's own function, dense and varlen, GQA, causal or a
mask_mod with its block mask, lengths off the blocks; two runs bitwise equal; the reduced workspaces' sizes."""

import pytest
import torch

import fagen
from _env import DEVICE
from fagen.mods import grad, ir
from fagen.mods.text import ModTensor, parse
from fagen.verify import reference
from fagen.verify.layouts import cu_seqlens

T = (ModTensor("t", "fp32", 2), ModTensor("u", "fp32", 4), ModTensor("pos", "i32", 1))


def _classes(text):
    tree = parse(text, "score_mod", T, ())
    return [grad.index_class(n) for n in ir.walk(tree) if isinstance(n, ir.Load) and n.type == ir.FLOAT]


@pytest.mark.parametrize("text, want", [
    ("score + t[h, q_idx - kv_idx + 5]", "diagonal"),
    ("score + t[h, clamp(q_idx - kv_idx, -4, 4) + 4]", "diagonal"),  # a function of the difference
    ("score + t[h, (q_idx - kv_idx) // 64]", "diagonal"),
    ("score + t[h, 3 * q_idx - 3 * kv_idx]", "diagonal"),
    ("score + t[h, (q_idx + kv_idx) - 2 * kv_idx]", "diagonal"),  # affine forms combine across + and -
    ("score + t[h, where(q_idx - kv_idx > 0, q_idx - kv_idx, 0)]", "diagonal"),
    ("score + t[h, pos[q_idx - kv_idx + 3]]", "diagonal"),  # a load at the difference is a function of it
    ("score + t[h, q_idx + kv_idx]", "score"),
    ("score + t[h, q_idx * 2 - kv_idx]", "score"),
    ("score + t[h, (q_idx - kv_idx) + q_idx]", "score"),
    ("score + t[h, pos[q_idx] - pos[kv_idx]]", "score"),  # loads of each: not provably the difference
    ("score + t[h, where(score > 0, q_idx, kv_idx)]", "score"),
    ("score + t[h, q_idx // 2 - kv_idx // 2]", "score"),  # floor is not affine
    ("score + t[b, h]", "tile"),
    ("score + t[h, pos[b]]", "tile"),
    ("score + t[h, q_idx]", "row"),
    ("score + t[h, clamp(q_idx, 0, 7) // 2]", "row"),
    ("score + t[h, kv_idx + 1]", "column"),
    ("score + u[b, h, q_idx, kv_idx]", "score"),
])
def test_the_index_class_is_proven_on_the_tree(text, want):
    assert _classes(text) == [want]


def _tensors(hq, sq, sk, batch, gen):
    """One learned tensor per class: w[h] (tile), r[h, q] (row), c[h, kv] (column), t[h, bucket(q - kv)]
    (diagonal, clamped and floored: many diagonals per element), dense[b, h, q, kv] (per score)."""
    return [(torch.randn(*shape, generator=gen) * 0.5).to(DEVICE).requires_grad_()
            for shape in ((hq,), (hq, sq), (hq, sk), (hq, 9), (batch, hq, sq, sk))]


def _score_mod(w, r, c, t, dense):
    def score_mod(score, b, h, q_idx, kv_idx):
        diag = torch.clamp(q_idx - kv_idx, -7, 9) // 2 + 4
        # r is not added alone: a bias constant along a row leaves the softmax as it is (its gradient is 0)
        return (score * w[h] + r[h, q_idx] * torch.sigmoid(score) + c[h, kv_idx] * torch.tanh(score) + t[h, diag]
                + dense[b, h, q_idx, kv_idx])

    return score_mod


def _mask_mod(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) | ((q_idx + kv_idx) % 5 == 0)


NAMES = ("dq", "dk", "dv", "dw (tile)", "dr (row)", "dc (column)", "dt (diagonal)", "ddense (score)")


def _compare(got, want):
    for name, a, b in zip(NAMES, got, want):
        err = (a.double().cpu() - b.double().cpu()).abs().max().item()
        assert err < 1e-4, f"{name}: {err:.2e}"


@pytest.mark.parametrize("masking", ["causal", "mask_mod"])
def test_each_class_gets_its_gradient_dense_gqa_bitwise_repeatable(masking):
    gen = torch.Generator().manual_seed(0)
    batch, hq, hkv, sq, sk, d = 2, 4, 2, 37, 45, 16
    q = torch.randn(batch, hq, sq, d, generator=gen).to(DEVICE).requires_grad_()
    k, v = (torch.randn(batch, hkv, sk, d, generator=gen).to(DEVICE).requires_grad_() for _ in range(2))
    do = torch.randn(q.shape, generator=gen).to(DEVICE)
    learned = _tensors(hq, sq, sk, batch, gen)
    kw = dict(mask="causal") if masking == "causal" else dict(
        mask_mod=_mask_mod, block_mask=fagen.create_block_mask(_mask_mod, None, None, sq, sk, device=DEVICE,
                                                              block_size=16))
    leaves = (q, k, v, *learned)
    got = [torch.autograd.grad(fagen.attention(q, k, v, score_mod=_score_mod(*learned), **kw), leaves, do)
           for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*got))  # bitwise: no atomics, fixed orders
    ref = [x.detach().double().requires_grad_() for x in leaves]
    ref_kw = {key: val for key, val in kw.items() if key != "block_mask"}
    want = reference.attention(*ref[:3], score_mod=_score_mod(*ref[3:]), **ref_kw)
    want = want[0] if isinstance(want, tuple) else want
    _compare(got[0], torch.autograd.grad(want, ref, do.double()))


def test_each_class_gets_its_gradient_varlen_gqa():
    """b is the sequence and q_idx, kv_idx positions in it: an empty sequence, lengths off the 16-row blocks."""
    gen = torch.Generator().manual_seed(1)
    lens_q, lens_k, hq, hkv, d = [13, 0, 21, 5], [17, 3, 21, 9], 4, 2, 16
    q = torch.randn(sum(lens_q), hq, d, generator=gen).to(DEVICE).requires_grad_()
    k, v = (torch.randn(sum(lens_k), hkv, d, generator=gen).to(DEVICE).requires_grad_() for _ in range(2))
    do = torch.randn(q.shape, generator=gen).to(DEVICE)
    kw = dict(cu_seqlens_q=cu_seqlens(lens_q, DEVICE), cu_seqlens_k=cu_seqlens(lens_k, DEVICE),
              max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))
    learned = _tensors(hq, max(lens_q), max(lens_k), len(lens_q), gen)
    leaves = (q, k, v, *learned)
    got = torch.autograd.grad(fagen.attention(q, k, v, mask="causal", score_mod=_score_mod(*learned), **kw),
                              leaves, do)
    ref = [x.detach().double().requires_grad_() for x in leaves]
    want, _ = reference.packed_attention(*ref[:3], kw["cu_seqlens_q"].cpu(), kw["cu_seqlens_k"].cpu(), mask="causal",
                                         score_mod=_score_mod(*ref[3:]))
    _compare(got, torch.autograd.grad(want, ref, do.double()))


def test_reduced_workspaces_scale_with_tiles_not_scores():
    """The generated module's workspaces for S = 4096 (B1 H2): the diagonal's values at most two slots per tile
    diagonal, its indices one per diagonal, against B * H * S * S for the per-score path."""
    from fagen.runtime import loader

    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 20, 16, generator=gen).to(DEVICE).requires_grad_() for _ in range(3))
    t = torch.randn(2, 39, generator=gen).to(DEVICE).requires_grad_()
    dense = torch.randn(1, 2, 20, 20, generator=gen).to(DEVICE).requires_grad_()

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + t[h, q_idx - kv_idx + 19] + dense[b, h, q_idx, kv_idx]

    torch.autograd.grad(fagen.attention(q, k, v, mask="causal", score_mod=score_mod).sum(), (t,))
    module = next(m for m in loader._loaded.values() if getattr(m, "_MOD_GRAD_LOADS", None) ==
                  ((0, "score"), (1, "diagonal")))  # sorted by name
    s = 4096
    ws = module._mod_workspaces((True, True), q, 1, 2, s, s, (dense, t))
    tiles = 2 * (s // module.DKDV_BLOCK_M) * (s // module.DKDV_BLOCK_N)
    chunks = (module.DKDV_BLOCK_M + module.DKDV_BLOCK_N - 2) // module.DKDV_BLOCK_M + 1
    assert ws[0].numel() == ws[1].numel() == 2 * s * s  # the per-score path
    # per tile its diagonals, in chunks of BLOCK_M, each key block's rows spanning Sq + Sk diagonals
    assert ws[2].numel() <= 2 * tiles * chunks * module.DKDV_BLOCK_M * 1.05
    assert ws[3].numel() < 2 * 2 * 2 * s  # one index per (h, diagonal)
    # the slots no tile writes (half of them under a causal mask) spread over the elements: index_put_'s sort
    # makes no long run of one index, which its kernel would walk serially
    for index, numel in ((ws[1], dense.numel()), (ws[3], t.numel())):
        assert torch.bincount(index.reshape(-1)).max().item() <= -(-index.numel() // numel)
