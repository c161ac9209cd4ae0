"""Lab (twentieth session, issue 27): a one-kernel Triton backward for the MLA pair (d_qk 192, d_v 128).

The product's pair (fagen/templates/triton/backward.py.j2, [Note] MLA backward steps) runs a dK/dV kernel and a dQ
kernel that recomputes S and dP: 7 matmuls of work. Here the dK/dV program also forms its part of dQ from the dS^T
tile it already holds, transposed so the wgmma's M is the head dim: dQ^T_part = K^T dS^T ([192, 32] a step), and
adds it into an int32 accumulator dQacc^T [B, Hq, 192, S_pad] in fixed point ([Note] Fixed-point dQ of the Gluon
backward, docs/hopper.md issue 28): each partial is rounded to int32 in a unit fixed per row, qmul_i = 2^(30 - e),
e = ceil(log2(2 bound_i)), bound_i = max|K| (|dO_i|_2 max_j |V_j|_2 + |delta_i|), so the adds have the same bits in
any order (deterministic) and never overflow. 5 matmuls of work, then a convert kernel: dQ = scale acc / qmul.

Launches: the bound (KVB: max|K|, max_j |V_j|_2 per KV head: torch, or the Triton kernel BOUND_KERNEL), the zeroed
accumulator, the preprocess (delta, lse2 and qmul), the fused kernel, the convert.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

D_LO = tl.constexpr(128)
D_HI = tl.constexpr(64)
HEAD_DIM = 192
HEAD_DIM_V = 128
# tiles (the product's dK/dV tiles); the convert's rows a program
BLOCK_N = 128
BLOCK_M = 32
NUM_WARPS = 8
NUM_STAGES = 3
PRE_BLOCK_M = 128
CONV_BLOCK_M = 64
GROUP_PROGRAMS = tl.constexpr(128)
ATOMIC_SEM = "relaxed"


@triton.jit
def _load_rows(ptrs, rows, n_rows, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CHECK_ROWS: tl.constexpr):
    if CHECK_ROWS:
        mask = rows[:, None] < n_rows
        if BLOCK_D != HEAD_DIM:
            mask = mask & (offs_d[None, :] < HEAD_DIM)
        tile = tl.load(ptrs, mask=mask, other=0.0)
    else:
        if BLOCK_D != HEAD_DIM:
            tile = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
        else:
            tile = tl.load(ptrs)
    return tile


@triton.jit
def _round_i32(x, INTERPRET: tl.constexpr):
    """x rounded to the nearest int32, ties to even (cvt.rni.s32.f32); the interpreter: floor(x + 0.5)."""
    if INTERPRET:
        r = tl.floor(x + 0.5).to(tl.int32)
    else:
        r = tl.inline_asm_elementwise("cvt.rni.s32.f32 $0, $1;", "=r,r", [x], dtype=tl.int32, is_pure=True, pack=1)
    return r


@triton.jit(do_not_specialize=["seq_q"])
def _pre(Out, DO, Lse, Delta, Lse2, QMul, KVB, stride_ob, stride_oh, stride_om, stride_dob, stride_doh, stride_dom,
         stride_sh, num_heads, seq_q, GQA: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_M: tl.constexpr,
         UPCAST: tl.constexpr):
    """The product's preprocess (delta by the dot, [Note] Exact delta; lse2) and qmul ([Note] Fixed-point dQ)."""
    start_m = tl.program_id(0)
    off_h = tl.program_id(1)
    off_b = tl.program_id(2)
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, HEAD_DIM_V)
    o = _load_rows(Out + off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh
                   + rows[:, None] * stride_om + offs_dv[None, :], rows, seq_q, offs_dv, HEAD_DIM_V, HEAD_DIM_V, True)
    do = _load_rows(DO + off_b.to(tl.int64) * stride_dob + off_h.to(tl.int64) * stride_doh
                    + rows[:, None] * stride_dom + offs_dv[None, :], rows, seq_q, offs_dv, HEAD_DIM_V, HEAD_DIM_V,
                    True)
    if UPCAST:
        o, do = o.to(tl.float32), do.to(tl.float32)
    eye = tl.arange(0, BLOCK_M)[:, None] == tl.arange(0, BLOCK_M)[None, :]
    delta = tl.sum(tl.where(eye, tl.dot(o, tl.trans(do)), 0.0), 1)
    head = off_b * num_heads + off_h
    lse = tl.load(Lse + head.to(tl.int64) * seq_q + rows, mask=rows < seq_q, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    tl.store(Delta + head.to(tl.int64) * stride_sh + rows, delta)
    tl.store(Lse2 + head.to(tl.int64) * stride_sh + rows, lse2)
    dof = do.to(tl.float32)
    dn = tl.sqrt(tl.sum(dof * dof, 1))
    kvh = off_b * (num_heads // GQA) + off_h // GQA
    kb = tl.load(KVB + kvh * 2)
    vb = tl.load(KVB + kvh * 2 + 1)
    raw = 2.0 * kb * (dn * vb + tl.abs(delta))
    e = tl.minimum(tl.maximum(tl.ceil(tl.log2(tl.maximum(raw, 1e-30))), -96.0), 96.0).to(tl.int32)
    qm = ((157 - e) << 23).to(tl.float32, bitcast=True)  # 2^(30 - e), exactly
    tl.store(QMul + head.to(tl.int64) * stride_sh + rows, tl.where(raw < float("inf"), qm, float("nan")))


@triton.jit
def _inner(dk, dv, k, v, dk2, k2, offs_d2, q_base, do_base, lse_base, delta_base, qm_base, acc_base, DescLo, DescHi,
           acc_row, stride_qh,
           stride_qm, stride_doh, stride_dom, stride_sh, stride_ah, qk_scale, cols, offs_m, offs_d, offs_dv, lo, hi,
           len_q, len_k, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_M: tl.constexpr,
           GQA: tl.constexpr, MASKED: tl.constexpr, UPCAST: tl.constexpr, SEM: tl.constexpr, CAUSAL: tl.constexpr,
           TMA_ADD: tl.constexpr):
    shift = len_k - len_q
    steps = (hi - lo + BLOCK_M - 1) // BLOCK_M
    for it in range(0, GQA * steps):
        if GQA == 1:
            start_m = lo + it * BLOCK_M
            q_head, do_head, lse_head, delta_head, qm_head, acc_head = (q_base, do_base, lse_base, delta_base,
                                                                       qm_base, acc_base)
            row_head = acc_row
        else:
            g = it // steps
            start_m = lo + (it - g * steps) * BLOCK_M
            q_head = q_base + g.to(tl.int64) * stride_qh
            do_head = do_base + g.to(tl.int64) * stride_doh
            lse_head = lse_base + g.to(tl.int64) * stride_sh
            delta_head = delta_base + g.to(tl.int64) * stride_sh
            qm_head = qm_base + g.to(tl.int64) * stride_sh
            acc_head = acc_base + g.to(tl.int64) * stride_ah
            row_head = acc_row + g * HEAD_DIM
        start_m = tl.multiple_of(start_m, BLOCK_M)
        rows = start_m + offs_m
        q = _load_rows(q_head + rows[:, None] * stride_qm + offs_d[None, :], rows, len_q, offs_d, D_LO, D_LO, MASKED)
        q2 = _load_rows(q_head + rows[:, None] * stride_qm + offs_d2[None, :], rows, len_q, offs_d2, HEAD_DIM,
                        D_LO + D_HI, MASKED)
        do = _load_rows(do_head + rows[:, None] * stride_dom + offs_dv[None, :], rows, len_q, offs_dv, HEAD_DIM_V,
                        HEAD_DIM_V, MASKED)
        if UPCAST:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
            q2 = q2.to(tl.float32)
        lse2 = tl.load(lse_head + rows)
        delta = tl.load(delta_head + rows)
        qk_t = tl.dot(k, tl.trans(q))
        qk_t = tl.dot(k2, tl.trans(q2), qk_t)
        dp_t = tl.dot(v, tl.trans(do))
        qk_t = qk_t * qk_scale
        if MASKED:
            if CAUSAL:
                qk_t = tl.where((cols[:, None] < len_k) & (cols[:, None] <= rows[None, :] + shift), qk_t, float("-inf"))
            else:
                qk_t = tl.where(cols[:, None] < len_k, qk_t, float("-inf"))
        p_t = tl.math.exp2(qk_t - lse2[None, :])
        dv += tl.dot(p_t.to(do.dtype), do)
        ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)
        dk += tl.dot(ds_t, q)
        dk2 += tl.dot(ds_t, q2)
        # dQ^T part = K^T dS^T: [192, BLOCK_M], rounded to the rows' units and added ([Note] Fixed-point dQ)
        qm = tl.load(qm_head + rows)
        dq_t = tl.dot(tl.trans(k), ds_t)
        if TMA_ADD and not UPCAST:  # the TMA unit's int32 reduce-add (none in the interpreter: pointer adds there)
            DescLo.atomic_add([row_head, start_m], _round_i32(dq_t * qm[None, :], UPCAST))
        else:
            tl.atomic_add(acc_head + offs_d[:, None] * stride_sh + rows[None, :],
                          _round_i32(dq_t * qm[None, :], UPCAST), sem=SEM)
        dq2_t = tl.dot(tl.trans(k2), ds_t)
        if TMA_ADD and not UPCAST:
            DescHi.atomic_add([row_head + D_LO, start_m], _round_i32(dq2_t * qm[None, :], UPCAST))
        else:
            tl.atomic_add(acc_head + offs_d2[:, None] * stride_sh + rows[None, :],
                          _round_i32(dq2_t * qm[None, :], UPCAST), mask=offs_d2[:, None] < HEAD_DIM, sem=SEM)
    return dk, dv, dk2


@triton.jit(do_not_specialize=["seq_q", "seq_k"])
def _fused(Q, K, V, DO, DK, DV, Lse2, Delta, QMul, DQacc, DescLo, DescHi, qk_scale, scale,
           stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
           stride_dob, stride_doh, stride_dom, stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
           stride_sh, num_heads, seq_q, seq_k, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GQA: tl.constexpr, UPCAST: tl.constexpr,
           SEM: tl.constexpr, CAUSAL: tl.constexpr, TMA_ADD: tl.constexpr):
    if GROUP_PROGRAMS == 1:
        start_n = tl.program_id(0)
        off_hkv = tl.program_id(1)
        off_b = tl.program_id(2)
    else:
        n_blk = tl.num_programs(0)
        n_head = tl.num_programs(1)
        group = (GROUP_PROGRAMS + n_blk - 1) // n_blk - 1
        group |= group >> 1
        group |= group >> 2
        group |= group >> 4
        group |= group >> 8
        group += 1
        pid = tl.program_id(0) + n_blk * (tl.program_id(1) + n_head * tl.program_id(2))
        g0 = pid // (n_blk * group) * group
        g_size = tl.minimum(n_head * tl.num_programs(2) - g0, group)
        r = pid - g0 * n_blk
        pair = g0 + r % g_size
        start_n = r // g_size
        off_hkv = pair % n_head
        off_b = pair // n_head
    len_q = seq_q
    len_k = seq_k
    shift = len_k - len_q
    n0 = start_n * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_LO)
    offs_d2 = D_LO + tl.arange(0, D_HI)
    offs_dv = tl.arange(0, HEAD_DIM_V)
    k_rows = K + off_b.to(tl.int64) * stride_kb + off_hkv.to(tl.int64) * stride_kh + cols[:, None] * stride_kn
    k = _load_rows(k_rows + offs_d[None, :], cols, len_k, offs_d, D_LO, D_LO, True)
    k2 = _load_rows(k_rows + offs_d2[None, :], cols, len_k, offs_d2, HEAD_DIM, D_LO + D_HI, True)
    v = _load_rows(V + off_b.to(tl.int64) * stride_vb + off_hkv.to(tl.int64) * stride_vh
                   + cols[:, None] * stride_vn + offs_dv[None, :], cols, len_k, offs_dv, HEAD_DIM_V, HEAD_DIM_V, True)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
        k2 = k2.to(tl.float32)
    dk = tl.zeros([BLOCK_N, D_LO], dtype=tl.float32)
    dk2 = tl.zeros([BLOCK_N, D_HI], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM_V], dtype=tl.float32)
    hi = tl.where(n0 < len_k, len_q, 0)
    if CAUSAL:
        lo = tl.minimum(tl.maximum(n0 - shift, 0) // BLOCK_M * BLOCK_M, hi)
        split = (tl.maximum(n0 + BLOCK_N - 1 - shift, 0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    else:  # every step of a partial key block is masked (its columns past len_k)
        lo = hi * 0
        split = lo
    split = tl.where(n0 + BLOCK_N <= len_k, split, hi)
    split = tl.maximum(tl.minimum(split, hi), lo)
    full = tl.maximum(tl.minimum(hi, len_q // BLOCK_M * BLOCK_M), split)
    off_h = off_hkv * GQA
    q_base = Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
    do_base = DO + off_b.to(tl.int64) * stride_dob + off_h.to(tl.int64) * stride_doh
    head = (off_b * num_heads + off_h).to(tl.int64)
    lse_base = Lse2 + head * stride_sh
    delta_base = Delta + head * stride_sh
    qm_base = QMul + head * stride_sh
    stride_ah = stride_sh * HEAD_DIM
    acc_base = DQacc + head * stride_ah
    acc_row = (off_b * num_heads + off_h) * HEAD_DIM  # the head's first row of the [B * Hq * 192, S_pad] view
    dk, dv, dk2 = _inner(dk, dv, k, v, dk2, k2, offs_d2, q_base, do_base, lse_base, delta_base, qm_base, acc_base,
                         DescLo, DescHi, acc_row, stride_qh, stride_qm, stride_doh, stride_dom, stride_sh, stride_ah, qk_scale, cols, offs_m,
                         offs_d, offs_dv, lo, split, len_q, len_k, HEAD_DIM, HEAD_DIM_V, BLOCK_M, GQA, True, UPCAST,
                         SEM, CAUSAL, TMA_ADD)
    dk, dv, dk2 = _inner(dk, dv, k, v, dk2, k2, offs_d2, q_base, do_base, lse_base, delta_base, qm_base, acc_base,
                         DescLo, DescHi, acc_row, stride_qh, stride_qm, stride_doh, stride_dom, stride_sh, stride_ah, qk_scale, cols, offs_m,
                         offs_d, offs_dv, split, full, len_q, len_k, HEAD_DIM, HEAD_DIM_V, BLOCK_M, GQA, False,
                         UPCAST, SEM, CAUSAL, TMA_ADD)
    dk, dv, dk2 = _inner(dk, dv, k, v, dk2, k2, offs_d2, q_base, do_base, lse_base, delta_base, qm_base, acc_base,
                         DescLo, DescHi, acc_row, stride_qh, stride_qm, stride_doh, stride_dom, stride_sh, stride_ah, qk_scale, cols, offs_m,
                         offs_d, offs_dv, full, hi, len_q, len_k, HEAD_DIM, HEAD_DIM_V, BLOCK_M, GQA, True, UPCAST,
                         SEM, CAUSAL, TMA_ADD)
    dk *= scale
    row_mask = cols[:, None] < seq_k
    dk_rows = DK + off_b.to(tl.int64) * stride_dkb + off_hkv.to(tl.int64) * stride_dkh + cols[:, None] * stride_dkn
    tl.store(dk_rows + offs_d[None, :], dk.to(DK.dtype.element_ty), mask=row_mask)
    dk2 *= scale
    tl.store(dk_rows + offs_d2[None, :], dk2.to(DK.dtype.element_ty), mask=row_mask & (offs_d2[None, :] < HEAD_DIM))
    tl.store(DV + off_b.to(tl.int64) * stride_dvb + off_hkv.to(tl.int64) * stride_dvh
             + cols[:, None] * stride_dvn + offs_dv[None, :], dv.to(DV.dtype.element_ty), mask=row_mask)


@triton.jit(do_not_specialize=["seq_q"])
def _convert(DQacc, QMul, DQ, scale, stride_sh, stride_qb, stride_qh, stride_qm, num_heads, seq_q,
             HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """dQ [rows, 192] = scale * dQacc^T / qmul (dQacc int32 [B, Hq, 192, S_pad])."""
    start_m = tl.program_id(0)
    off_h = tl.program_id(1)
    off_b = tl.program_id(2)
    head = (off_b * num_heads + off_h).to(tl.int64)
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    f = scale / tl.load(QMul + head * stride_sh + rows)
    acc_base = DQacc + head * stride_sh * HEAD_DIM
    out = DQ + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh + rows[:, None] * stride_qm
    offs_d = tl.arange(0, D_LO)
    a = tl.load(acc_base + offs_d[:, None] * stride_sh + rows[None, :])
    tl.store(out + offs_d[None, :], tl.trans(a.to(tl.float32) * f[None, :]).to(DQ.dtype.element_ty),
             mask=rows[:, None] < seq_q)
    offs_d2 = D_LO + tl.arange(0, D_HI)
    a2 = tl.load(acc_base + offs_d2[:, None] * stride_sh + rows[None, :], mask=offs_d2[:, None] < HEAD_DIM, other=0)
    tl.store(out + offs_d2[None, :], tl.trans(a2.to(tl.float32) * f[None, :]).to(DQ.dtype.element_ty),
             mask=(rows[:, None] < seq_q) & (offs_d2[None, :] < HEAD_DIM))


def kv_bound(k, v):
    """KVB [B, Hkv, 2]: max|K| and max_j |V_j|_2 per KV head (torch; as the Gluon backward's _bwd_kv_bound)."""
    return torch.stack([k.abs().amax(dim=(2, 3)).float(), torch.linalg.vector_norm(v, dim=-1).amax(-1).float()], -1)


@triton.jit(do_not_specialize=["seq_k"])
def _bound(K, V, KVB, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, num_heads_kv, seq_k,
           HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK: tl.constexpr):
    """KVB[bh] = max(KVB[bh], (max|K|, max_j |V_j|_2)) over BLOCK rows (the Gluon backward's _bwd_kv_bound_rows:
    non-negative floats, so the atomic max is order-free; NaN counts as +inf)."""
    off_h = tl.program_id(1)
    off_b = tl.program_id(2)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = rows[:, None] < seq_k
    offs_d = tl.arange(0, D_LO)
    offs_d2 = D_LO + tl.arange(0, D_HI)
    kp = K + off_b.to(tl.int64) * stride_kb + off_h.to(tl.int64) * stride_kh + rows[:, None] * stride_kn
    k = tl.abs(tl.load(kp + offs_d[None, :], mask=inside, other=0.0).to(tl.float32))
    k2 = tl.abs(tl.load(kp + offs_d2[None, :], mask=inside & (offs_d2[None, :] < HEAD_DIM), other=0.0).to(tl.float32))
    offs_dv = tl.arange(0, HEAD_DIM_V)
    v = tl.load(V + off_b.to(tl.int64) * stride_vb + off_h.to(tl.int64) * stride_vh + rows[:, None] * stride_vn
                + offs_dv[None, :], mask=inside, other=0.0).to(tl.float32)
    kn = tl.sum(tl.sum((k != k).to(tl.int32), 1), 0) + tl.sum(tl.sum((k2 != k2).to(tl.int32), 1), 0)
    vs = tl.sum(v * v, 1)
    vn = tl.sum((vs != vs).to(tl.int32), 0)
    kmax = tl.where(kn > 0, float("inf"), tl.maximum(tl.max(tl.max(k, 1), 0), tl.max(tl.max(k2, 1), 0)))
    vmax = tl.where(vn > 0, float("inf"), tl.sqrt(tl.max(vs, 0)))
    bh = off_b * num_heads_kv + off_h
    tl.atomic_max(KVB + bh * 2, kmax)
    tl.atomic_max(KVB + bh * 2 + 1, vmax)


BOUND_BLOCK = 64
BOUND_KERNEL = True  # False: the torch bound (five launches)
PARTS = ("zero", "pre", "main", "conv")


def backward(do, q, k, v, out, lse, scale=None, causal=True, parts=PARTS, sem=ATOMIC_SEM, new_out=None, upcast=None,
             bufs=None, stages=None, tma_add=False):
    """(dq, dk, dv) of the MLA attention (causal: bottom-right, q [B, Hq, Sq, 192], k [B, Hkv, Sk, 192],
    v [B, Hkv, Sk, 128], bf16), deterministic. parts: which launches to run ("zero": the accumulator's fill; "pre":
    the bound and the preprocess; "main"; "conv"), with bufs = (stats, acc) of an earlier call (timing of pieces)."""
    new_out = new_out or torch.empty_like
    upcast = (q.device.type == "cpu") if upcast is None else upcast
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    gqa = hq // hkv
    scale = d ** -0.5 if scale is None else scale
    q, k, v, do, out = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, do, out))
    dq, dk, dv = new_out(q), new_out(k), new_out(v)
    sq_pad = triton.cdiv(sq, PRE_BLOCK_M) * PRE_BLOCK_M
    if bufs is None:
        stats = torch.empty((3, b, hq, sq_pad), dtype=torch.float32, device=q.device)
        acc = torch.empty((b, hq, HEAD_DIM, sq_pad), dtype=torch.int32, device=q.device)
    else:
        stats, acc = bufs
    delta, lse2, qmul = stats[0], stats[1], stats[2]
    if "zero" in parts:
        acc.zero_()
    if "pre" in parts:
        if BOUND_KERNEL:
            kvb = torch.zeros((b, hkv, 2), dtype=torch.float32, device=q.device)
            _bound[(triton.cdiv(sk, BOUND_BLOCK), hkv, b)](
                k, v, kvb, k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), hkv, sk,
                HEAD_DIM=HEAD_DIM, HEAD_DIM_V=HEAD_DIM_V, BLOCK=BOUND_BLOCK, num_warps=4)
        else:
            kvb = kv_bound(k, v)
        _pre[(sq_pad // PRE_BLOCK_M, hq, b)](
            out, do, lse.contiguous(), delta, lse2, qmul, kvb, out.stride(0), out.stride(1), out.stride(2),
            do.stride(0), do.stride(1), do.stride(2), sq_pad, hq, sq, GQA=gqa, HEAD_DIM_V=HEAD_DIM_V,
            BLOCK_M=PRE_BLOCK_M, UPCAST=upcast, num_warps=8)
    if "main" in parts:
        desc_lo = desc_hi = None
        if tma_add:
            from triton.tools.tensor_descriptor import TensorDescriptor

            flat = acc.view(b * hq * HEAD_DIM, sq_pad)
            desc_lo = TensorDescriptor.from_tensor(flat, [D_LO.value, BLOCK_M])
            desc_hi = TensorDescriptor.from_tensor(flat, [D_HI.value, BLOCK_M])
        _fused[(triton.cdiv(sk, BLOCK_N), hkv, b)](
            q, k, v, do, dk, dv, lse2, delta, qmul, acc, desc_lo, desc_hi, scale * 1.4426950408889634, scale,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
            v.stride(2), do.stride(0), do.stride(1), do.stride(2), dk.stride(0), dk.stride(1), dk.stride(2),
            dv.stride(0), dv.stride(1), dv.stride(2), sq_pad, hq, sq, sk, HEAD_DIM=HEAD_DIM, HEAD_DIM_V=HEAD_DIM_V,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, GQA=gqa, UPCAST=upcast, SEM=sem, CAUSAL=causal, TMA_ADD=tma_add, num_warps=NUM_WARPS,
            num_stages=stages or NUM_STAGES)
    if "conv" in parts:
        _convert[(sq_pad // CONV_BLOCK_M, hq, b)](
            acc, qmul, dq, scale, sq_pad, dq.stride(0), dq.stride(1), dq.stride(2), hq, sq, HEAD_DIM=HEAD_DIM,
            BLOCK_M=CONV_BLOCK_M, num_warps=4)
    return dq, dk, dv


def _sig(fn, ptr_types: dict, constexprs: dict):
    """signature of `fn` for triton.compile: pointers as ptr_types says, int32 strides/ints, fp32 scales."""
    sig = {}
    for n in fn.arg_names:
        if n in constexprs:
            sig[n] = "constexpr"
        elif n in ptr_types:
            sig[n] = ptr_types[n]
        elif n in ("qk_scale", "scale"):
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
    return sig


def build_sm90(num_stages=None, sem=None, gqa=1, causal=True, tma_add=False):
    """Compile the three kernels for sm_90 on the CPU: {name: (registers, spilled words, shared bytes, kernel)}."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    from fagen.aot.artifacts import _resource_usage

    bf, f32, i32 = "*bf16", "*fp32", "*i32"
    jobs = {
        "pre": (_pre, {"Out": bf, "DO": bf, "Lse": f32, "Delta": f32, "Lse2": f32, "QMul": f32, "KVB": f32},
                dict(GQA=gqa, HEAD_DIM_V=HEAD_DIM_V, BLOCK_M=PRE_BLOCK_M, UPCAST=False), 8, 1),
        "fused": (_fused, {"Q": bf, "K": bf, "V": bf, "DO": bf, "DK": bf, "DV": bf, "Lse2": f32, "Delta": f32,
                           "QMul": f32, "DQacc": i32,
                           "DescLo": f"tensordesc<i32[{D_LO.value}, {BLOCK_M}]>" if tma_add else "constexpr",
                           "DescHi": f"tensordesc<i32[{D_HI.value}, {BLOCK_M}]>" if tma_add else "constexpr"},
                  dict(HEAD_DIM=HEAD_DIM, HEAD_DIM_V=HEAD_DIM_V, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, GQA=gqa,
                       UPCAST=False, SEM=sem or ATOMIC_SEM, CAUSAL=causal, TMA_ADD=tma_add,
                       **({} if tma_add else {"DescLo": None, "DescHi": None})), NUM_WARPS, num_stages or NUM_STAGES),
        "bound": (_bound, {"K": bf, "V": bf, "KVB": f32}, dict(HEAD_DIM=HEAD_DIM, HEAD_DIM_V=HEAD_DIM_V,
                                                                BLOCK=BOUND_BLOCK), 4, 1),
        "convert": (_convert, {"DQacc": i32, "QMul": f32, "DQ": bf}, dict(HEAD_DIM=HEAD_DIM, BLOCK_M=CONV_BLOCK_M), 4,
                    1),
    }
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    res = {}
    for name, (fn, ptrs, cx, warps, stages) in jobs.items():
        sig = _sig(fn, {n: t for n, t in ptrs.items() if t != "constexpr"}, cx)
        attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in sig
                 if sig[n].startswith("*") or n.startswith("stride_")}
        opts = backend.parse_options({"num_warps": warps, "num_stages": stages})
        kern = triton.compile(ASTSource(fn, sig, cx, attrs), target=target, options=opts.__dict__)
        regs, stack, static = _resource_usage(kern.asm["cubin"])
        res[name] = (regs, stack // 4, kern.metadata.shared + static, kern)
    return res
