"""Float64 reference attention, written from the contract alone; it shares no code with the kernels."""

from __future__ import annotations

import torch

from fagen.spec.axes import Mask
from fagen.verify.mods_reference import mask_mod_visible, score_mod_scores


def ancestors_from_parents(parents: torch.Tensor) -> torch.Tensor:
    """bool [B, N, N]: entry [b, i, j] is True iff j is i or an ancestor of i (parents: -1 marks a root)."""
    b, n = parents.shape
    out = torch.zeros(b, n, n, dtype=torch.bool)
    for bi in range(b):
        for i in range(n):
            j = i
            while j >= 0:
                out[bi, i, j] = True
                j = int(parents[bi, j])
    return out.to(parents.device)


def aligned_rows(batch: int, seq_q: int, seq_k: int, seqlens_q=None, seqlens_k=None, device="cpu"):
    """i_aligned = i + len_k - len_q per sequence (bottom-right, as causal), int64 [B, Sq, 1]."""
    i = torch.arange(seq_q, device=device).view(1, -1, 1).expand(batch, -1, -1)
    if seqlens_q is None:
        return i + (seq_k - seq_q)
    return i + (seqlens_k.to(device).long() - seqlens_q.to(device).long()).view(-1, 1, 1)


def visible(mask: Mask | str, batch: int, seq_q: int, seq_k: int, *, seqlens_q=None, seqlens_k=None,
            tree_mask=None, window=None, device="cpu") -> torch.Tensor:
    """Dense bool [B, Sq, Sk]: may query i of batch entry b see key j? window (left, right), None for no bound
    on a side: also i_aligned - left <= j <= i_aligned + right."""
    vis = _visible(mask, batch, seq_q, seq_k, seqlens_q=seqlens_q, seqlens_k=seqlens_k, tree_mask=tree_mask,
                   device=device)
    if window is not None:
        left, right = window
        j = torch.arange(seq_k, device=device).view(1, 1, -1)
        ia = aligned_rows(batch, seq_q, seq_k, seqlens_q, seqlens_k, device)
        if left is not None:
            vis = vis & (j >= ia - left)
        if right is not None:
            vis = vis & (j <= ia + right)
    return vis


def _visible(mask, batch, seq_q, seq_k, *, seqlens_q, seqlens_k, tree_mask, device) -> torch.Tensor:
    mask = Mask(mask)
    i = torch.arange(seq_q, device=device).view(1, -1, 1)
    j = torch.arange(seq_k, device=device).view(1, 1, -1)
    full = torch.ones(batch, seq_q, seq_k, dtype=torch.bool, device=device)
    if mask is Mask.NONE:
        return full
    if mask is Mask.CAUSAL:  # bottom-right aligned
        return full & (j <= i + (seq_k - seq_q))
    if mask.padded:
        lq = seqlens_q.to(device).long().view(-1, 1, 1)
        lk = seqlens_k.to(device).long().view(-1, 1, 1)
        vis = (i < lq) & (j < lk)
        if mask is Mask.CAUSAL_PADDING:
            vis = vis & (j <= i + lk - lq)
        return vis
    # tree: every query sees the prefix; among the last Sq keys, only its ancestors and itself.
    prefix = seq_k - seq_q
    tree = tree_mask.to(device)
    if tree.dtype != torch.bool:
        tree = ancestors_from_parents(tree.cpu()).to(device)
    vis = (j < prefix).expand(batch, seq_q, seq_k).clone()
    vis[:, :, prefix:] = tree
    return vis


def dequantize(cache: torch.Tensor, scale, head_dim_axis: int = 1) -> torch.Tensor:
    """float64 values of a quantized KV cache (README "An fp8 KV cache"): each element times its scale, a float
    (per tensor), a tensor [Hkv] (per KV head; `head_dim_axis` is the cache's head axis) or a tensor shaped like the
    cache without its last dim (per token: one scale a row)."""
    values = cache.double()
    if scale is None:
        return values
    if isinstance(scale, torch.Tensor) and scale.dim() == values.dim() - 1 > 0:
        return values * scale.double().to(values.device)[..., None]
    if isinstance(scale, torch.Tensor):
        shape = [1] * values.dim()
        shape[head_dim_axis] = -1
        return values * scale.double().to(values.device).view(shape)
    return values * float(scale)


def attention(q, k, v, *, mask: Mask | str = Mask.NONE, scale=None, seqlens_q=None, seqlens_k=None,
              tree_mask=None, window=None, softcap=None, alibi_slopes=None, sinks=None, score_mod=None,
              mask_mod=None, mods=None, block_mask=None, k_scale=None, v_scale=None, batch_invariant=None,
              mod_positions="row", head_dim_v=None):
    """(out, lse) in float64 for the fagen contract; differentiable (autograd gives the reference gradients,
    the sinks' included when `sinks` requires grad).

    q and k are [B, H, S, D], v [B, Hkv, Sk, Dv]: out is [B, Hq, Sq, Dv] (Dv may differ from D, as MLA's 192/128),
    and the default scale is 1/sqrt(D). k_scale / v_scale (a float, or float32 [Hkv]): k and v are a quantized
    cache, dequantized first (dequantize()). batch_invariant is accepted and ignored: one sequence's result here
    never depends on the others. v None: a shared latent cache (MLA's absorbed decode, spec shared_kv): V is k's
    first head_dim_v columns, dequantized with k_scale.

    Scores, in FlashAttention-2's order: s = scale * q.k; softcap: s = cap * tanh(s / cap); ALiBi:
    s -= slope[h] * |j - i_aligned|; then the mask (and the window). A sink adds exp(sink[h]) to each valid row's
    softmax denominator: lse includes it, and a valid row that sees no key gets out = 0 and lse = sink[h].
    User mods (FlexAttention's signatures, run as written on float64 scores and int64 index tensors) come after
    the switches: s = score_mod(s, b, h, q_idx, kv_idx); mask_mod(b, h, q_idx, kv_idx) is ANDed with the mask, and
    a score the mod sets to -inf is masked too. mod_positions "row": the mods' q_idx is the query's row (the
    prefill kernels, as Flex); "absolute": its position among the keys, i + lk - lq (the decode and paged kernels).
    Rows that see no key (and have no sink), and padding rows, give out = 0 and lse = -inf. Keys that no query sees are zeroed first, so garbage
    (even NaN) in padding never reaches a valid output. No exp() ever sees -inf - -inf, so gradients stay finite.
    """
    del block_mask  # a verify problem's block mask only steers which blocks the kernels skip
    if mods is not None:  # a verify problem's captured values, with its spec's mods (fagen/verify/mods_eval.py)
        score_mod, mask_mod = mods.score_mod, mods.mask_mod
        mod_positions = getattr(mods, "positions", mod_positions)
    if v is None:
        if head_dim_v is None:
            raise ValueError("reference.attention: v=None (a shared latent cache) needs head_dim_v")
        q, k = q.double(), dequantize(k, k_scale)
        v = k[..., :head_dim_v]
    else:
        q, k, v = q.double(), dequantize(k, k_scale), dequantize(v, v_scale)
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    gqa = hq // hkv
    scale = d ** -0.5 if scale is None else scale
    if mod_positions == "absolute":
        score_mod, mask_mod = _absolute(score_mod, mask_mod, b, sq, sk, seqlens_q, seqlens_k, q.device)
    elif mod_positions != "row":
        raise ValueError(f"mod_positions: 'row' or 'absolute', got {mod_positions!r}")
    vis = visible(mask, b, sq, sk, seqlens_q=seqlens_q, seqlens_k=seqlens_k, tree_mask=tree_mask, window=window,
                  device=q.device).unsqueeze(1)  # [B, 1, Sq, Sk], broadcast over heads
    seen_key = vis.any(dim=2, keepdim=True).transpose(-1, -2)  # [B, 1, Sk, 1]
    k = torch.where(seen_key, k, 0.0).repeat_interleave(gqa, dim=1)  # query head h reads KV head h // gqa
    v = torch.where(seen_key, v, 0.0).repeat_interleave(gqa, dim=1)
    q = torch.where(vis.any(dim=3, keepdim=True), q, 0.0)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if alibi_slopes is not None:
        dist = (torch.arange(sk, device=q.device).view(1, 1, -1)
                - aligned_rows(b, sq, sk, seqlens_q, seqlens_k, q.device)).abs().unsqueeze(1)  # [B, 1, Sq, Sk]
        s = s - alibi_slopes.double().view(1, -1, 1, 1) * dist
    vis = vis.expand(b, hq, sq, sk)
    if score_mod is not None:
        s = score_mod_scores(score_mod, s)
        vis = vis & ~torch.isneginf(s)
    if mask_mod is not None:
        vis = vis & mask_mod_visible(mask_mod, b, hq, sq, sk, q.device)
    if sinks is not None:  # one more column per row: the sink logit, seen by every valid (non-padding) row
        rows_ok = torch.arange(sq, device=q.device).view(1, 1, -1, 1)
        rows_ok = rows_ok < (seqlens_q.to(q.device).long().view(-1, 1, 1, 1) if seqlens_q is not None else sq)
        s = torch.cat([s, sinks.double().view(1, -1, 1, 1).expand(b, hq, sq, 1)], -1)
        vis = torch.cat([vis, rows_ok.expand(b, hq, sq, 1)], -1)
    row_any = vis.any(dim=-1)  # [B, Hq, Sq]
    lse_finite = torch.logsumexp(torch.where(row_any.unsqueeze(-1), torch.where(vis, s, float("-inf")), 0.0), -1)
    p = torch.where(vis, torch.exp(torch.where(vis, s, 0.0) - lse_finite.unsqueeze(-1)), 0.0)
    out = torch.matmul(p[..., :sk], v)
    lse = torch.where(row_any, lse_finite, float("-inf"))
    return out, lse


def _absolute(score_mod, mask_mod, batch, seq_q, seq_k, seqlens_q, seqlens_k, device):
    """The mods seeing q_idx + lk[b] - lq[b] (Sk - Sq without lengths) in place of the row q_idx."""
    lq = seqlens_q.to(device).long() if seqlens_q is not None else torch.full((batch,), seq_q, device=device)
    lk = seqlens_k.to(device).long() if seqlens_k is not None else torch.full((batch,), seq_k, device=device)
    shift = lk - lq
    score = None if score_mod is None else (lambda s, b, h, qi, ki: score_mod(s, b, h, qi + shift[b], ki))
    mask = None if mask_mod is None else (lambda b, h, qi, ki: mask_mod(b, h, qi + shift[b], ki))
    return score, mask


def sequence_mods(score_mod, mask_mod, b0: int):
    """The mods of sequence b0 run alone as batch entry 0: they see b = b0 (also fagen/verify/layouts.py's)."""
    score = None if score_mod is None else (lambda s, b, h, qi, ki: score_mod(s, b + b0, h, qi, ki))
    mask = None if mask_mod is None else (lambda b, h, qi, ki: mask_mod(b + b0, h, qi, ki))
    return score, mask


def packed_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, *, score_mod=None, mask_mod=None,
                     mod_positions="row", **kw):
    """float64 (out [total_q, Hq, Dv], lse [Hq, total_q]) of packed sequences (README "Layouts"), differentiable:
    each sequence b (q rows cu_seqlens_q[b] .. cu_seqlens_q[b+1], k/v rows cu_seqlens_k[b] ..) runs alone through
    attention() with its own lengths; the mods see b (the sequence's index) and positions within the sequence.
    kw: attention()'s other keywords (mask "none" or "causal", scale, the score switches)."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    outs, lses = [], []
    for b in range(len(cq) - 1):
        qb, kb, vb = (t[lo:hi].transpose(0, 1)[None] for t, lo, hi in ((q, cq[b], cq[b + 1]), (k, ck[b], ck[b + 1]),
                                                                        (v, ck[b], ck[b + 1])))
        smod, mmod = sequence_mods(score_mod, mask_mod, b)
        o, lse = attention(qb, kb, vb, score_mod=smod, mask_mod=mmod, mod_positions=mod_positions, **kw)
        outs.append(o[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)
