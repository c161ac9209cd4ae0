"""The Gluon dK/dV kernel of the MLA backward (d_qk 192 beside d_v 128, sm_90), for the Triton backward's module.

Static code: triton/backward.py.j2 includes everything below the marker line verbatim when the render switch
MLA_GLUON_DKDV (fagen/backends/triton.py) is on, for a dense bf16/fp16 192/128 spec with a causal or no mask (no
sinks, switches or mods): its _launch_backward builds the launch with _mla_gluon_kv before the preprocess's and runs
it in place of the Triton dK/dV kernel's; the dQ kernel and the preprocess stay the module's. The lines above the
marker define the including module's names for linters and readers. The kernel is lab/gluon_bwd_mla_kv.py's
(twenty-second session; docs/serving.md, "MLA backward (twenty-second session)").
"""
import torch
import triton

# -- fagen: included verbatim below this line --


# [Note] MLA Gluon dK/dV (twenty-second session, MLA_GLUON_DKDV in fagen/backends/triton.py; docs/serving.md).
# A producer warp brings K (two column chunks, 128 + 64: a TMA box side is a power of two) and V once a key block,
# and per step the Q chunks, dO and the preprocess's lse2 and delta rows through a ring of MLA_KV_STAGES slots; two
# compute warpgroups each own 64 keys of the block's 128 and walk the query steps on their own (no exchange: the dQ
# kernel keeps dQ), S^T = K Q^T and dP^T = V dO^T from shared memory, P^T and dS^T as register operands of
# dV += P^T dO and dK += dS^T Q. The programs are taken in groups of MLA_KV_GROUP (batch, KV head) pairs, block-major
# in each group, as [Note] MLA work order. No atomics and one program a key block: the same bits every call. A row
# that sees one key gets dS = 0 exactly where dP^T rounds as the preprocess's delta ([Note] Exact delta): the
# GPU check of scripts/gpu_mlabwd_s22.py reads dQ = dK = 0 there. Used where the call fits (_mla_gluon_kv: a CUDA
# sm_90 device, no lengths or tree, TMA-ready q, k, v, dO, contiguous dK/dV), the Triton kernel otherwise.
try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, \
        warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    _MLA_KV_GLUON = True
except ImportError:  # a triton without Gluon's Hopper API: the Triton dK/dV kernel
    _MLA_KV_GLUON = False

MLA_KV_BLOCK_M = 32  # queries a step (64: ptxas spills in the step loop at setmaxnreg 240)
MLA_KV_STAGES = 2
MLA_KV_GROUP = 4  # (batch, KV head) pairs a group
MLA_KV_PIPE = 0  # 1: the next step's S^T and dP^T issued before this step's dK/dV wait
MLA_KV_COMPUTE_REGS = 240
MLA_KV_PRODUCER_REGS = 24
_MLA_KV_SM90 = {}


if _MLA_KV_GLUON:
    DA = gl.constexpr(128)  # the first chunk of the d_qk columns (the second: d_qk - DA = 64)

    @gluon.constexpr_function
    def _mla_kv_mma(warps_m, warps_n, n):
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps_m, warps_n], instr_shape=[16, n, 16])

    @gluon.jit
    def _mla_kv_range(n0, seq_q, seq_k, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
        """Query blocks [lo, hi) that see keys [n0, n0 + BLOCK_N); the steps before `split` apply the mask."""
        hi = (seq_q + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        if CAUSAL:  # query i sees key j iff j <= i + shift
            shift = seq_k - seq_q
            lo = gl.minimum(gl.maximum(n0 - shift, 0) // BLOCK_M * BLOCK_M, hi)
            split = gl.minimum((gl.maximum(n0 + BLOCK_N - 1 - shift, 0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M, hi)
            split = gl.maximum(split, lo)
        else:
            lo = 0
            split = 0
        if n0 + BLOCK_N > seq_k:  # the key tail: every step masks
            split = hi
        return lo, split, hi

    @gluon.jit
    def _mla_kv_tile(tile, num_tiles, num_bh, num_heads_kv, seq_q, seq_k, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 GQA: gl.constexpr, CAUSAL: gl.constexpr, GROUP: gl.constexpr):
        """Tile index -> (key block, batch, KV head, first query head, query range): groups of GROUP (batch, KV head)
        pairs, block-major in each group, as the Triton kernels' [Note] MLA work order (a group's heaviest causal blocks
        first; the programs in flight read the Q/dO of a few heads); GROUP >= the pairs: key-block major."""
        n_kblk = num_tiles // num_bh
        per = GROUP * n_kblk
        grp = tile // per
        r = tile - grp * per
        size = gl.minimum(num_bh - grp * GROUP, GROUP)  # the last group may hold fewer pairs
        n_blk = r // size
        bh = grp * GROUP + r % size
        off_b = bh // num_heads_kv
        off_hkv = bh % num_heads_kv
        lo, split, hi = _mla_kv_range(n_blk * BLOCK_N, seq_q, seq_k, BLOCK_M, BLOCK_N, CAUSAL)
        return n_blk, off_b, off_hkv, off_hkv * GQA, lo, split, hi


    @gluon.jit
    def _mla_kv_producer(qa_desc, qb_desc, do_desc, ka_desc, kb_desc, v_desc, l_desc, d_desc, qa_smem, qb_smem, do_smem,
                     ka_smem, kb_smem, v_smem, l_smem, d_smem, ready, empty, kv_ready, kv_empty, num_tiles, num_bh,
                     num_heads_kv, seq_q, seq_k, DB: gl.constexpr, DV: gl.constexpr, BLOCK_M: gl.constexpr,
                     BLOCK_N: gl.constexpr, STAGES: gl.constexpr, GQA: gl.constexpr, CAUSAL: gl.constexpr,
                     GROUP: gl.constexpr):
        num_heads = num_heads_kv * GQA
        dtype: gl.constexpr = qa_desc.dtype
        j = 0
        t = 0
        for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            n_blk, off_b, off_hkv, h0, lo, split, hi = _mla_kv_tile(tile, num_tiles, num_bh, num_heads_kv, seq_q, seq_k,
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
                                                qa_smem.index(s)._reinterpret(dtype, [1, 1, BLOCK_M, DA],
                                                                               qa_desc.layout))
                tma.async_copy_global_to_shared(qb_desc, [off_b, h0 + g, m0, DA], ready.index(s),
                                                qb_smem.index(s)._reinterpret(dtype, [1, 1, BLOCK_M, DB],
                                                                               qb_desc.layout))
                tma.async_copy_global_to_shared(do_desc, [off_b, h0 + g, m0, 0], ready.index(s),
                                                do_smem.index(s)._reinterpret(dtype, [1, 1, BLOCK_M, DV],
                                                                               do_desc.layout))
                tma.async_copy_global_to_shared(l_desc, [off_b * num_heads + h0 + g, m0], ready.index(s),
                                                l_smem.index(s))
                tma.async_copy_global_to_shared(d_desc, [off_b * num_heads + h0 + g, m0], ready.index(s),
                                                d_smem.index(s))
                j += 1
            t += 1


    @gluon.jit
    def _mla_kv_scores(ka_w, kb_w, v_w, qa_s, qb_s, do_s, WN: gl.constexpr, BLOCK_M: gl.constexpr, s_l: gl.constexpr):
        """Issue S^T = K_a Q_a^T + K_b Q_b^T and dP^T = V dO^T (async): two tokens."""
        st_tok = warpgroup_mma(ka_w, qa_s.permute((1, 0)), gl.zeros([WN, BLOCK_M], gl.float32, s_l), use_acc=False,
                               is_async=True)
        st_tok = warpgroup_mma(kb_w, qb_s.permute((1, 0)), st_tok, is_async=True)
        dpt_tok = warpgroup_mma(v_w, do_s.permute((1, 0)), gl.zeros([WN, BLOCK_M], gl.float32, s_l), use_acc=False,
                                is_async=True)
        return st_tok, dpt_tok


    @gluon.jit
    def _mla_kv_compute(qa_smem, qb_smem, do_smem, ka_smem, kb_smem, v_smem, l_smem, d_smem, ready, empty, kv_ready,
                    kv_empty, DK, DV_, qk_scale, scale, num_tiles, num_bh, num_heads_kv, seq_q, seq_k, WG: gl.constexpr,
                    DB: gl.constexpr, DV: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                    STAGES: gl.constexpr, GQA: gl.constexpr, CAUSAL: gl.constexpr, PIPE: gl.constexpr,
                    GROUP: gl.constexpr, DV_EARLY: gl.constexpr, MUTANT: gl.constexpr):
        """One compute warpgroup: keys n0 + 64 WG .. + 64 of each tile. DV_EARLY 1: dV's matmul issued before the
        wait for dP^T (under dS^T's arithmetic). MUTANT 1 (tests only): dK's scale left out."""
        dtype: gl.constexpr = ka_smem.dtype
        WN: gl.constexpr = BLOCK_N // 2
        s_l: gl.constexpr = _mla_kv_mma(4, 1, BLOCK_M)  # S^T, dP^T: [WN keys, BLOCK_M queries]
        ka_l: gl.constexpr = _mla_kv_mma(4, 1, DA)  # dK[:, :DA]
        kb_l: gl.constexpr = _mla_kv_mma(4, 1, DB)  # dK[:, DA:]
        v_l: gl.constexpr = _mla_kv_mma(4, 1, DV)  # dV
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
            n_blk, off_b, off_hkv, h0, lo, split, hi = _mla_kv_tile(tile, num_tiles, num_bh, num_heads_kv, seq_q, seq_k,
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
                st_tok, dpt_tok = _mla_kv_scores(ka_w, kb_w, v_w, qa_smem.index(s0), qb_smem.index(s0),
                                                 do_smem.index(s0),
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
                    st_tok, dpt_tok = _mla_kv_scores(ka_w, kb_w, v_w, qa_s, qb_s, do_s, WN, BLOCK_M, s_l)
                qrows = m0 + qrow0
                lse2 = l_smem.index(s).reshape([BLOCK_M]).load(gl.SliceLayout(0, s_l))
                st = warpgroup_mma_wait(1, deps=(st_tok, ))
                if m0 < split:
                    visible = keys[:, None] < seq_k
                    if CAUSAL:
                        visible = visible & (keys[:, None] <= qrows[None, :] + (seq_k - seq_q))
                    st = gl.where(visible, st, float("-inf"))  # -inf before exp2: P = 0 exactly
                pt = gl.exp2(st * qk_scale - lse2[None, :])
                if DV_EARLY:  # dV += P^T dO goes in before the wait for dP^T
                    pt_op = gl.convert_layout(pt.to(dtype), opv_l)
                    dv_tok = warpgroup_mma(pt_op, do_s, dv, is_async=True)
                    dpt = warpgroup_mma_wait(1, deps=(dpt_tok, ))
                else:
                    dpt = warpgroup_mma_wait(0, deps=(dpt_tok, ))
                delta = d_smem.index(s).reshape([BLOCK_M]).load(gl.SliceLayout(0, s_l))
                dst = (pt * (dpt - delta[None, :])).to(dtype)
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
                        st_tok, dpt_tok = _mla_kv_scores(ka_w, kb_w, v_w, qa_smem.index(sn), qb_smem.index(sn),
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
            if not MUTANT:  # dS was taken w.r.t. the scaled scores: dK = scale * dS^T Q
                dka = dka * scale
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
                         PIPE: gl.constexpr, GROUP: gl.constexpr, DV_EARLY: gl.constexpr = 0,
                         MUTANT: gl.constexpr = 0):
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
            (_mla_kv_compute, (qa_smem, qb_smem, do_smem, ka_smem, kb_smem, v_smem, l_smem, d_smem, ready, empty,
                               kv_ready, kv_empty, DK, DV_, qk_scale, scale, num_tiles, num_bh, num_heads_kv, seq_q,
                               seq_k, 0, DB, DV, BLOCK_M, BLOCK_N, STAGES, GQA, CAUSAL, PIPE, GROUP,
                               DV_EARLY, MUTANT)),
            (_mla_kv_compute, (qa_smem, qb_smem, do_smem, ka_smem, kb_smem, v_smem, l_smem, d_smem, ready, empty,
                               kv_ready, kv_empty, DK, DV_, qk_scale, scale, num_tiles, num_bh, num_heads_kv, seq_q,
                               seq_k, 1, DB, DV, BLOCK_M, BLOCK_N, STAGES, GQA, CAUSAL, PIPE, GROUP,
                               DV_EARLY, MUTANT)),
            (_mla_kv_producer, (qa_desc, qb_desc, do_desc, ka_desc, kb_desc, v_desc, l_desc, d_desc, qa_smem,
                                qb_smem, do_smem, ka_smem, kb_smem, v_smem, l_smem, d_smem, ready, empty, kv_ready,
                                kv_empty, num_tiles, num_bh, num_heads_kv, seq_q, seq_k, DB, DV, BLOCK_M, BLOCK_N,
                                STAGES, GQA, CAUSAL, GROUP)),
        ], [4, 1], [COMPUTE_REGS, PRODUCER_REGS])


def _mla_kv_descriptor(t, rows, col0=0, cols=None):
    """A TMA descriptor of t [B, H, S, D] in boxes of rows x cols (default: D) columns."""
    d = cols or t.shape[-1]
    dtype = gl.bfloat16 if t.dtype == torch.bfloat16 else gl.float16
    layout = gl.NVMMASharedLayout.get_default_for([1, 1, rows, d], dtype)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, d], layout)


def _mla_kv_rows(t, block_m):
    """lse2 / delta [B, Hq, S_pad] float32, as [B * Hq, S_pad] in boxes of one row of block_m."""
    t2 = t.view(-1, t.shape[-1])
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    return TensorDescriptor(t2, list(t2.shape), list(t2.stride()), [1, block_m], layout)


def _mla_kv_fits(t):
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in t.stride()[:-1])


def _mla_gluon_kv(q, k, v, do, dk, dv, lse2, delta, scale, causal, seqlens_q, seqlens_k, tree):
    """The Gluon dK/dV launch ([Note] MLA Gluon dK/dV) as a function of no arguments, its descriptors built now
    (before the preprocess's launch: the host's work overlaps the GPU's; lse2 and delta are read when it runs), or
    None where the call does not fit it (the Triton dK/dV kernel then)."""
    if not _MLA_KV_GLUON or seqlens_q is not None or seqlens_k is not None or tree is not None:
        return None
    if q.device.type != "cuda" or q.shape[-1] != 192 or v.shape[-1] != 128:
        return None
    if q.device not in _MLA_KV_SM90:
        _MLA_KV_SM90[q.device] = torch.cuda.get_device_capability(q.device) == (9, 0)
    if not _MLA_KV_SM90[q.device] or not (dk.is_contiguous() and dv.is_contiguous()):
        return None
    if not all(_mla_kv_fits(t) for t in (q, k, v, do)) or lse2.shape[-1] % MLA_KV_BLOCK_M:
        return None
    b, hq, sq, _ = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    num_bh = b * hkv
    num_tiles = triton.cdiv(sk, 128) * num_bh
    bm = MLA_KV_BLOCK_M
    args = (_mla_kv_descriptor(q, bm, cols=128), _mla_kv_descriptor(q, bm, cols=64), _mla_kv_descriptor(do, bm),
            _mla_kv_descriptor(k, 128, cols=128), _mla_kv_descriptor(k, 128, cols=64), _mla_kv_descriptor(v, 128),
            _mla_kv_rows(lse2, bm), _mla_kv_rows(delta, bm), dk, dv, scale * 1.4426950408889634, scale, num_tiles,
            num_bh, hkv, sq, sk)
    kw = dict(DB=64, DV=128, BLOCK_M=bm, BLOCK_N=128, STAGES=MLA_KV_STAGES, GQA=hq // hkv, CAUSAL=causal,
              COMPUTE_REGS=MLA_KV_COMPUTE_REGS, PRODUCER_REGS=MLA_KV_PRODUCER_REGS, PIPE=MLA_KV_PIPE,
              GROUP=MLA_KV_GROUP, num_warps=4)
    return lambda: _attn_bwd_mla_kv[(num_tiles, )](*args, **kw)  # one program a key block, heaviest first
