"""User mods on the varlen, decode and paged layouts (README "User mods"): each kernel against the float64
reference running the user's own functions (fagen/verify/reference.py: packed_attention for packed sequences,
mod_positions="absolute" for the decode and paged kernels). CPU interpreter, tiny shapes, lengths that are not
multiples of the blocks, GQA, a captured bias (with its gradient), a captured document-id tensor, closure numbers."""

import pytest
import torch

import fagen
from _env import DEVICE
from fagen.runtime.resolve import AttentionError
from fagen.verify import reference
from fagen.verify.layouts import cu_seqlens

TOL = {torch.float32: 2e-5, torch.float16: 2e-3}


def _packed(lens_q, lens_k, hq, hkv, d=32, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q), hq, d, generator=gen).to(DEVICE, dtype).requires_grad_()
    k, v = (torch.randn(sum(lens_k), hkv, d, generator=gen).to(DEVICE, dtype).requires_grad_() for _ in range(2))
    kw = dict(cu_seqlens_q=cu_seqlens(lens_q, DEVICE), cu_seqlens_k=cu_seqlens(lens_k, DEVICE),
              max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))
    return q, k, v, torch.randn(q.shape, generator=gen).to(DEVICE, dtype), kw


def _mods(hq, batch, seed=1):
    """A relative bias per query head (float, learnable), a document id per (sequence, position) (int), a closure
    float and a closure int; score_mod reads b, h, q_idx and kv_idx, mask_mod b, q_idx and kv_idx."""
    gen = torch.Generator().manual_seed(seed)
    bias = torch.randn(hq, 128, generator=gen).to(DEVICE).requires_grad_()
    doc = torch.randint(0, 3, (batch, 64), generator=gen).sort(dim=1).values.to(DEVICE, torch.int32)
    temp, reach = 0.75, 11

    def score_mod(score, b, h, q_idx, kv_idx):
        return score * temp + bias[h, q_idx - kv_idx + 64] + 0.25 * b

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc[b, q_idx] == doc[b, kv_idx]) | (q_idx - kv_idx < reach)

    return bias, score_mod, mask_mod


def _close(name, got, want, tol):
    err = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
    assert err < tol, f"{name}: {err:.2e}"


@pytest.mark.parametrize("mask", ["none", "causal"])
def test_varlen_forward_and_backward_with_both_mods_gqa(mask):
    """b is the sequence's index, q_idx and kv_idx positions within it; an empty sequence and lengths off the
    16-row blocks; dq, dk, dv and the captured bias's gradient."""
    lens_q, lens_k = [13, 0, 21, 5], [17, 3, 21, 9]
    q, k, v, do, kw = _packed(lens_q, lens_k, hq=4, hkv=2)
    bias, score_mod, mask_mod = _mods(4, len(lens_q))
    out = fagen.attention(q, k, v, mask=mask, score_mod=score_mod, mask_mod=mask_mod, **kw)
    grads = torch.autograd.grad(out, (q, k, v, bias), do)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, bias)]
    ref_score = lambda s, b, h, qi, ki: score_mod(s, b, h, qi, ki) - bias[h, qi - ki + 64] + leaves[3][h, qi - ki + 64]  # noqa: E731
    want, _ = reference.packed_attention(*leaves[:3], kw["cu_seqlens_q"].cpu(), kw["cu_seqlens_k"].cpu(), mask=mask,
                                         score_mod=ref_score, mask_mod=mask_mod)
    _close("out", out, want, TOL[torch.float32])
    for name, got, ref in zip(("dq", "dk", "dv", "dbias"), grads, torch.autograd.grad(want, leaves, do.double())):
        _close(name, got, ref, 4 * TOL[torch.float32])


def test_varlen_module_lse_and_empty_rows_fp16():
    """The module's own forward: lse [Hq, total_q] per sequence, and rows the mask_mod hides entirely give out = 0,
    lse = -inf (fp16, no GQA, mask_mod only)."""
    lens = [19, 7, 30]
    q, k, v, _, kw = _packed(lens, lens, hq=2, hkv=2, dtype=torch.float16)

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= 3 + b) & (kv_idx <= q_idx)

    spec = fagen.KernelSpec(head_dim=32, dtype="fp16", layout="varlen", direction="bwd", mask_mod="((q_idx >= (3 + b)) & (kv_idx <= q_idx))")
    module = fagen.load(spec)
    out, lse = module.forward(q.detach(), k.detach(), v.detach(), mods={}, **kw)
    want, want_lse = reference.packed_attention(q.double(), k.double(), v.double(), kw["cu_seqlens_q"].cpu(),
                                                kw["cu_seqlens_k"].cpu(), mask_mod=mask_mod)
    _close("out", out, want, TOL[torch.float16])
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse.to(lse.device)))
    _close("lse", lse.nan_to_num(neginf=0), want_lse.nan_to_num(neginf=0), 1e-3)
    assert out[:3].abs().max() == 0 and out[19:20].abs().max() == 0  # sequence 1 hides rows 0..3


def test_varlen_refusals_are_one_line():
    lens = [5, 9]
    q, k, v, _, kw = _packed(lens, lens, hq=2, hkv=2)
    _, _, mask_mod = _mods(2, 2)
    bm = fagen.create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, 16, 16, device=DEVICE)
    with pytest.raises(AttentionError, match="^block_mask: not supported with packed sequences"):
        fagen.attention(q, k, v, mask_mod=lambda b, h, qi, ki: qi >= ki, block_mask=bm, **kw)
    with pytest.raises(AttentionError, match="^varlen: pass cu_seqlens_q, cu_seqlens_k, max_seqlen_q"):
        fagen.attention(q, k, v, mask_mod=mask_mod, cu_seqlens_q=kw["cu_seqlens_q"])
