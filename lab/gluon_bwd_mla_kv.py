"""Lab (not the product): a Gluon dK/dV kernel for MLA's split head dims (d_qk 192, d_v 128) beside the product's
Triton dQ kernel (twenty-second session, docs/serving.md "MLA backward (twenty-second session)").

lab/gluon_bwd_mla.py (fifteenth session) computed dK, dV and dQ in one warp-specialized kernel and lost to its
lockstep step chain: both compute warpgroups exchanged dS^T every step for dQ_j^T = K^T dS^T. Here the dQ part is
gone (the product's dQ kernel keeps it, from the same preprocess), so each compute warpgroup walks its own 64 keys
without waiting on the other, as FA3's MMA warpgroups do, and the step may be 64 queries wide (FA3's hdim-192 tile
is 64 queries a step):

  - a producer warp (TMA): K in two chunks (DA = 128 + DB = 64 columns) and V once a tile; per step Q's two chunks,
    dO, and the preprocess's lse2 and delta rows, into a ring of STAGES slots;
  - two compute warpgroups (setmaxnreg COMPUTE_REGS), keys n0 + 64 WG .. + 64 each: S^T = K_a Q_a^T + K_b Q_b^T and
    dP^T = V dO^T ([64, BLOCK_M], shared-memory operands), P^T = exp2(S^T qk_scale - lse2) (-inf before exp2 where
    masked: P = 0 exactly), dS^T = P^T (dP^T - delta), then dV += P^T dO, dK_a += dS^T Q_a, dK_b += dS^T Q_b (A
    operands from registers); the slot goes back to the producer when the warpgroup's three matmuls are done;
    PIPE 1 issues the next step's S^T and dP^T before waiting for this step's dK/dV matmuls (the softmax of step
    j + 1 overlaps the tensor work of step j);
  - dK = scale dS^T Q and dV stored from registers (masked to seq_k).

No atomics, one program owns each key block: deterministic. The statistics come from the product's preprocess
([B, Hq, S_pad] float32, delta by the tensor-core dot of [Note] Exact delta, lse2 = +inf past Sq), so a row that sees
one key gets dS = 0 exactly if dP^T here rounds as the preprocess's dot does (checked on the GPU).
ptxas (CPU, triton 3.6): `PYTHONPATH=$PWD python3 lab/gluon_bwd_mla_kv.py BLOCK_M=64 ...`.
"""
# ruff: noqa: E402
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, \
    warpgroup_mma_wait

from lab.gluon_bwd import _bwd_mma, _bwd_query_range, _bwd_row_descriptor, _bwd_tile, _sms
from lab.gluon_bwd_mla import DA, _descriptor

KV_BLOCK_M = 64  # queries a step
KV_BLOCK_N = 128  # keys a program: two compute warpgroups of 64
KV_STAGES = 2
KV_COMPUTE_REGS = 240
KV_PRODUCER_REGS = 24
KV_PIPE = 0
KV_GROUP = 0  # tile order: 0 key-block major, g: groups of g (batch, head) pairs (_kv_tile)


@gluon.jit
def _kv_tile(tile, num_tiles, num_bh, num_heads_kv, seq_q, seq_k, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
             GQA: gl.constexpr, CAUSAL: gl.constexpr, GROUP: gl.constexpr):
    """Tile index -> (key block, batch, KV head, first query head, query range). GROUP 0: key-block major (every
    (batch, head) pair's block 0, then every pair's block 1, ...: the heaviest causal blocks first, but the programs in
    flight read the Q/dO of every head). GROUP g: groups of g pairs, block-major in each group, as the product's
    [Note] MLA work order: the programs in flight read the Q/dO of a few heads (L2), each group heaviest first."""
    if GROUP == 0:
        return _bwd_tile(tile, num_tiles, num_bh, num_heads_kv, seq_q, seq_k, BLOCK_M, BLOCK_N, GQA, CAUSAL, 0)
    n_kblk = num_tiles // num_bh
    per = GROUP * n_kblk
    grp = tile // per
    r = tile - grp * per
    size = gl.minimum(num_bh - grp * GROUP, GROUP)  # the last group may hold fewer pairs
    n_blk = r // size
    bh = grp * GROUP + r % size
    off_b = bh // num_heads_kv
    off_hkv = bh % num_heads_kv
    lo, split, hi = _bwd_query_range(n_blk * BLOCK_N, seq_q, seq_k, BLOCK_M, BLOCK_N, CAUSAL)
    return n_blk, off_b, off_hkv, off_hkv * GQA, lo, split, hi


@gluon.jit
def _kv_producer(qa_desc, qb_desc, do_desc, ka_desc, kb_desc, v_desc, l_desc, d_desc, qa_smem, qb_smem, do_smem,
                 ka_smem, kb_smem, v_smem, l_smem, d_smem, ready, empty, kv_ready, kv_empty, num_tiles, num_bh,
                 num_heads_kv, seq_q, seq_k, DB: gl.constexpr, DV: gl.constexpr, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, STAGES: gl.constexpr, GQA: gl.constexpr, CAUSAL: gl.constexpr,
                 GROUP: gl.constexpr):
    num_heads = num_heads_kv * GQA
    dtype: gl.constexpr = qa_desc.dtype
    j = 0
    t = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        n_blk, off_b, off_hkv, h0, lo, split, hi = _kv_tile(tile, num_tiles, num_bh, num_heads_kv, seq_q, seq_k,
                                                            BLOCK_M, BLOCK_N, GQA, CAUSAL, GROUP)
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
                            + do_desc.block_type.nbytes + 2 * l_desc.block_type.nbytes)
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
def _kv_scores(ka_w, kb_w, v_w, qa_s, qb_s, do_s, WN: gl.constexpr, BLOCK_M: gl.constexpr, s_l: gl.constexpr):
    """Issue S^T = K_a Q_a^T + K_b Q_b^T and dP^T = V dO^T (async): two tokens."""
    st_tok = warpgroup_mma(ka_w, qa_s.permute((1, 0)), gl.zeros([WN, BLOCK_M], gl.float32, s_l), use_acc=False,
                           is_async=True)
    st_tok = warpgroup_mma(kb_w, qb_s.permute((1, 0)), st_tok, is_async=True)
    dpt_tok = warpgroup_mma(v_w, do_s.permute((1, 0)), gl.zeros([WN, BLOCK_M], gl.float32, s_l), use_acc=False,
                            is_async=True)
    return st_tok, dpt_tok


@gluon.jit
def _kv_compute(qa_smem, qb_smem, do_smem, ka_smem, kb_smem, v_smem, l_smem, d_smem, ready, empty, kv_ready,
                kv_empty, DK, DV_, qk_scale, scale, num_tiles, num_bh, num_heads_kv, seq_q, seq_k, WG: gl.constexpr,
                DB: gl.constexpr, DV: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                STAGES: gl.constexpr, GQA: gl.constexpr, CAUSAL: gl.constexpr, MUTANT: gl.constexpr,
                PIPE: gl.constexpr, GROUP: gl.constexpr, ops_smem, SMEM_OPS: gl.constexpr,
                DV_EARLY: gl.constexpr):
    """One compute warpgroup: keys n0 + 64 WG .. + 64 of each tile. MUTANT 1 (tests only): dK's scale left out.
    SMEM_OPS 1: P^T and dS^T reach their matmuls through shared memory (ops_smem: this warpgroup's two [64, BLOCK_M]
    tiles, 2 WG and 2 WG + 1), not as register operands: fewer live registers at 64-query steps. DV_EARLY 1 (register
    operands): dV's matmul issued before the wait for dP^T."""
    dtype: gl.constexpr = ka_smem.dtype
    WN: gl.constexpr = BLOCK_N // 2
    s_l: gl.constexpr = _bwd_mma(4, 1, BLOCK_M)  # S^T, dP^T: [WN keys, BLOCK_M queries]
    ka_l: gl.constexpr = _bwd_mma(4, 1, DA)  # dK[:, :DA]
    kb_l: gl.constexpr = _bwd_mma(4, 1, DB)  # dK[:, DA:]
    v_l: gl.constexpr = _bwd_mma(4, 1, DV)  # dV
    opa_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ka_l, k_width=2)
    opb_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kb_l, k_width=2)
    opv_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=v_l, k_width=2)
    keys0 = gl.arange(0, WN, layout=gl.SliceLayout(1, s_l)) + WG * WN
    qrow0 = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_l))
    ka_w = ka_smem.slice(WG * WN, WN, dim=0)
    kb_w = kb_smem.slice(WG * WN, WN, dim=0)
    v_w = v_smem.slice(WG * WN, WN, dim=0)
    j = 0
    t = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        n_blk, off_b, off_hkv, h0, lo, split, hi = _kv_tile(tile, num_tiles, num_bh, num_heads_kv, seq_q, seq_k,
                                                            BLOCK_M, BLOCK_N, GQA, CAUSAL, GROUP)
        n0 = n_blk * BLOCK_N
        steps = (hi - lo) // BLOCK_M
        total = GQA * steps
        dka = gl.zeros([WN, DA], gl.float32, ka_l)
        dkb = gl.zeros([WN, DB], gl.float32, kb_l)
        dv = gl.zeros([WN, DV], gl.float32, v_l)
        keys = n0 + keys0
        mbarrier.wait(kv_ready.index(0), t & 1)
        if PIPE:  # every key block has a step (Sq >= 1: the last query sees every key)
            s0 = j % STAGES
            mbarrier.wait(ready.index(s0), (j // STAGES) & 1)
            st_tok, dpt_tok = _kv_scores(ka_w, kb_w, v_w, qa_smem.index(s0), qb_smem.index(s0), do_smem.index(s0),
                                         WN, BLOCK_M, s_l)
        for i in range(total):
            g = i // steps
            m0 = lo + (i - g * steps) * BLOCK_M
            s = j % STAGES
            qa_s = qa_smem.index(s)
            qb_s = qb_smem.index(s)
            do_s = do_smem.index(s)
            if not PIPE:
                mbarrier.wait(ready.index(s), (j // STAGES) & 1)
                st_tok, dpt_tok = _kv_scores(ka_w, kb_w, v_w, qa_s, qb_s, do_s, WN, BLOCK_M, s_l)
            qrows = m0 + qrow0
            lse2 = l_smem.index(s).reshape([BLOCK_M]).load(gl.SliceLayout(0, s_l))
            st = warpgroup_mma_wait(1, deps=(st_tok, ))
            if m0 < split:
                visible = keys[:, None] < seq_k
                if CAUSAL:
                    visible = visible & (keys[:, None] <= qrows[None, :] + (seq_k - seq_q))
                st = gl.where(visible, st, float("-inf"))  # -inf before exp2: P = 0 exactly
            pt = gl.exp2(st * qk_scale - lse2[None, :])
            if DV_EARLY:  # dV += P^T dO goes in before the wait for dP^T: it runs under dS^T's arithmetic
                pt_op = gl.convert_layout(pt.to(dtype), opv_l)
                dv_tok = warpgroup_mma(pt_op, do_s, dv, is_async=True)
                dpt = warpgroup_mma_wait(1, deps=(dpt_tok, ))
            else:
                dpt = warpgroup_mma_wait(0, deps=(dpt_tok, ))
            delta = d_smem.index(s).reshape([BLOCK_M]).load(gl.SliceLayout(0, s_l))
            dst = (pt * (dpt - delta[None, :])).to(dtype)
            if SMEM_OPS:
                ops_smem.index(2 * WG).store(pt.to(dtype))
                ops_smem.index(2 * WG + 1).store(dst)
                fence_async_shared()
                gl.thread_barrier()  # the warpgroup's tiles are in before its wgmma reads them
                dv_tok = warpgroup_mma(ops_smem.index(2 * WG), do_s, dv, is_async=True)
                dka_tok = warpgroup_mma(ops_smem.index(2 * WG + 1), qa_s, dka, is_async=True)
                dkb_tok = warpgroup_mma(ops_smem.index(2 * WG + 1), qb_s, dkb, is_async=True)
                if PIPE:
                    if i + 1 < total:
                        sn = (j + 1) % STAGES
                        mbarrier.wait(ready.index(sn), ((j + 1) // STAGES) & 1)
                        st_tok, dpt_tok = _kv_scores(ka_w, kb_w, v_w, qa_smem.index(sn), qb_smem.index(sn),
                                                     do_smem.index(sn), WN, BLOCK_M, s_l)
                        dv, dka, dkb = warpgroup_mma_wait(2, deps=(dv_tok, dka_tok, dkb_tok))
                    else:
                        dv, dka, dkb = warpgroup_mma_wait(0, deps=(dv_tok, dka_tok, dkb_tok))
                else:
                    dv, dka, dkb = warpgroup_mma_wait(0, deps=(dv_tok, dka_tok, dkb_tok))
            else:
                if not DV_EARLY:
                    pt_op = gl.convert_layout(pt.to(dtype), opv_l)
                    dv_tok = warpgroup_mma(pt_op, do_s, dv, is_async=True)
                dsa_op = gl.convert_layout(dst, opa_l)
                dka_tok = warpgroup_mma(dsa_op, qa_s, dka, is_async=True)
                dsb_op = gl.convert_layout(dst, opb_l)
                dkb_tok = warpgroup_mma(dsb_op, qb_s, dkb, is_async=True)
                if PIPE:  # the next step's scores go in behind this step's dK/dV matmuls
                    if i + 1 < total:
                        sn = (j + 1) % STAGES
                        mbarrier.wait(ready.index(sn), ((j + 1) // STAGES) & 1)
                        st_tok, dpt_tok = _kv_scores(ka_w, kb_w, v_w, qa_smem.index(sn), qb_smem.index(sn),
                                                     do_smem.index(sn), WN, BLOCK_M, s_l)
                        dv, dka, dkb, pt_op, dsa_op, dsb_op = warpgroup_mma_wait(
                            2, deps=(dv_tok, dka_tok, dkb_tok, pt_op, dsa_op, dsb_op))
                    else:
                        dv, dka, dkb, pt_op, dsa_op, dsb_op = warpgroup_mma_wait(
                            0, deps=(dv_tok, dka_tok, dkb_tok, pt_op, dsa_op, dsb_op))
                else:
                    dv, dka, dkb, pt_op, dsa_op, dsb_op = warpgroup_mma_wait(
                        0, deps=(dv_tok, dka_tok, dkb_tok, pt_op, dsa_op, dsb_op))
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


@gluon.jit(do_not_specialize=["num_tiles", "num_bh", "num_heads_kv", "seq_q", "seq_k"])
def _attn_bwd_mla_kv(qa_desc, qb_desc, do_desc, ka_desc, kb_desc, v_desc, l_desc, d_desc, DK, DV_, qk_scale, scale,
                     num_tiles, num_bh, num_heads_kv, seq_q, seq_k, DB: gl.constexpr, DV: gl.constexpr,
                     BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, GQA: gl.constexpr,
                     CAUSAL: gl.constexpr, COMPUTE_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                     MUTANT: gl.constexpr = 0, PIPE: gl.constexpr = 0, GROUP: gl.constexpr = 0,
                     SMEM_OPS: gl.constexpr = 0, DV_EARLY: gl.constexpr = 0):
    gl.static_assert(BLOCK_N == 128)
    dtype: gl.constexpr = qa_desc.dtype
    qa_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, DA], dtype)
    qb_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, DB], dtype)
    do_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, DV], dtype)
    ka_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, DA], dtype)
    kb_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, DB], dtype)
    v_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, DV], dtype)
    qa_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, DA], qa_sl)
    qb_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, DB], qb_sl)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, DV], do_sl)
    ka_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, DA], ka_sl)
    kb_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, DB], kb_sl)
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, DV], v_sl)
    l_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M], l_desc.layout)
    if SMEM_OPS:  # P^T and dS^T of each compute warpgroup: [2 warpgroups x 2, 64 keys, BLOCK_M queries]
        ops_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N // 2, BLOCK_M], dtype)
        ops_smem = gl.allocate_shared_memory(dtype, [4, BLOCK_N // 2, BLOCK_M], ops_sl)
    else:
        ops_sl2: gl.constexpr = gl.NVMMASharedLayout.get_default_for([8, 64], dtype)
        ops_smem = gl.allocate_shared_memory(dtype, [4, 8, 64], ops_sl2)  # unused
    d_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M], d_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    for r in gl.static_range(STAGES):
        mbarrier.init(ready.index(r), count=1)
        mbarrier.init(empty.index(r), count=2)
    mbarrier.init(kv_ready.index(0), count=1)
    mbarrier.init(kv_empty.index(0), count=2)
    fence_async_shared()
    gl.warp_specialize([
        (_kv_compute, (qa_smem, qb_smem, do_smem, ka_smem, kb_smem, v_smem, l_smem, d_smem, ready, empty, kv_ready,
                       kv_empty, DK, DV_, qk_scale, scale, num_tiles, num_bh, num_heads_kv, seq_q, seq_k, 0, DB, DV,
                       BLOCK_M, BLOCK_N, STAGES, GQA, CAUSAL, MUTANT, PIPE, GROUP,
                       ops_smem, SMEM_OPS, DV_EARLY)),
        (_kv_compute, (qa_smem, qb_smem, do_smem, ka_smem, kb_smem, v_smem, l_smem, d_smem, ready, empty, kv_ready,
                       kv_empty, DK, DV_, qk_scale, scale, num_tiles, num_bh, num_heads_kv, seq_q, seq_k, 1, DB, DV,
                       BLOCK_M, BLOCK_N, STAGES, GQA, CAUSAL, MUTANT, PIPE, GROUP,
                       ops_smem, SMEM_OPS, DV_EARLY)),
        (_kv_producer, (qa_desc, qb_desc, do_desc, ka_desc, kb_desc, v_desc, l_desc, d_desc, qa_smem, qb_smem,
                        do_smem, ka_smem, kb_smem, v_smem, l_smem, d_smem, ready, empty, kv_ready, kv_empty,
                        num_tiles, num_bh, num_heads_kv, seq_q, seq_k, DB, DV, BLOCK_M, BLOCK_N, STAGES, GQA,
                        CAUSAL, GROUP)),
    ], [4, 1], [COMPUTE_REGS, PRODUCER_REGS])


def _args(q, do, k, v, lse2, delta, dk, dv, scale, num_tiles, num_bh, hkv, sq, sk, causal, **constexprs):
    gqa = q.shape[1] // k.shape[1]
    da = DA.value
    db = q.shape[-1] - da
    kw = dict(DB=db, DV=v.shape[-1], BLOCK_M=KV_BLOCK_M, BLOCK_N=KV_BLOCK_N, STAGES=KV_STAGES, GQA=gqa,
              CAUSAL=causal, COMPUTE_REGS=KV_COMPUTE_REGS, PRODUCER_REGS=KV_PRODUCER_REGS, PIPE=KV_PIPE,
              GROUP=KV_GROUP, num_warps=4)
    kw.update(constexprs)
    bm, bn = kw["BLOCK_M"], kw["BLOCK_N"]
    args = (_descriptor(q, bm, da), _descriptor(q, bm, db), _descriptor(do, bm), _descriptor(k, bn, da),
            _descriptor(k, bn, db), _descriptor(v, bn), _bwd_row_descriptor(lse2, bm), _bwd_row_descriptor(delta, bm),
            dk, dv, scale * 1.4426950408889634, scale, num_tiles, num_bh, hkv, sq, sk)
    return args, kw


def prepared(q, k, v, do, dk, dv, lse2, delta, scale, causal, grid_all=True, **constexprs):
    """dkdv's launch as a function of no arguments, its descriptors built now: a caller builds it before the
    preprocess's launch, so the host's work overlaps the GPU's (the statistics are read at launch, not here)."""
    b, hq, sq, _ = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    num_bh = b * hkv
    bn = constexprs.get("BLOCK_N", KV_BLOCK_N)
    num_tiles = triton.cdiv(sk, bn) * num_bh
    args, kw = _args(q, do, k, v, lse2, delta, dk, dv, scale, num_tiles, num_bh, hkv, sq, sk, causal, **constexprs)
    grid = (num_tiles if grid_all else min(num_tiles, _sms(q.device)), )
    return lambda: _attn_bwd_mla_kv[grid](*args, **kw)


def dkdv(q, k, v, do, dk, dv, lse2, delta, scale, causal, grid_all=True, **constexprs):
    """dK, dV into dk, dv (contiguous [B, Hkv, Sk, 192] / [B, Hkv, Sk, 128]) from contiguous bf16 q [B, Hq, Sq, 192],
    k, v, do and the product's preprocess (lse2, delta [B, Hq, S_pad] float32, S_pad a multiple of BLOCK_M).
    grid_all: one program per key block (the heaviest causal blocks first), else one per SM taking every P-th."""
    b, hq, sq, _ = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    num_bh = b * hkv
    bn = constexprs.get("BLOCK_N", KV_BLOCK_N)
    num_tiles = triton.cdiv(sk, bn) * num_bh
    args, kw = _args(q, do, k, v, lse2, delta, dk, dv, scale, num_tiles, num_bh, hkv, sq, sk, causal, **constexprs)
    grid = (num_tiles if grid_all else min(num_tiles, _sms(q.device)), )
    _attn_bwd_mla_kv[grid](*args, **kw)
    return dk, dv


def compile_for(dqk=192, dv=128, gqa=1, causal=True, dtype=torch.bfloat16, seq_q=1000, seq_k=1000, **constexprs):
    """Build the kernel for sm_90 without a GPU (triton's bundled ptxas); returns the CompiledKernel."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    sq_pad = triton.cdiv(seq_q, 128) * 128
    q = torch.empty((1, gqa, seq_q, dqk), dtype=dtype)
    k = torch.empty((1, 1, seq_k, dqk), dtype=dtype)
    v = torch.empty((1, 1, seq_k, dv), dtype=dtype)
    do = torch.empty((1, gqa, seq_q, dv), dtype=dtype)
    rows = torch.empty((1, gqa, sq_pad), dtype=torch.float32)
    args, kw = _args(q, do, k, v, rows, rows, k, v, 0.5, 2, 2, 2, seq_q, seq_k, causal, **constexprs)
    names = list(_attn_bwd_mla_kv.arg_names)[:len(args)]
    num_warps = kw.pop("num_warps")
    signature = {n: mangle_type(a) for n, a in zip(names, args)}
    signature.update({n: "constexpr" for n in kw})
    src = GluonASTSource(fn=_attn_bwd_mla_kv, signature=signature, constexprs=kw)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


if __name__ == "__main__":  # the CPU's sm_90 build: registers, spills, shared memory
    import sys

    from lab.gluon_bwd import resources, step_sass
    for spec in sys.argv[1:] or ["BLOCK_M=64"]:
        kw = {a.split("=")[0]: int(a.split("=")[1]) for a in spec.split(",") if a}
        ck = compile_for(**kw)
        print(spec, resources(ck), step_sass(ck, 8), flush=True)
