"""Lab (not the product): lab/gluon_bwd.py's v1 (FA3's synchronisation, warp-specialized, sm_90 wgmma) at MLA's split
head dims, d_qk = DQK (192) beside d_v = DV (128): issue 27's feasibility check (fifteenth session, docs/serving.md
"MLA backward (fifteenth session)").

What changes against v1 (its helpers imported: the preprocess, the tile map, the TMA reduce, cvt.rni):
  - 192 is no power of two (Gluon tensors, TMA boxes): K and Q come in two chunks of DA = 128 and DB = 64 columns
    (their own smem tiles and TMA boxes); S^T = K_a Q_a^T + K_b Q_b^T; dK is two accumulators [64, 128] + [64, 64]
    beside dV [64, 128] in each compute warpgroup's registers (64 keys a warpgroup, one wgmma M).
  - 32-query steps (BLOCK_M): S^T and dP^T [64, 32] (16 registers each). dQ_j = dS K would need M = 32 < 64, so
    the kernel computes dQ_j^T = K^T dS^T (M = d_qk rows: warpgroup 0 rows 0-127 from K_a, warpgroup 1 rows 128-191
    from K_b; N = 32 queries; K = the tile's 128 keys, the dS^T both warpgroups exchanged in shared memory) and the
    dQ warp reduce-adds it into a dQ^T accumulator [B, H, DQK, S_pad], which _dqt_convert turns into dQ.
  - dQ adds: DQ_MODE 1 unordered float32, 4 fixed-point int32 (lab/gluon_bwd.py's [Note] Fixed-point dQ: any
    order, the same bits; QM_TMA 1 brings the row multipliers by TMA beside lse2 and delta). No fixed-order mode.
  - Persistent grid (a program per SM, tiles key-block major: the longest causal tiles first) or, with the host's
    grid_all, a program per tile. No levers of v1 (ORDER, SNAKE, NAMED, EPI_TMA, SPT, HGROUP).
ptxas (CPU, triton 3.6): `PYTHONPATH=$PWD python3 lab/gluon_bwd_mla.py FIXED=1,QM_TMA=1 ...` prints registers,
spills, shared memory and the step loops' SASS counts per build.
"""
# ruff: noqa: E402
import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, \
    warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from lab.gluon_bwd import _GL_DTYPE, _bwd_acc_descriptor, _bwd_mma, _bwd_preprocess, _bwd_row_descriptor, _bwd_tile, \
    _cvt_rni, _sms, _tma_reduce_add

MLA_BLOCK_M = 32  # queries a step (the N of S^T, dP^T and of dQ_j^T)
MLA_BLOCK_N = 128  # keys a tile: two compute warpgroups of 64
MLA_STAGES = 2
MLA_DQ_SLOTS = 1  # dQ^T staging slots a warpgroup (2: the next step's tile may go in while the dQ warp adds one)
MLA_COMPUTE_REGS = 248  # ptxas (CPU): 64 B spilled, none in the main step loop (240: 96 B, LDL/STL in it)
MLA_QM_TMA = 0  # the fixed-point dQ's row multipliers: 1 by TMA beside lse2/delta (ptxas 68 B spilled), 0 loads (160 B)
MLA_PRODUCER_REGS = 24
MLA_WRITER_REGS = 24
DA = gl.constexpr(128)  # the first chunk of the d_qk columns (the second: DQK - DA = 64)


def _descriptor(t, rows, cols=None):
    d = cols or t.shape[-1]
    layout = gl.NVMMASharedLayout.get_default_for([1, 1, rows, d], _GL_DTYPE[t.dtype])
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, d], layout)


@gluon.jit
def _mla_producer(qa_desc, qb_desc, do_desc, ka_desc, kb_desc, v_desc, l_desc, d_desc, qa_smem, qb_smem, do_smem,
                  ka_smem, kb_smem, v_smem, l_smem, d_smem, ready, empty, kv_ready, kv_empty, num_tiles, num_bh,
                  num_heads_kv, seq_q, seq_k, DB: gl.constexpr, DV: gl.constexpr, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, STAGES: gl.constexpr, GQA: gl.constexpr, CAUSAL: gl.constexpr, m_desc, m_smem,
                  QM_TMA: gl.constexpr):
    num_heads = num_heads_kv * GQA
    dtype: gl.constexpr = qa_desc.dtype
    j = 0
    t = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        n_blk, off_b, off_hkv, h0, lo, split, hi = _bwd_tile(tile, num_tiles, num_bh, num_heads_kv, seq_q, seq_k,
                                                             BLOCK_M, BLOCK_N, GQA, CAUSAL, 0)
        n0 = n_blk * BLOCK_N
        steps = (hi - lo) // BLOCK_M
        mbarrier.wait(kv_empty.index(0), (t & 1) ^ 1)
        mbarrier.expect(kv_ready.index(0), ka_desc.block_type.nbytes + kb_desc.block_type.nbytes
                        + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(ka_desc, [off_b, off_hkv, n0, 0], kv_ready.index(0),
                                        ka_smem._reinterpret(dtype, [1, 1, BLOCK_N, DA], ka_desc.layout))
        tma.async_copy_global_to_shared(kb_desc, [off_b, off_hkv, n0, DA], kv_ready.index(0),
                                        kb_smem._reinterpret(dtype, [1, 1, BLOCK_N, DB], kb_desc.layout))
        tma.async_copy_global_to_shared(v_desc, [off_b, off_hkv, n0, 0], kv_ready.index(0),
                                        v_smem._reinterpret(dtype, [1, 1, BLOCK_N, DV], v_desc.layout))
        for i in range(GQA * steps):
            s = j % STAGES
            mbarrier.wait(empty.index(s), ((j // STAGES) & 1) ^ 1)
            g = i // steps
            m0 = lo + (i - g * steps) * BLOCK_M
            mbarrier.expect(ready.index(s), qa_desc.block_type.nbytes + qb_desc.block_type.nbytes
                            + do_desc.block_type.nbytes + (3 if QM_TMA else 2) * l_desc.block_type.nbytes)
            if QM_TMA:  # the fixed-point dQ's row multipliers beside lse2 and delta
                tma.async_copy_global_to_shared(m_desc, [off_b * num_heads + h0 + g, m0], ready.index(s),
                                                m_smem.index(s))
            tma.async_copy_global_to_shared(qa_desc, [off_b, h0 + g, m0, 0], ready.index(s),
                                            qa_smem.index(s)._reinterpret(dtype, [1, 1, BLOCK_M, DA], qa_desc.layout))
            tma.async_copy_global_to_shared(qb_desc, [off_b, h0 + g, m0, DA], ready.index(s),
                                            qb_smem.index(s)._reinterpret(dtype, [1, 1, BLOCK_M, DB], qb_desc.layout))
            tma.async_copy_global_to_shared(do_desc, [off_b, h0 + g, m0, 0], ready.index(s),
                                            do_smem.index(s)._reinterpret(dtype, [1, 1, BLOCK_M, DV], do_desc.layout))
            tma.async_copy_global_to_shared(l_desc, [off_b * num_heads + h0 + g, m0], ready.index(s), l_smem.index(s))
            tma.async_copy_global_to_shared(d_desc, [off_b * num_heads + h0 + g, m0], ready.index(s), d_smem.index(s))
            j += 1
        t += 1


@gluon.jit
def _mla_dq_writer(dqa_desc, dqb_desc, dqa_smem, dqb_smem, dq_full, dq_empty, num_tiles, num_bh, num_heads_kv, seq_q,
                   seq_k, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GQA: gl.constexpr, CAUSAL: gl.constexpr,
                   dqa2_smem, dqb2_smem, KSPLIT: gl.constexpr):
    """Unordered adds (DQ_MODE 1) into the transposed accumulator dQ^T [B, H, DQK, sq_pad]: per step, warpgroup 0's
    rows [0, DA) and warpgroup 1's [DA, DQK), BLOCK_M columns at m0."""
    num_heads = num_heads_kv * GQA
    DB: gl.constexpr = dqb_desc.block_type.shape[2]
    NS: gl.constexpr = dqa_smem.shape[0]  # dQ slots a warpgroup (DQ_SLOTS)
    j = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        n_blk, off_b, off_hkv, h0, lo, split, hi = _bwd_tile(tile, num_tiles, num_bh, num_heads_kv, seq_q, seq_k,
                                                             BLOCK_M, BLOCK_N, GQA, CAUSAL, 0)
        steps = (hi - lo) // BLOCK_M
        for i in range(GQA * steps):
            g = i // steps
            m0 = lo + (i - g * steps) * BLOCK_M
            sl = j % NS
            ph = (j // NS) & 1
            mbarrier.wait(dq_full.index(2 * sl), ph)
            _tma_reduce_add(dqa_desc, [off_b, h0 + g, 0, m0], dqa_smem.index(sl)._reinterpret(
                dqa_desc.dtype, [1, 1, DA, BLOCK_M], dqa_desc.layout))
            if KSPLIT:  # warpgroup 0's rows [DA, DQK), over its keys
                _tma_reduce_add(dqb_desc, [off_b, h0 + g, DA, m0], dqa2_smem.index(sl)._reinterpret(
                    dqb_desc.dtype, [1, 1, DB, BLOCK_M], dqb_desc.layout))
            mbarrier.wait(dq_full.index(2 * sl + 1), ph)
            if KSPLIT:  # warpgroup 1's rows [0, DA), over its keys
                _tma_reduce_add(dqa_desc, [off_b, h0 + g, 0, m0], dqb2_smem.index(sl)._reinterpret(
                    dqa_desc.dtype, [1, 1, DA, BLOCK_M], dqa_desc.layout))
            _tma_reduce_add(dqb_desc, [off_b, h0 + g, DA, m0], dqb_smem.index(sl)._reinterpret(
                dqb_desc.dtype, [1, 1, DB, BLOCK_M], dqb_desc.layout))
            tma.store_wait(0)
            gl.thread_barrier()
            mbarrier.arrive(dq_empty.index(2 * sl))
            mbarrier.arrive(dq_empty.index(2 * sl + 1))
            j += 1


@gluon.jit
def _mla_compute(qa_smem, qb_smem, do_smem, ka_smem, kb_smem, v_smem, ds_smem, l_smem, d_smem, dq_smem, ready, empty,
                 kv_ready, kv_empty, ds_ready, dq_full, dq_empty, DK, DV_, qk_scale, scale, num_tiles, num_bh,
                 num_heads_kv, seq_q, seq_k, WG: gl.constexpr, DB: gl.constexpr, DV: gl.constexpr,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, GQA: gl.constexpr,
                 CAUSAL: gl.constexpr, MUTANT: gl.constexpr, QMul, sq_pad, DQ_MODE: gl.constexpr, m_smem,
                 QM_TMA: gl.constexpr, dq2_smem, KSPLIT: gl.constexpr):
    """One compute warpgroup: keys n0 + 64 WG .. + 64 of each tile; dQ_j's columns [0, DA) (WG 0) or [DA, DQK)
    (WG 1). KSPLIT 1: all of dQ_j^T's rows over this warpgroup's 64 keys (dq_smem rows [0, DA), dq2_smem [DA, DQK)),
    no dS^T exchange with the other warpgroup (the dQ warp adds both partials). MUTANT 1 (tests only): dK's scale
    left out."""
    dtype: gl.constexpr = ka_smem.dtype
    WN: gl.constexpr = BLOCK_N // 2
    DQW: gl.constexpr = DA if WG == 0 else DB  # dQ columns of this warpgroup
    s_l: gl.constexpr = _bwd_mma(4, 1, BLOCK_M)  # S^T, dP^T: [WN keys, BLOCK_M queries]
    ka_l: gl.constexpr = _bwd_mma(4, 1, DA)  # dK[:, :DA]
    kb_l: gl.constexpr = _bwd_mma(4, 1, DB)  # dK[:, DA:]
    v_l: gl.constexpr = _bwd_mma(4, 1, DV)  # dV
    dq_l: gl.constexpr = _bwd_mma(4, 1, BLOCK_M)  # dQ_j^T rows of this warpgroup: [DQW, BLOCK_M]
    opa_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ka_l, k_width=2)
    opb_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kb_l, k_width=2)
    opv_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=v_l, k_width=2)
    keys0 = gl.arange(0, WN, layout=gl.SliceLayout(1, s_l)) + WG * WN
    qrow0 = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_l))
    qcol0 = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, dq_l))
    num_heads = num_heads_kv * GQA
    ka_w = ka_smem.slice(WG * WN, WN, dim=0)
    kb_w = kb_smem.slice(WG * WN, WN, dim=0)
    v_w = v_smem.slice(WG * WN, WN, dim=0)
    j = 0
    t = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        n_blk, off_b, off_hkv, h0, lo, split, hi = _bwd_tile(tile, num_tiles, num_bh, num_heads_kv, seq_q, seq_k,
                                                             BLOCK_M, BLOCK_N, GQA, CAUSAL, 0)
        n0 = n_blk * BLOCK_N
        steps = (hi - lo) // BLOCK_M
        dka = gl.zeros([WN, DA], gl.float32, ka_l)
        dkb = gl.zeros([WN, DB], gl.float32, kb_l)
        dv = gl.zeros([WN, DV], gl.float32, v_l)
        keys = n0 + keys0
        mbarrier.wait(kv_ready.index(0), t & 1)
        for i in range(GQA * steps):
            g = i // steps
            m0 = lo + (i - g * steps) * BLOCK_M
            if (DQ_MODE == 4) & (QM_TMA == 0):  # [Note] Fixed-point dQ (lab/gluon_bwd.py): 2^(30 - e) per row
                qm = gl.load(QMul + (off_b * num_heads + h0 + g).to(gl.int64) * sq_pad + m0 + qcol0)
            s = j % STAGES
            mbarrier.wait(ready.index(s), (j // STAGES) & 1)
            qa_s = qa_smem.index(s)
            qb_s = qb_smem.index(s)
            do_s = do_smem.index(s)
            st_tok = warpgroup_mma(ka_w, qa_s.permute((1, 0)), gl.zeros([WN, BLOCK_M], gl.float32, s_l),
                                   use_acc=False, is_async=True)
            st_tok = warpgroup_mma(kb_w, qb_s.permute((1, 0)), st_tok, is_async=True)
            dpt_tok = warpgroup_mma(v_w, do_s.permute((1, 0)), gl.zeros([WN, BLOCK_M], gl.float32, s_l),
                                    use_acc=False, is_async=True)
            qrows = m0 + qrow0
            lse2 = l_smem.index(s).reshape([BLOCK_M]).load(gl.SliceLayout(0, s_l))
            st = warpgroup_mma_wait(1, deps=(st_tok, ))
            if m0 < split:
                visible = keys[:, None] < seq_k
                if CAUSAL:
                    visible = visible & (keys[:, None] <= qrows[None, :] + (seq_k - seq_q))
                st = gl.where(visible, st, float("-inf"))  # -inf before exp2: P = 0 exactly
            pt = gl.exp2(st * qk_scale - lse2[None, :])
            dpt = warpgroup_mma_wait(0, deps=(dpt_tok, ))
            delta = d_smem.index(s).reshape([BLOCK_M]).load(gl.SliceLayout(0, s_l))
            dst = (pt * (dpt - delta[None, :])).to(dtype)
            dsb = j % 2
            ds_smem.index(dsb).slice(WG * WN, WN, dim=0).store(dst)
            pt_op = gl.convert_layout(pt.to(dtype), opv_l)
            dv_tok = warpgroup_mma(pt_op, do_s, dv, is_async=True)
            fence_async_shared()
            if KSPLIT:  # this warpgroup's keys only: its own dS^T rows, no exchange
                gl.thread_barrier()  # every thread's dS^T is in (fenced above) before the warpgroup's wgmma reads it
                ds_w = ds_smem.index(dsb).slice(WG * WN, WN, dim=0)
                dq_tok = warpgroup_mma(ka_w.permute((1, 0)), ds_w, gl.zeros([DA, BLOCK_M], gl.float32, dq_l),
                                       use_acc=False, is_async=True)
                dq2_tok = warpgroup_mma(kb_w.permute((1, 0)), ds_w, gl.zeros([DB, BLOCK_M], gl.float32, dq_l),
                                        use_acc=False, is_async=True)
            else:
                mbarrier.arrive(ds_ready.index(dsb))
                mbarrier.wait(ds_ready.index(dsb), (j // 2) & 1)  # both warpgroups' halves of dS^T are in
                if WG == 0:  # dQ_j^T = K^T dS^T: M = this warpgroup's d_qk rows, N = BLOCK_M queries
                    dq_tok = warpgroup_mma(ka_smem.permute((1, 0)), ds_smem.index(dsb),
                                           gl.zeros([DQW, BLOCK_M], gl.float32, dq_l), use_acc=False, is_async=True)
                else:
                    dq_tok = warpgroup_mma(kb_smem.permute((1, 0)), ds_smem.index(dsb),
                                           gl.zeros([DQW, BLOCK_M], gl.float32, dq_l), use_acc=False, is_async=True)
            dsa_op = gl.convert_layout(dst, opa_l)
            dka_tok = warpgroup_mma(dsa_op, qa_s, dka, is_async=True)
            dsb_op = gl.convert_layout(dst, opb_l)
            dkb_tok = warpgroup_mma(dsb_op, qb_s, dkb, is_async=True)
            if KSPLIT:
                dv, dq, dq2, pt_op = warpgroup_mma_wait(2, deps=(dv_tok, dq_tok, dq2_tok, pt_op))
            else:
                dv, dq, pt_op = warpgroup_mma_wait(2, deps=(dv_tok, dq_tok, pt_op))
            if DQ_MODE == 4:  # int32 units of 2^(e - 30) per query (a column of dQ_j^T): any order, the same bits
                if QM_TMA:
                    qm = m_smem.index(s).reshape([BLOCK_M]).load(gl.SliceLayout(0, dq_l))
                dq = _cvt_rni(dq * qm[None, :])
                if KSPLIT:
                    dq2 = _cvt_rni(dq2 * qm[None, :])
            NS: gl.constexpr = dq_smem.shape[0]  # dQ slots a warpgroup (DQ_SLOTS)
            sl = j % NS
            mbarrier.wait(dq_empty.index(2 * sl + WG), ((j // NS) & 1) ^ 1)  # the dQ warp has added what it held
            dq_smem.index(sl).store(dq)
            if KSPLIT:
                dq2_smem.index(sl).store(dq2)
            fence_async_shared()
            mbarrier.arrive(dq_full.index(2 * sl + WG))
            dka, dkb, dsa_op, dsb_op = warpgroup_mma_wait(0, deps=(dka_tok, dkb_tok, dsa_op, dsb_op))
            mbarrier.arrive(empty.index(s))
            j += 1
        mbarrier.arrive(kv_empty.index(0))
        if not MUTANT:
            dka = dka * scale  # dS was taken w.r.t. the scaled scores: dK = scale * dS^T Q
            dkb = dkb * scale
        base = (off_b * num_heads_kv + off_hkv).to(gl.int64) * seq_k + n0
        r = gl.arange(0, WN, layout=gl.SliceLayout(1, ka_l)) + WG * WN
        c = gl.arange(0, DA, layout=gl.SliceLayout(0, ka_l))
        gl.store(DK + (base + r[:, None]) * (DA + DB) + c[None, :], dka.to(dtype), mask=(n0 + r[:, None]) < seq_k)
        r = gl.arange(0, WN, layout=gl.SliceLayout(1, kb_l)) + WG * WN
        c = gl.arange(0, DB, layout=gl.SliceLayout(0, kb_l)) + DA
        gl.store(DK + (base + r[:, None]) * (DA + DB) + c[None, :], dkb.to(dtype), mask=(n0 + r[:, None]) < seq_k)
        r = gl.arange(0, WN, layout=gl.SliceLayout(1, v_l)) + WG * WN
        c = gl.arange(0, DV, layout=gl.SliceLayout(0, v_l))
        gl.store(DV_ + (base + r[:, None]) * DV + c[None, :], dv.to(dtype), mask=(n0 + r[:, None]) < seq_k)
        t += 1


@gluon.jit(do_not_specialize=["num_tiles", "num_bh", "num_heads_kv", "seq_q", "seq_k", "sq_pad"])
def _attn_bwd_mla(qa_desc, qb_desc, do_desc, ka_desc, kb_desc, v_desc, l_desc, d_desc, dqa_desc, dqb_desc, DK, DV_,
                  qk_scale, scale, num_tiles, num_bh, num_heads_kv, seq_q, seq_k, sq_pad,
                  DB: gl.constexpr, DV: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  STAGES: gl.constexpr, GQA: gl.constexpr, CAUSAL: gl.constexpr, DQ_MODE: gl.constexpr,
                  COMPUTE_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, WRITER_REGS: gl.constexpr,
                  MUTANT: gl.constexpr = 0, QMul=None, QM_TMA: gl.constexpr = 0, DQ_SLOTS: gl.constexpr = 1,
                  KSPLIT: gl.constexpr = 0):
    gl.static_assert(BLOCK_N == 128)
    gl.static_assert((DQ_MODE == 1) | (DQ_MODE == 4))  # unordered float32 adds, fixed-point int32 adds
    gl.static_assert((DQ_MODE == 4) == (QMul is not None))
    gl.static_assert((QM_TMA == 0) | (DQ_MODE == 4))
    dtype: gl.constexpr = qa_desc.dtype
    qa_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, DA], dtype)
    qb_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, DB], dtype)
    do_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, DV], dtype)
    ka_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, DA], dtype)
    kb_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, DB], dtype)
    v_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, DV], dtype)
    ds_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
    f32_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
    qa_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, DA], qa_sl)
    qb_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, DB], qb_sl)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, DV], do_sl)
    ka_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, DA], ka_sl)
    kb_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, DB], kb_sl)
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, DV], v_sl)
    ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ds_sl)
    l_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M], l_desc.layout)
    d_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M], d_desc.layout)
    m_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M], d_desc.layout)
    dqa_smem = gl.allocate_shared_memory(dqa_desc.dtype, [DQ_SLOTS, DA, BLOCK_M], f32_sl)
    dqb_smem = gl.allocate_shared_memory(dqa_desc.dtype, [DQ_SLOTS, DB, BLOCK_M], f32_sl)
    if KSPLIT:  # each warpgroup stages all DQK rows: warpgroup 0 [DA] + [DB] (dqa, dqa2), warpgroup 1 [DB] + [DA]
        dqa2_smem = gl.allocate_shared_memory(dqa_desc.dtype, [DQ_SLOTS, DB, BLOCK_M], f32_sl)
        dqb2_smem = gl.allocate_shared_memory(dqa_desc.dtype, [DQ_SLOTS, DA, BLOCK_M], f32_sl)
    else:
        dqa2_smem = dqa_smem
        dqb2_smem = dqb_smem
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_full = gl.allocate_shared_memory(gl.int64, [2 * DQ_SLOTS, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [2 * DQ_SLOTS, 1], mbarrier.MBarrierLayout())
    for r in gl.static_range(STAGES):
        mbarrier.init(ready.index(r), count=1)
        mbarrier.init(empty.index(r), count=2)
    for r in gl.static_range(2 * DQ_SLOTS):
        mbarrier.init(dq_full.index(r), count=1)
        mbarrier.init(dq_empty.index(r), count=1)
    for r in gl.static_range(2):
        mbarrier.init(ds_ready.index(r), count=2)
    mbarrier.init(kv_ready.index(0), count=1)
    mbarrier.init(kv_empty.index(0), count=2)
    fence_async_shared()
    gl.warp_specialize([
        (_mla_compute, (qa_smem, qb_smem, do_smem, ka_smem, kb_smem, v_smem, ds_smem, l_smem, d_smem, dqa_smem,
                        ready, empty, kv_ready, kv_empty, ds_ready, dq_full, dq_empty, DK, DV_, qk_scale, scale,
                        num_tiles, num_bh, num_heads_kv, seq_q, seq_k, 0, DB, DV, BLOCK_M, BLOCK_N, STAGES, GQA,
                        CAUSAL, MUTANT, QMul, sq_pad, DQ_MODE, m_smem, QM_TMA, dqa2_smem, KSPLIT)),
        (_mla_compute, (qa_smem, qb_smem, do_smem, ka_smem, kb_smem, v_smem, ds_smem, l_smem, d_smem,
                        dqb2_smem,
                        ready, empty, kv_ready, kv_empty, ds_ready, dq_full, dq_empty, DK, DV_, qk_scale, scale,
                        num_tiles, num_bh, num_heads_kv, seq_q, seq_k, 1, DB, DV, BLOCK_M, BLOCK_N, STAGES, GQA,
                        CAUSAL, MUTANT, QMul, sq_pad, DQ_MODE, m_smem, QM_TMA, dqb_smem, KSPLIT)),
        (_mla_producer, (qa_desc, qb_desc, do_desc, ka_desc, kb_desc, v_desc, l_desc, d_desc, qa_smem, qb_smem,
                         do_smem, ka_smem, kb_smem, v_smem, l_smem, d_smem, ready, empty, kv_ready, kv_empty,
                         num_tiles, num_bh, num_heads_kv, seq_q, seq_k, DB, DV, BLOCK_M, BLOCK_N, STAGES, GQA,
                         CAUSAL, QMul, m_smem, QM_TMA)),
        (_mla_dq_writer, (dqa_desc, dqb_desc, dqa_smem, dqb_smem, dq_full, dq_empty, num_tiles, num_bh, num_heads_kv,
                          seq_q, seq_k, BLOCK_M, BLOCK_N, GQA, CAUSAL, dqa2_smem, dqb2_smem, KSPLIT)),
    ], [4, 1, 1], [COMPUTE_REGS, PRODUCER_REGS, WRITER_REGS])


def _args(q, do, k, v, lse2, delta, dq_acc, dk, dv, scale, num_tiles, num_bh, hkv, sq, sk, sq_pad, causal, qmul=None,
          **constexprs):
    gqa = q.shape[1] // k.shape[1]
    da = DA.value
    db = q.shape[-1] - da
    kw = dict(DB=db, DV=v.shape[-1], BLOCK_M=MLA_BLOCK_M, BLOCK_N=MLA_BLOCK_N, STAGES=MLA_STAGES, GQA=gqa,
              CAUSAL=causal, DQ_MODE=1 if qmul is None else 4, COMPUTE_REGS=MLA_COMPUTE_REGS,
              PRODUCER_REGS=MLA_PRODUCER_REGS, WRITER_REGS=MLA_WRITER_REGS,
              QM_TMA=MLA_QM_TMA if qmul is not None else 0, DQ_SLOTS=MLA_DQ_SLOTS, num_warps=4)
    kw.update(constexprs)
    bm = kw["BLOCK_M"]
    if qmul is not None:  # QM_TMA: the multipliers' rows by TMA (a descriptor), else a pointer
        kw["QMul"] = _bwd_row_descriptor(qmul, bm) if kw.get("QM_TMA") else qmul
    args = (_descriptor(q, bm, da), _descriptor(q, bm, db), _descriptor(do, bm), _descriptor(k, MLA_BLOCK_N, da),
            _descriptor(k, MLA_BLOCK_N, db), _descriptor(v, MLA_BLOCK_N), _bwd_row_descriptor(lse2, bm),
            _bwd_row_descriptor(delta, bm), _bwd_acc_descriptor(dq_acc, da, cols=bm, swizzle=128),
            _bwd_acc_descriptor(dq_acc, db, cols=bm, swizzle=128), dk, dv, scale * 1.4426950408889634, scale,
            num_tiles, num_bh, hkv, sq, sk, sq_pad)
    return args, kw


@triton.jit
def _dqt_convert(ACC, DQ, QMul, scale, seq_q, sq_pad, DQK: tl.constexpr, BLOCK: tl.constexpr, FIXED: tl.constexpr):
    """dQ[b, h, m, :] = scale * ACC[b, h, :, m] in dQ's dtype (ACC the dQ^T [B, H, DQK, sq_pad], float32, or with
    FIXED int32 in units of 1 / QMul[b, h, m]), in chunks of 64 columns of d_qk (DQK a multiple of 64)."""
    m = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    head = tl.program_id(1).to(tl.int64)
    d = tl.arange(0, 64)
    f = tl.full([BLOCK], scale, tl.float32)
    if FIXED:
        f = scale / tl.load(QMul + head * sq_pad + m)
    for c in tl.static_range(DQK // 64):
        t = tl.load(ACC + head * DQK * sq_pad + (c * 64 + d[:, None]) * sq_pad + m[None, :])
        tl.store(DQ + head * seq_q * DQK + m[None, :] * DQK + c * 64 + d[:, None],
                 (t.to(tl.float32) * f[None, :]).to(DQ.dtype.element_ty), mask=m[None, :] < seq_q)


def _setup(do, q, k, v, out, lse, scale, causal, fill=False, fixed=False, grid_all=False, **constexprs):
    b, hq, sq, dqk = q.shape
    hkv, sk, dv_ = k.shape[1], k.shape[2], v.shape[-1]
    q, k, v, do, out = (t.contiguous() for t in (q, k, v, do, out))
    new = (lambda t: torch.full_like(t, float("nan"))) if fill else torch.empty_like
    dq, dk, dv = new(q), new(k), new(v)
    sq_pad = triton.cdiv(sq, 64) * 64  # the preprocess's rows
    delta = torch.empty((b, hq, sq_pad), dtype=torch.float32, device=q.device)
    lse2 = torch.empty_like(delta)
    dq_acc = torch.zeros((b, hq, dqk, sq_pad), dtype=torch.int32 if fixed else torch.float32, device=q.device)  # dQ^T
    qmul = torch.empty_like(delta) if fixed else None
    num_bh = b * hkv
    num_tiles = triton.cdiv(sk, MLA_BLOCK_N) * num_bh
    # grid_all: one program per tile (the hardware hands tiles out in index order as SMs free up: the heaviest causal
    # key blocks first); else persistent, one program per SM taking every P-th tile
    grid = (num_tiles if grid_all else min(num_tiles, _sms(q.device)), )
    args, kw = _args(q, do, k, v, lse2, delta, dq_acc, dk, dv, scale, num_tiles, num_bh, hkv, sq, sk, sq_pad,
                     causal, qmul, **constexprs)

    def pre():
        kvb = None
        if fixed:  # [Note] Fixed-point dQ: (max|K|, max_j |V_j|_2) per KV head, for the rows' bounds
            kvb = torch.stack([k.abs().amax(dim=(2, 3)).float(), torch.linalg.vector_norm(v, dim=-1).amax(-1).float()],
                              -1).contiguous()
        _bwd_preprocess[(sq_pad // 64, b * hq)](out, do, lse.contiguous(), delta, lse2, sq, sq_pad, HEAD_DIM=dv_,
                                                BLOCK_M=64, QMul=qmul, KVB=kvb, GQA=hq // hkv, num_warps=4)

    def main():
        _attn_bwd_mla[grid](*args, **kw)

    def post():
        _dqt_convert[(sq_pad // 64, b * hq)](dq_acc, dq, qmul, scale, sq, sq_pad, DQK=dqk, BLOCK=64, FIXED=fixed,
                                             num_warps=4)

    return pre, main, post, (dq, dk, dv), dq_acc


def backward(do, q, k, v, out, lse, scale, causal, fill=False, fixed=False, grid_all=False, **constexprs):
    """(dq, dk, dv) for contiguous bf16 q, k [B, H, S, DQK], v, do, out [B, H, S, DV]; lse [B, Hq, Sq] natural log.
    fill: outputs start NaN (a program that never ran fails the check). fixed: the fixed-point dQ (deterministic)."""
    pre, main, post, res, _ = _setup(do, q, k, v, out, lse, scale, causal, fill, fixed, grid_all, **constexprs)
    pre()
    main()
    post()
    return res


def prepared(do, q, k, v, out, lse, scale, causal, fixed=False, grid_all=False, **constexprs):
    """The main kernel's launch alone (buffers allocated and the preprocess run once): for timing it apart."""
    pre, main, post, res, _ = _setup(do, q, k, v, out, lse, scale, causal, fixed=fixed, grid_all=grid_all,
                                     **constexprs)
    pre()
    return main


def compile_for(dqk=192, dv=128, gqa=1, causal=True, dtype=torch.bfloat16, seq_q=1000, seq_k=1000, FIXED=0,
                **constexprs):
    """Build the main kernel for sm_90 without a GPU (triton's bundled ptxas); returns the CompiledKernel."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    bm = constexprs.get("BLOCK_M", MLA_BLOCK_M)
    sq_pad = triton.cdiv(seq_q, bm) * bm
    q = torch.empty((1, gqa, seq_q, dqk), dtype=dtype)
    k = torch.empty((1, 1, seq_k, dqk), dtype=dtype)
    v = torch.empty((1, 1, seq_k, dv), dtype=dtype)
    do = torch.empty((1, gqa, seq_q, dv), dtype=dtype)
    rows = torch.empty((1, gqa, sq_pad), dtype=torch.float32)
    acc = torch.empty((1, gqa, dqk, sq_pad), dtype=torch.int32 if FIXED else torch.float32)
    args, kw = _args(q, do, k, v, rows, rows, acc, k, v, 0.5, 2, 2, 2, seq_q, seq_k, sq_pad, causal,
                     rows if FIXED else None, **constexprs)
    names = list(_attn_bwd_mla.arg_names)[:len(args)]
    num_warps = kw.pop("num_warps")
    signature = {n: mangle_type(a) for n, a in zip(names, args)}
    if "QMul" in kw:
        signature["QMul"] = mangle_type(kw.pop("QMul"))
    signature.update({n: "constexpr" for n in kw})
    src = GluonASTSource(fn=_attn_bwd_mla, signature=signature, constexprs=kw)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


if __name__ == "__main__":  # the CPU's sm_90 build: registers, spills, shared memory
    import sys

    from lab.gluon_bwd import resources, step_sass
    for spec in sys.argv[1:] or ["COMPUTE_REGS=240"]:
        kw = {a.split("=")[0]: int(a.split("=")[1]) for a in spec.split(",") if a}
        ck = compile_for(**kw)
        print(spec, resources(ck), step_sass(ck, 16), flush=True)
