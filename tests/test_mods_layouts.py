"""User mods on the varlen, decode and paged layouts (README "User mods"): each kernel against the float64
reference running the user's own functions (fagen/verify/reference.py: packed_attention for packed sequences,
mod_positions="absolute" for the decode and paged kernels). CPU interpreter, tiny shapes, lengths that are not
multiples of the blocks, GQA, a captured bias (with its gradient), a captured document-id tensor, closure numbers."""

import pytest
import torch

import fagen
from _env import DEVICE
from mods_kernel import TOL
from fagen.runtime.resolve import AttentionError
from fagen.verify import reference
from fagen.verify.layouts import cu_seqlens


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
    err = (got.double().cpu() - want.double().cpu()).abs().max().item() if got.numel() else 0.0
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


def test_varlen_with_a_block_mask_skips_blocks_and_matches():
    """A block mask built for (B sequences, H, max_seqlen_q, max_seqlen_k): the same results with and without it,
    forward and backward, blocks of 16 (so whole blocks are empty, full and cut), lengths off the blocks."""
    lens_q, lens_k = [40, 0, 57, 9], [45, 6, 57, 30]
    q, k, v, do, kw = _packed(lens_q, lens_k, hq=4, hkv=2)
    gen = torch.Generator().manual_seed(29)
    doc = (torch.rand(4, 64, generator=gen) < 0.08).cumsum(1).to(DEVICE, torch.int32)

    def mask_mod(b, h, q_idx, kv_idx):
        return ((doc[b, q_idx] == doc[b, kv_idx]) & (q_idx - kv_idx < 20 + 4 * h)) | (kv_idx == 0)

    bm = fagen.create_block_mask(mask_mod, 4, 4, max(lens_q), max(lens_k), device=DEVICE, block_size=16)
    assert 0 < bm.sparsity() < 1 and (bm.classes == 2).any()
    out = fagen.attention(q, k, v, mask="causal", mask_mod=mask_mod, block_mask=bm, **kw)
    grads = torch.autograd.grad(out, (q, k, v), do)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want, _ = reference.packed_attention(*leaves, kw["cu_seqlens_q"].cpu(), kw["cu_seqlens_k"].cpu(), mask="causal",
                                         mask_mod=mask_mod)
    _close("out", out, want, TOL[torch.float32])
    for name, got, ref in zip(("dq", "dk", "dv"), grads, torch.autograd.grad(want, leaves, do.double())):
        _close(name, got, ref, 4 * TOL[torch.float32])


def test_layout_refusals_are_one_line():
    lens = [5, 9]
    q, k, v, _, kw = _packed(lens, lens, hq=2, hkv=2)
    _, _, mask_mod = _mods(2, 2)
    causal = lambda b, h, qi, ki: qi >= ki  # noqa: E731
    bm = fagen.create_block_mask(causal, None, None, 300, 300, device=DEVICE)
    with pytest.raises(AttentionError, match="^block_mask: built for Sq=300, Sk=300, but q and k have Sq=9, Sk=9 "
                                             r"\(varlen: max_seqlen_q, max_seqlen_k\)"):
        fagen.attention(q, k, v, mask_mod=causal, block_mask=bm, **kw)
    with pytest.raises(AttentionError, match="^varlen: pass cu_seqlens_q, cu_seqlens_k, max_seqlen_q"):
        fagen.attention(q, k, v, mask_mod=mask_mod, cu_seqlens_q=kw["cu_seqlens_q"])
    module = fagen.load(fagen.KernelSpec(head_dim=32, dtype="fp32", layout="varlen", mask_mod="(q_idx >= kv_idx)"))
    with pytest.raises(ValueError, match="^block_mask: classes of shape .* do not fit 2 sequences of at most 9 "
                                         "queries and 9 keys"):
        module.forward(q, k, v, mods={}, block_mask=bm, **kw)
    spec = fagen.KernelSpec(head_dim=32, dtype="fp32", layout="paged", mask_mod="(q_idx >= kv_idx)")
    k_cache, v_cache, table = _paged_cache([k[:5].detach().cpu(), k[5:].detach().cpu()],
                                           [v[:5].detach().cpu(), v[5:].detach().cpu()], 4)
    with pytest.raises(ValueError, match="^block_mask: not supported on the paged layout yet; pass block_mask=None"):
        fagen.load(spec).forward(q.detach(), k_cache, v_cache, cu_seqlens_q=kw["cu_seqlens_q"], max_seqlen_q=9,
                                 block_table=table, seqlens_k=torch.tensor(lens, device=DEVICE), mods={},
                                 block_mask=bm)


# -- decode and paged: the mods see q_idx = i + lk - lq, the query's position among its sequence's keys ------------
_SCORE = "((score * temp) + bias[h, ((q_idx - kv_idx) + 128)])"
_MASK = "((doc[b, q_idx] == doc[b, kv_idx]) | ((q_idx - kv_idx) < reach))"
_DECLS = dict(mod_tensors=[["bias", "fp32", 2], ["doc", "i32", 2]], mod_scalars=[["reach", "int"], ["temp", "float"]])


def _spec(**kw):
    return fagen.KernelSpec(head_dim=32, dtype="fp32", score_mod=_SCORE, mask_mod=_MASK, **_DECLS, **kw)


def _values(hq, batch, seed=3, reach=9, temp=0.7):
    """The captured values of _SCORE/_MASK (mods=), and the same functions in Python for the reference."""
    gen = torch.Generator().manual_seed(seed)
    bias = torch.randn(hq, 256, generator=gen).to(DEVICE)
    doc = torch.randint(0, 3, (batch, 128), generator=gen).sort(dim=1).values.to(DEVICE, torch.int32)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score * temp + bias[h, q_idx - kv_idx + 128]

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc[b, q_idx] == doc[b, kv_idx]) | (q_idx - kv_idx < reach)

    return dict(bias=bias, doc=doc, reach=reach, temp=temp), dict(score_mod=score_mod, mask_mod=mask_mod)


def _paged_cache(ks, vs, page, seed=5):
    """Each sequence's keys on shuffled pages of a cache whose unused slots hold NaN; (k_cache, v_cache, table)."""
    gen = torch.Generator().manual_seed(seed)
    hkv, d = ks[0].shape[1:]
    n_pages = [-(-k.shape[0] // page) for k in ks]
    total = sum(n_pages) + 2
    order = torch.randperm(total, generator=gen)
    table = torch.full((len(ks), max(n_pages) + 1), -1, dtype=torch.int32)
    k_cache, v_cache = (torch.full((total, page, hkv, d), float("nan")) for _ in range(2))
    nxt = 0
    for b, n in enumerate(n_pages):
        table[b, :n] = order[nxt:nxt + n]
        nxt += n
        rows, slot = table[b, torch.arange(ks[b].shape[0]) // page].long(), torch.arange(ks[b].shape[0]) % page
        k_cache[rows, slot], v_cache[rows, slot] = ks[b], vs[b]
    return k_cache.to(DEVICE), v_cache.to(DEVICE), table.to(DEVICE)


@pytest.mark.parametrize("gqa, sq", [(2, 1), (4, 5)])  # 2 rows a tile (multiply-sum) and 20 rows (tl.dot)
def test_dense_decode_with_both_mods_every_split_count(gqa, sq):
    b, hkv, sk = 2, 2, 77
    gen = torch.Generator().manual_seed(gqa)
    q = torch.randn(b, gqa * hkv, sq, 32, generator=gen).to(DEVICE)
    k, v = (torch.randn(b, hkv, sk, 32, generator=gen).to(DEVICE) for _ in range(2))
    module = fagen.load(_spec(kind="decode", mask="causal", gqa=gqa))
    values, fns = _values(gqa * hkv, b)
    want, want_lse = reference.attention(q.double(), k.double(), v.double(), mask="causal", mod_positions="absolute",
                                         **fns)
    for splits in (1, 3):
        out, lse = module.forward_split(q, k, v, mods=values, num_splits=splits)
        _close(f"out ({splits} splits)", out, want, TOL[torch.float32])
        _close(f"lse ({splits} splits)", lse, want_lse, TOL[torch.float32])
    out, lse = module.plan(b, gqa * hkv, sq, sk, device=DEVICE, num_splits=2).run(q, k, v, mods=values)
    _close("out (plan)", out, want, TOL[torch.float32])
    out, lse = module.forward(q, k, v, mods=values, batch_invariant=True)
    _close("out (batch invariant)", out, want, TOL[torch.float32])
    out, _ = module.forward(q, k, v, mods=dict(values, reach=2, temp=1.3))  # changed closure numbers: same kernel
    values, fns = _values(gqa * hkv, b, reach=2, temp=1.3)
    want, _ = reference.attention(q.double(), k.double(), v.double(), mask="causal", mod_positions="absolute", **fns)
    _close("out (new numbers)", out, want, TOL[torch.float32])


def test_padded_decode_aligns_q_idx_per_sequence_and_empty_rows():
    """causal+padding: q_idx = i + lk[b] - lq[b]; a mask_mod that hides every key of a row gives 0 and -inf."""
    b, hq, sq, sk = 3, 2, 4, 40
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(b, hq, sq, 32, generator=gen).to(DEVICE)
    k, v = (torch.randn(b, hq, sk, 32, generator=gen).to(DEVICE) for _ in range(2))
    lens_q, lens_k = torch.tensor([4, 2, 3], device=DEVICE), torch.tensor([40, 17, 3], device=DEVICE)
    spec = fagen.KernelSpec(head_dim=32, dtype="fp32", kind="decode", mask="causal+padding",
                            mask_mod="((q_idx != 15) & (kv_idx >= (q_idx - 6)))")
    out, lse = fagen.load(spec).forward(q, k, v, seqlens_q=lens_q, seqlens_k=lens_k, mods={})
    want, want_lse = reference.attention(q.double(), k.double(), v.double(), mask="causal+padding",
                                         seqlens_q=lens_q, seqlens_k=lens_k, mod_positions="absolute",
                                         mask_mod=lambda b, h, qi, ki: (qi != 15) & (ki >= qi - 6))
    _close("out", out, want, TOL[torch.float32])
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse.to(lse.device)))
    assert out[1, :, 0].abs().max() == 0 and torch.isneginf(lse[1, :, 0]).all()  # sequence 1's row 0 is key 15


def test_paged_decode_with_both_mods_gqa():
    lens, sq, hkv, gqa, page = [37, 0, 70, 5], 2, 2, 2, 8
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(len(lens), gqa * hkv, sq, 32, generator=gen).to(DEVICE)
    ks, vs = ([torch.randn(n, hkv, 32, generator=gen) for n in lens] for _ in range(2))
    k_cache, v_cache, table = _paged_cache(ks, vs, page)
    module = fagen.load(_spec(kind="decode", layout="paged", mask="causal", gqa=gqa))
    values, fns = _values(gqa * hkv, len(lens))
    out, lse = module.forward(q, k_cache, v_cache, block_table=table, seqlens_k=torch.tensor(lens, device=DEVICE),
                              mods=values)
    for b in range(len(lens)):
        if lens[b] < sq:  # causal rows past an empty cache see nothing
            assert out[b].abs().max() == 0 and torch.isneginf(lse[b]).all()
            continue
        score_mod = lambda s, bb, h, qi, ki, b=b: fns["score_mod"](s, bb + b, h, qi, ki)  # noqa: E731
        mask_mod = lambda bb, h, qi, ki, b=b: fns["mask_mod"](bb + b, h, qi, ki)  # noqa: E731
        want, want_lse = reference.attention(q[b:b + 1].double(), ks[b].transpose(0, 1)[None].to(DEVICE).double(),
                                             vs[b].transpose(0, 1)[None].to(DEVICE).double(), mask="causal",
                                             mod_positions="absolute", score_mod=score_mod, mask_mod=mask_mod)
        _close(f"out (sequence {b})", out[b], want[0], TOL[torch.float32])
        _close(f"lse (sequence {b})", lse[b], want_lse[0], TOL[torch.float32])


def test_paged_prefill_with_both_mods_gqa():
    """Chunked prefill on a paged cache: each sequence's lens_q new queries are its last lens_q cached keys."""
    lens_q, lens_k, hkv, gqa, page = [11, 0, 40, 3], [37, 0, 40, 5], 2, 2, 8
    gen = torch.Generator().manual_seed(13)
    q = torch.randn(sum(lens_q), gqa * hkv, 32, generator=gen).to(DEVICE)
    ks, vs = ([torch.randn(n, hkv, 32, generator=gen) for n in lens_k] for _ in range(2))
    k_cache, v_cache, table = _paged_cache(ks, vs, page)
    module = fagen.load(_spec(layout="paged", mask="causal", gqa=gqa, block_m=16, block_n=16))
    values, fns = _values(gqa * hkv, len(lens_q))
    cu_q = cu_seqlens(lens_q, DEVICE)
    out, lse = module.forward(q, k_cache, v_cache, cu_seqlens_q=cu_q, max_seqlen_q=max(lens_q), block_table=table,
                              seqlens_k=torch.tensor(lens_k, device=DEVICE), mods=values)
    want, want_lse = reference.packed_attention(q.double(), torch.cat(ks).to(DEVICE).double(),
                                                torch.cat(vs).to(DEVICE).double(), cu_q.cpu(),
                                                cu_seqlens(lens_k, "cpu"), mask="causal", mod_positions="absolute",
                                                **fns)
    _close("out", out, want, TOL[torch.float32])
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse.to(lse.device)))
    _close("lse", lse.nan_to_num(neginf=0), want_lse.nan_to_num(neginf=0), TOL[torch.float32])


def test_varlen_mods_compose_with_the_score_switches():
    """softcap and ALiBi (per-sequence alignment), then the score_mod; the window ANDed with the mask_mod."""
    lens_q, lens_k = [9, 26], [30, 26]
    q, k, v, do, kw = _packed(lens_q, lens_k, hq=2, hkv=1)
    slopes = torch.tensor([0.3, 0.1], device=DEVICE)
    switches = dict(softcap=6.0, alibi_slopes=slopes, window=(7, 2))

    def score_mod(score, b, h, q_idx, kv_idx):
        return score - 0.05 * (q_idx + kv_idx) + b

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx % 5) != (h + b)

    out = fagen.attention(q, k, v, mask="causal", score_mod=score_mod, mask_mod=mask_mod, **switches, **kw)
    grads = torch.autograd.grad(out, (q, k, v), do)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want, _ = reference.packed_attention(*leaves, kw["cu_seqlens_q"].cpu(), kw["cu_seqlens_k"].cpu(), mask="causal",
                                         score_mod=score_mod, mask_mod=mask_mod, **switches)
    _close("out", out, want, TOL[torch.float32])
    for name, got, ref in zip(("dq", "dk", "dv"), grads, torch.autograd.grad(want, leaves, do.double())):
        _close(name, got, ref, 4 * TOL[torch.float32])


def test_decode_mods_compose_with_switches_and_sinks():
    b, hq, sq, sk = 2, 2, 3, 50
    gen = torch.Generator().manual_seed(17)
    q = torch.randn(b, hq, sq, 32, generator=gen).to(DEVICE)
    k, v = (torch.randn(b, hq, sk, 32, generator=gen).to(DEVICE) for _ in range(2))
    sinks = torch.tensor([0.5, -1.0], device=DEVICE)
    spec = fagen.KernelSpec(head_dim=32, dtype="fp32", kind="decode", mask="causal", softcap=True, window=True,
                            sinks=True, score_mod="(score + (0.01 * (q_idx - kv_idx)))",
                            mask_mod="((kv_idx % 4) != 1)")
    out, lse = fagen.load(spec).forward_split(q, k, v, softcap=8.0, window=(20, 0), sinks=sinks, mods={},
                                              num_splits=2)
    want, want_lse = reference.attention(q.double(), k.double(), v.double(), mask="causal", softcap=8.0,
                                         window=(20, 0), sinks=sinks, mod_positions="absolute",
                                         score_mod=lambda s, b, h, qi, ki: s + 0.01 * (qi - ki),
                                         mask_mod=lambda b, h, qi, ki: (ki % 4) != 1)
    _close("out", out, want, TOL[torch.float32])
    _close("lse", lse, want_lse, TOL[torch.float32])


def test_paged_tree_decode_with_a_mask_mod():
    """Tree verification on a paged cache: the Sq draft nodes are the last Sq keys; the mask_mod sees them there."""
    lens, sq, page = [20, 9], 4, 4
    gen = torch.Generator().manual_seed(19)
    q = torch.randn(len(lens), 2, sq, 32, generator=gen).to(DEVICE)
    ks, vs = ([torch.randn(n, 2, 32, generator=gen) for n in lens] for _ in range(2))
    k_cache, v_cache, table = _paged_cache(ks, vs, page)
    tree = reference.ancestors_from_parents(torch.tensor([[-1, 0, 0, 1], [-1, 0, 1, -1]]))
    spec = fagen.KernelSpec(head_dim=32, dtype="fp32", kind="decode", layout="paged", mask="tree",
                            mask_mod="((q_idx - kv_idx) != 2)")
    out, lse = fagen.load(spec).forward(q, k_cache, v_cache, block_table=table, tree_mask=tree.to(DEVICE),
                                        seqlens_k=torch.tensor(lens, device=DEVICE), mods={})
    for b in range(len(lens)):
        want, want_lse = reference.attention(q[b:b + 1].double(), ks[b].transpose(0, 1)[None].to(DEVICE).double(),
                                             vs[b].transpose(0, 1)[None].to(DEVICE).double(), mask="tree",
                                             tree_mask=tree[b:b + 1].to(DEVICE), mod_positions="absolute",
                                             mask_mod=lambda bb, h, qi, ki: (qi - ki) != 2)
        _close(f"out (sequence {b})", out[b], want[0], TOL[torch.float32])
        _close(f"lse (sequence {b})", lse[b], want_lse[0], TOL[torch.float32])


# -- fagen verify: the layouts' search draws captured values for modded specs ----------------------------------------
_VERIFY = dict(score_mod="((cap * tanh((score / cap))) + bias[h, ((q_idx - kv_idx) + 40)])",
               mask_mod="((doc[b, q_idx] == doc[b, kv_idx]) | (kv_idx < n))",
               mod_tensors=[["bias", "fp32", 2], ["doc", "i32", 2]], mod_scalars=[["cap", "float"], ["n", "int"]])


@pytest.mark.parametrize("fields", [dict(layout="varlen", direction="bwd", mask="causal"),
                                    dict(layout="paged", kind="decode", mask="causal"),
                                    dict(layout="paged", mask="causal", block_m=16, block_n=16)],
                         ids=["varlen-bwd", "paged-decode", "paged-prefill"])
def test_verify_layout_spec_runs_the_mods(fields):
    from fagen.verify.layouts import verify_layout_spec

    spec = fagen.KernelSpec(head_dim=16, dtype="fp32", gqa=2, **_VERIFY, **fields)
    verdicts = verify_layout_spec(spec, examples=2, seed=1, device=DEVICE, scale="cpu")
    assert verdicts and all(v.passed for v in verdicts), [v.failure for v in verdicts]
    if spec.layout is fagen.Layout.PAGED:  # a fixed case whose queries sit well past the row numbers (lk - lq > 0)
        from fagen.verify import layouts

        case = layouts.LayoutCase(lens_q=[3, 3] if spec.kind is fagen.Kind.DECODE else [5, 9], lens_k=[30, 17],
                                  heads_kv=2, page_size=4, seed=5)
        layouts.check_forward(fagen.load(spec), spec, case, DEVICE)


@pytest.mark.parametrize("name, fields", [("decode-mod-row-position", dict(kind="decode", layout="paged")),
                                          ("paged-prefill-mod-row-position", dict(layout="paged", block_m=16,
                                                                                  block_n=16))])
def test_layout_mod_mutants_are_caught(name, fields):
    from hypothesis import Phase, given, settings

    from fagen.verify import layouts
    from fagen.verify.engine import mutant_module
    from fagen.verify.tolerances import PropertyFailure

    spec = fagen.KernelSpec(head_dim=16, dtype="fp32", gqa=2, mask="causal", **_VERIFY, **fields)
    broken = mutant_module(spec, name)

    @settings(max_examples=20, database=None, report_multiple_bugs=False, phases=[Phase.generate])
    @given(layouts.cases(spec, max_len=24))
    def run(case):
        layouts.check_forward(broken, spec, case, DEVICE)

    with pytest.raises(PropertyFailure):
        run()


def test_the_decode_row_position_mutant_is_caught_on_the_dense_layout():
    from fagen.verify.engine import mutant_module

    gen = torch.Generator().manual_seed(23)
    q = torch.randn(2, 4, 3, 32, generator=gen).to(DEVICE)
    k, v = (torch.randn(2, 2, 50, 32, generator=gen).to(DEVICE) for _ in range(2))
    broken = mutant_module(_spec(kind="decode", mask="causal", gqa=2), "decode-mod-row-position")
    values, fns = _values(4, 2)
    out, _ = broken.forward(q, k, v, mods=values)
    want, _ = reference.attention(q.double(), k.double(), v.double(), mask="causal", mod_positions="absolute", **fns)
    assert (out.double() - want.to(out.device)).abs().max().item() > 1e-2


def test_decode_mods_take_a_v_head_dim_of_their_own_and_prefill_refuses_it():
    """MLA-shaped decode (v's head dim 16 against q/k's 32) with a score_mod; prefill mods name head_dim_v."""
    gen = torch.Generator().manual_seed(31)
    q = torch.randn(2, 4, 2, 32, generator=gen).to(DEVICE)
    k = torch.randn(2, 2, 40, 32, generator=gen).to(DEVICE)
    v = torch.randn(2, 2, 40, 16, generator=gen).to(DEVICE)
    spec = fagen.KernelSpec(head_dim=32, head_dim_v=16, gqa=2, dtype="fp32", kind="decode", mask="causal",
                            score_mod="(score - (0.1 * abs((q_idx - kv_idx))))")
    out, lse = fagen.load(spec).forward_split(q, k, v, mods={}, num_splits=2)
    want, want_lse = reference.attention(q.double(), k.double(), v.double(), mask="causal", mod_positions="absolute",
                                         score_mod=lambda s, b, h, qi, ki: s - 0.1 * (qi - ki).abs())
    _close("out", out, want, TOL[torch.float32])
    _close("lse", lse, want_lse, TOL[torch.float32])
    with pytest.raises(fagen.SpecError, match="^head_dim_v: .*prefill kernels take one head dim"):
        fagen.KernelSpec(head_dim=32, head_dim_v=16, score_mod="(score * 2.0)")


@pytest.mark.parametrize("mask", ["none", "padding", "tree"])
def test_dense_decode_mods_with_the_other_builtin_masks(mask):
    b, hq, sq, sk = 2, 4, 4, 37
    gen = torch.Generator().manual_seed(37)
    q = torch.randn(b, hq, sq, 32, generator=gen).to(DEVICE)
    k, v = (torch.randn(b, 2, sk, 32, generator=gen).to(DEVICE) for _ in range(2))
    kw = {}
    if mask == "padding":
        kw = dict(seqlens_q=torch.tensor([4, 3], device=DEVICE), seqlens_k=torch.tensor([37, 20], device=DEVICE))
    if mask == "tree":
        kw = dict(tree_mask=reference.ancestors_from_parents(torch.tensor([[-1, 0, 1, 0], [-1, -1, 1, 2]])).to(DEVICE))
    values, fns = _values(hq, b)
    module = fagen.load(_spec(kind="decode", mask=mask, gqa=2))
    out, lse = module.forward_split(q, k, v, mods=values, num_splits=2, **kw)
    want, want_lse = reference.attention(q.double(), k.double(), v.double(), mask=mask, mod_positions="absolute",
                                         **kw, **fns)
    _close("out", out, want, TOL[torch.float32])
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse.to(lse.device)))
    _close("lse", lse.nan_to_num(neginf=0), want_lse.nan_to_num(neginf=0), TOL[torch.float32])


def test_fagen_verify_on_a_modded_dense_decode_spec_passes_and_catches_the_row_position_mutant():
    from fagen.verify import engine
    from fagen.verify.mutants import LAYOUT_MOD_MUTANTS

    spec = fagen.KernelSpec(head_dim=16, dtype="fp32", gqa=2, kind="decode", mask="causal", **_VERIFY)
    report = engine.verify_specs([spec], examples=3, scale="cpu", device=DEVICE, properties=["reference"])
    assert report.passed, [r for r in report.results if not r.passed]
    mutant = next(m for m in LAYOUT_MOD_MUTANTS if m.name == "decode-mod-row-position")
    report, pairs = engine.verify_mutants([spec], mutants=[mutant], examples=8, scale="cpu", device=DEVICE,
                                          shrink_runs=0, properties=["reference"])
    assert pairs[0][1] is not None and engine.mutant_catch(report, mutant, spec) is not None


@pytest.mark.parametrize("fields", [dict(layout="paged", kind="decode"), dict(layout="varlen", direction="bwd")],
                         ids=["paged-decode", "varlen-bwd"])
def test_modded_layout_modules_compile_fullgraph(fields):
    """A module's own forward / attention with mods= traces as its operators: one graph, no break, eager's results
    (and, varlen, eager's gradients)."""
    from fagen.verify import layouts

    torch._dynamo.reset()
    spec = fagen.KernelSpec(head_dim=16, dtype="fp32", gqa=2, mask="causal", **_VERIFY, **fields)
    module = fagen.load(spec)
    lens_q = [2, 2, 2] if spec.kind is fagen.Kind.DECODE else [3, 0, 9]
    inputs = layouts.make_inputs(spec, layouts.LayoutCase(lens_q, [5, 4, 9], heads_kv=2, page_size=4, seed=3),
                                 DEVICE)
    bwd = spec.direction is fagen.Direction.BWD

    def layer(q, k, v):
        out = module.attention(q, k, v, **inputs.kwargs) if bwd else module.forward(q, k, v, **inputs.kwargs)[0]
        return out.sum(-1)

    explain = torch._dynamo.explain(layer)(*inputs.args)
    assert explain.graph_break_count == 0 and explain.graph_count == 1, explain.break_reasons
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    if not bwd:
        assert torch.equal(compiled(*inputs.args), layer(*inputs.args))
        return
    leaves, eager = ([t.clone().requires_grad_() for t in inputs.args] for _ in range(2))
    compiled(*leaves).sum().backward()
    layer(*eager).sum().backward()
    for a, b in zip(leaves, eager):
        assert torch.allclose(a.grad, b.grad, atol=1e-5, rtol=1e-5)


def test_decode_mods_on_an_fp8_cache_see_the_dequantized_score():
    gen = torch.Generator().manual_seed(41)
    q = torch.randn(2, 4, 2, 32, generator=gen).half().to(DEVICE)
    k, v = (torch.randn(2, 2, 50, 32, generator=gen).to(torch.float8_e4m3fn).to(DEVICE) for _ in range(2))
    spec = fagen.KernelSpec(head_dim=32, gqa=2, dtype="fp16", kind="decode", mask="causal", kv_dtype="fp8_e4m3",
                            score_mod="(score - (0.1 * abs((q_idx - kv_idx))))", mask_mod="((kv_idx % 3) != 1)")
    out, lse = fagen.load(spec).forward_split(q, k, v, k_scale=0.5, v_scale=2.0, mods={}, num_splits=2)
    want, want_lse = reference.attention(q.double(), k, v, k_scale=0.5, v_scale=2.0, mask="causal",
                                         mod_positions="absolute",
                                         score_mod=lambda s, b, h, qi, ki: s - 0.1 * (qi - ki).abs(),
                                         mask_mod=lambda b, h, qi, ki: (ki % 3) != 1)
    _close("out", out, want, TOL[torch.float16])
    _close("lse", lse, want_lse, 1e-4)
