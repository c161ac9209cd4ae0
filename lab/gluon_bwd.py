"""Lab (not the product): Gluon backwards for sm_90 whose dQ leaves the CTA through a dedicated warp (issue 28).

Two kernels, one module, both key-block-stationary (a CTA owns 128 keys, loops over 64-query steps):
  v0  c68d572's fused backward, revived as it was (8 compute warps in one partition that also issue the TMA loads;
      a dQ writer warp; three CTA-wide barriers per step), with DQ_MODE switches for the diagnostics phase 4 left
      unmeasured.
  v1  FA3's synchronisation (hopper/mainloop_bwd_sm90_tma_gmma_ws.hpp, read, not copied): each compute warpgroup
      is its own partition; a producer warp streams K/V and the Q/dO ring (full/empty mbarriers, no CTA barrier);
      the two warpgroups meet once per step (dS^T halves in a 2-slot shared buffer); each warpgroup computes its
      half of dQ_j's head dim and hands it to the dQ warp through its own slot, which the dQ warp reduce-adds with
      one TMA reduce per half; dK/dV and dQ MMAs overlap the handoff.
DQ_MODE: 0 deterministic (per-(batch, head, query block) counter orders the adds), 1 unordered adds
(deterministic=False), 2 diagnostic: handoff kept, no reduce (wrong dQ), 3 diagnostic: no handoff (wrong dQ),
4 (v1) deterministic in any order: fixed-point int32 adds ([Note] Fixed-point dQ).
Preprocess: delta = diag(O dO^T) by the MMA ([Note] Exact delta), lse2; postprocess dq = scale * dQacc.
"""
# ruff: noqa: E402
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, \
    warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

_GL_DTYPE = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
_NUM_SMS = {}


def _descriptor(t, rows):
    d = t.shape[-1]
    layout = gl.NVMMASharedLayout.get_default_for([1, 1, rows, d], _GL_DTYPE[t.dtype])
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, d], layout)


# ---------------------------------------------------------------------------------------------------------------
BWD_BLOCK_M = 64  # queries per step (one wgmma N for S^T, dP^T; the M of dQ_j)
BWD_BLOCK_N = 128  # keys per tile: two warpgroups of 64
BWD_STAGES = 2  # Q/dO ring slots (3 measured equal)
BWD_WRITER_REGS = 24  # setmaxnreg of the dQ writer warp; the compute warps get the rest
BWD_DQ_PENDING = 1  # dQ adds whose completion the writer has not awaited yet ([Note] Pipelined dQ writer): 0, 1, 2
BWD_HEAD_MAJOR = 0  # tile order: 0 key block major, 1 head major (_bwd_tile; measured 164 vs 298 TF/s causal s16k)
BWD_DQ_SWIZZLE = 128  # swizzle (bytes) of the float32 dQ staging tile: 128 avoids bank conflicts; 0 = unswizzled

from triton._C.libtriton import ir as _ir  # noqa: E402
from triton.experimental.gluon.language._core import builtin as _builtin  # noqa: E402


@_builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """global[box at coord] += shared `src` through the TMA unit (cp.reduce.async.bulk.tensor .add). Triton 3.6 has
    the op (ttng.async_tma_reduce, behind tl's descriptor atomic_add) and Gluon's builder creates it, but
    gluon.language exposes no wrapper."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def _bulk_wait(x, PENDING: gl.constexpr):
    """cp.async.bulk.wait_group PENDING (not .read): all but this thread's PENDING most recent bulk groups have
    completed, their writes performed. `x` is any scalar (the inline asm needs an operand)."""
    if PENDING == 0:
        r = gl.inline_asm_elementwise("cp.async.bulk.wait_group 0; mov.b32 $0, $1;", "=r,r", [x], dtype=gl.int32,
                                      is_pure=False, pack=1)
    elif PENDING == 1:
        r = gl.inline_asm_elementwise("cp.async.bulk.wait_group 1; mov.b32 $0, $1;", "=r,r", [x], dtype=gl.int32,
                                      is_pure=False, pack=1)
    elif PENDING == 2:
        r = gl.inline_asm_elementwise("cp.async.bulk.wait_group 2; mov.b32 $0, $1;", "=r,r", [x], dtype=gl.int32,
                                      is_pure=False, pack=1)
    else:
        gl.static_assert(False, "PENDING: 0, 1 or 2 bulk groups")
        r = x
    return r


@gluon.jit
def _cvt_rni(x):
    """float32 -> int32, rounded to nearest even (cvt.rni.s32.f32)."""
    return gl.inline_asm_elementwise("cvt.rni.s32.f32 $0, $1;", "=r,r", [x], dtype=gl.int32, is_pure=True, pack=1)


# [Note] FMA rounding (FIXED_FMA 1, DQ_MODE 4). cvt.rni.s32.f32 issues at a fraction of the FMA rate and sits on the
# step's critical path (eighth session: 8,192 a step per SM, the step 543 -> 611 SASS instructions). For |y| < 2^22,
# y + 1.5 x 2^23 lies in [2^23, 2^24), where a float32's unit in the last place is 1: the add rounds y to the
# nearest integer (ties to even, as cvt.rni) and leaves it in the low mantissa bits, so bits(fma(x, qm, 1.5 x 2^23))
# - bits(1.5 x 2^23) is round(x qm) as an int32 (qm a power of two: x qm is exact, one rounding either way). The
# preprocess takes qm = 2^(22 - e) instead of 2^(30 - e) (QBITS 22): every partial is below 2^21, 8 bits coarser
# units (the error bound per partial 2^-22 of the row's bound instead of 2^-30), the same postprocess.
# FIXED_FMA 2 also leaves out the IADD: the dQ warp adds the raw bits, round(x qm) + 0x4B400000, and int32 adds wrap
# (two's complement: associative mod 2^32), so the accumulator holds the sum + cnt x 0x4B400000 mod 2^32, cnt the
# number of adds into the row's query block (the key blocks that visit it: all with the full mask, a prefix of
# them causal); the postprocess subtracts that (MAGIC_CNT) and has the exact sum, which fits int32.
_MAGIC = gl.constexpr(12582912.0)  # 1.5 x 2^23 = bits 0x4B400000
_MAGIC_BITS = gl.constexpr(0x4B400000)


@gluon.jit
def _fma_rni(x, qm, SUB: gl.constexpr = 1):
    """round(x * qm) as int32 for |x qm| < 2^22 on the FMA pipe ([Note] FMA rounding); SUB 0: + 0x4B400000."""
    r = gl.fma(x, qm, _MAGIC).to(gl.int32, bitcast=True)
    if SUB:
        r = r - _MAGIC_BITS
    return r


@gluon.constexpr_function
def _bwd_mma(warps_m, warps_n, n):
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps_m, warps_n], instr_shape=[16, n, 16])


@gluon.jit(do_not_specialize=["seq_q", "sq_pad"])
def _bwd_preprocess(O, DO, Lse, Delta, Lse2, seq_q, sq_pad, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                    QMul=None, KVB=None, GQA: gl.constexpr = 1, QBITS: gl.constexpr = 30):
    """delta = diag(O dO^T) ([Note] Exact delta) and lse2 = lse * log2(e) (+inf where lse = -inf), [B * H, sq_pad];
    rows past seq_q get delta = 0, lse2 = +inf. O and dO contiguous [B, H, Sq, D]. With QMul (DQ_MODE 4, [Note]
    Fixed-point dQ): QMul[row] = 2^(30 - e), 2^e >= 2 max|K| (|dO_row| max_j |V_j| + |delta|), KVB [B * Hkv, 2] =
    (max|K|, max_j |V_j|_2) of the row's KV head."""
    m0 = gl.program_id(0) * BLOCK_M
    head = gl.program_id(1)
    dtype: gl.constexpr = O.dtype.element_ty
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ld))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, ld))
    offs = head.to(gl.int64) * seq_q * HEAD_DIM + rows[:, None] * HEAD_DIM + cols[None, :]
    inside = rows[:, None] < seq_q
    o = gl.load(O + offs, mask=inside, other=0.0)
    do = gl.load(DO + offs, mask=inside, other=0.0)
    sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
    o_s = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], sl, o)
    do_s = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], sl, do)
    fence_async_shared()
    acc_l: gl.constexpr = _bwd_mma(4, 1, BLOCK_M)
    prod = warpgroup_mma(o_s, do_s.permute((1, 0)), gl.zeros([BLOCK_M, BLOCK_M], gl.float32, acc_l), use_acc=False)
    r = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_l))
    c = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, acc_l))
    delta = gl.sum(gl.where(r[:, None] == c[None, :], prod, 0.0), 1)  # x + 0 == x: the diagonal, exactly
    rs = m0 + r
    lse = gl.load(Lse + head.to(gl.int64) * seq_q + rs, mask=rs < seq_q, other=float("-inf"))
    lse2 = gl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    gl.store(Delta + head.to(gl.int64) * sq_pad + rs, delta)
    gl.store(Lse2 + head.to(gl.int64) * sq_pad + rs, lse2)
    if QMul is not None:
        dof = do.to(gl.float32)
        dn = gl.convert_layout(gl.sqrt(gl.sum(dof * dof, 1)), gl.SliceLayout(1, acc_l))
        kb = gl.load(KVB + (head // GQA) * 2)
        vb = gl.load(KVB + (head // GQA) * 2 + 1)
        bound = gl.maximum(2.0 * kb * (dn * vb + gl.abs(delta)), 1e-30)
        e = gl.minimum(gl.maximum(gl.ceil(gl.log2(bound)), -96.0), 96.0).to(gl.int32)
        qm = ((127 + QBITS - e) << 23).to(gl.float32, bitcast=True)  # 2^(QBITS - e), exactly
        gl.store(QMul + head.to(gl.int64) * sq_pad + rs, qm)


@gluon.jit
def _dq_adds(m0, seq_q, seq_k, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """The number of dQ adds into query block m0 (of BLOCK_M rows): the key blocks that visit it, all of them with
    the full mask, causal the prefix whose query range starts at or before m0 ([Note] FMA rounding)."""
    cnt = (seq_k + BLOCK_N - 1) // BLOCK_N
    if CAUSAL:
        cnt = gl.minimum(gl.maximum(m0 + BLOCK_M + seq_k - seq_q + BLOCK_N - 1, 0) // BLOCK_N, cnt)
    return cnt


@gluon.jit(do_not_specialize=["seq_q", "sq_pad"])
def _dq_convert(DQacc, DQ, scale, seq_q, sq_pad, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                NSPLIT: gl.constexpr = 1, QMul=None, seq_k=0, MAGIC_CNT: gl.constexpr = 0, CAUSAL: gl.constexpr = 0,
                MAIN_M: gl.constexpr = 64, MAIN_N: gl.constexpr = 128):
    """dQ = scale * dQacc in dQ's dtype (dQacc float32 [NSPLIT x B, H, sq_pad, D], summed over the NSPLIT
    accumulators in order; dQ contiguous [B, H, Sq, D])."""
    m0 = gl.program_id(0) * BLOCK_M
    head = gl.program_id(1)
    ld: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
    rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ld))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, ld))
    offs = head.to(gl.int64) * sq_pad * HEAD_DIM + rows[:, None] * HEAD_DIM + cols[None, :]
    acc = gl.load(DQacc + offs)
    for sp in gl.static_range(1, NSPLIT):
        acc += gl.load(DQacc + sp * gl.num_programs(1).to(gl.int64) * sq_pad * HEAD_DIM + offs)
    if MAGIC_CNT:  # [Note] FMA rounding, FIXED_FMA 2: the adds' offsets out, mod 2^32 (rows: one main query block)
        acc = acc - _dq_adds(m0 // MAIN_M * MAIN_M, seq_q, seq_k, MAIN_M, MAIN_N, CAUSAL) * _MAGIC_BITS
    if QMul is not None:  # [Note] Fixed-point dQ: int32 units of 2^(e - 30), 2^e in [2, 4) x the row's bound
        qm = gl.load(QMul + head.to(gl.int64) * sq_pad + rows)
        dq = acc.to(gl.float32) * (scale / qm)[:, None]
    else:
        dq = acc * scale
    gl.store(DQ + head.to(gl.int64) * seq_q * HEAD_DIM + rows[:, None] * HEAD_DIM + cols[None, :],
             dq.to(DQ.dtype.element_ty), mask=rows[:, None] < seq_q)


@gluon.jit
def _bwd_query_range(n0, seq_q, seq_k, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
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
def _bwd_issue(q_desc, do_desc, l_desc, d_desc, q_smem, do_smem, l_smem, d_smem, ready, j, i, steps, lo, off_b, h0,
               num_heads, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, m_desc=None,
               m_smem=None):
    """TMA loads of step i of a tile (the program's step j): Q, dO and the rows' lse2, delta into slot j % STAGES."""
    g = i // steps
    m0 = lo + (i - g * steps) * BLOCK_M
    s = j % STAGES
    if m_desc is not None:
        mbarrier.expect(ready.index(s), 2 * q_desc.block_type.nbytes + 3 * l_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(m_desc, [off_b * num_heads + h0 + g, m0], ready.index(s), m_smem.index(s))
    else:
        mbarrier.expect(ready.index(s), 2 * q_desc.block_type.nbytes + 2 * l_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [off_b, h0 + g, m0, 0], ready.index(s),
                                    q_smem.index(s)._reinterpret(q_desc.dtype, [1, 1, BLOCK_M, HEAD_DIM], q_desc.layout))
    tma.async_copy_global_to_shared(do_desc, [off_b, h0 + g, m0, 0], ready.index(s),
                                    do_smem.index(s)._reinterpret(do_desc.dtype, [1, 1, BLOCK_M, HEAD_DIM],
                                                                  do_desc.layout))
    tma.async_copy_global_to_shared(l_desc, [off_b * num_heads + h0 + g, m0], ready.index(s), l_smem.index(s))
    tma.async_copy_global_to_shared(d_desc, [off_b * num_heads + h0 + g, m0], ready.index(s), d_smem.index(s))


@gluon.jit
def _bwd_tile(tile, num_tiles, num_bh, num_heads_kv, seq_q, seq_k, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              GQA: gl.constexpr, CAUSAL: gl.constexpr, HEAD_MAJOR: gl.constexpr):
    """Tile index -> (key block, batch, KV head, first query head, query range). Key block major, or with HEAD_MAJOR
    head major (the key blocks of one head run together: its dQ accumulator stays in L2); either way the tile this
    one waits on ([Note] Fixed-order dQ: key block n - 1, same head) has a smaller index."""
    if HEAD_MAJOR:
        n_kblk = num_tiles // num_bh
        bh = tile // n_kblk
        n_blk = tile % n_kblk
    else:
        n_blk = tile // num_bh
        bh = tile % num_bh
    off_b = bh // num_heads_kv
    off_hkv = bh % num_heads_kv
    lo, split, hi = _bwd_query_range(n_blk * BLOCK_N, seq_q, seq_k, BLOCK_M, BLOCK_N, CAUSAL)
    return n_blk, off_b, off_hkv, off_hkv * GQA, lo, split, hi


@gluon.jit
def _bwd_publish(sem, x, PENDING_GROUPS: gl.constexpr):
    """Wait until all but the PENDING_GROUPS most recent bulk groups have completed, then let the next key block
    add to the query block of `sem` ([Note] Fixed-order dQ). `x`: any scalar."""
    _bulk_wait(x, PENDING_GROUPS)
    gl.thread_barrier()
    gl.atomic_add(sem, 1, sem="release", scope="gpu")


@gluon.jit
def _bwd_dq_writer(dq_desc, dq_smem, dq_full, dq_empty, Sem, num_tiles, num_bh, num_heads_kv, seq_q, seq_k, sq_pad,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GQA: gl.constexpr, CAUSAL: gl.constexpr,
                   PENDING: gl.constexpr, HEAD_MAJOR: gl.constexpr, DQ_MODE: gl.constexpr):
    """The dQ writer warp ([Note] Fixed-order dQ, [Note] Pipelined dQ writer): for each step of the compute warps,
    in their order, wait for its turn on the query block and for its dQ_j in a shared-memory slot, add it through
    the TMA unit, free the slot once the TMA unit has read it, and publish the add PENDING steps later, once it has
    completed (every add of a tile is published before the next tile's first). One bulk group per add: triton
    commits the TMA messages of one reduce op as one group (one cp.async.bulk.commit_group in the PTX)."""
    gl.static_assert(PENDING <= 2)
    num_heads = num_heads_kv * GQA
    if DQ_MODE == 3:
        num_tiles = 0  # diagnostic: no handoff, the writer idles
    n_mblk = sq_pad // BLOCK_M
    j = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        n_blk, off_b, off_hkv, h0, lo, split, hi = _bwd_tile(tile, num_tiles, num_bh, num_heads_kv, seq_q,
                                                             seq_k, BLOCK_M, BLOCK_N, GQA, CAUSAL, HEAD_MAJOR)
        steps = (hi - lo) // BLOCK_M
        n_steps = GQA * steps
        # The counters of the adds issued one and two steps ago, not yet published. Placeholders until then, and
        # distinct values: the frontend finds loop-carried names by comparing values, so `prev2 = prev1` with equal
        # initial values would not be carried (measured: prev2 stayed the placeholder and the kernel hung).
        prev1 = Sem + 1
        prev2 = Sem + 2
        for i in range(n_steps):
            g = i // steps
            m0 = lo + (i - g * steps) * BLOCK_M
            sem = Sem + (off_b * num_heads + h0 + g).to(gl.int64) * n_mblk + m0 // BLOCK_M
            slot = j % 2
            if DQ_MODE == 0:
                seen = gl.atomic_add(sem, 0, sem="acquire", scope="gpu")
                while seen != n_blk:
                    seen = gl.atomic_add(sem, 0, sem="acquire", scope="gpu")
            mbarrier.wait(dq_full.index(slot), (j // 2) & 1)
            if DQ_MODE != 2:
                _tma_reduce_add(dq_desc, [off_b, h0 + g, m0, 0],
                                dq_smem.index(slot)._reinterpret(gl.float32,
                                                                 [1, 1, BLOCK_M, dq_desc.block_type.shape[3]],
                                                                 dq_desc.layout))
                tma.store_wait(0)  # the TMA unit has read the slot (cp.async.bulk.wait_group.read 0)
            gl.thread_barrier()
            mbarrier.arrive(dq_empty.index(slot))
            if DQ_MODE != 0:
                pass
            elif PENDING == 0:
                _bwd_publish(sem, m0, 0)  # complete, not just read: the next key block may add now
            elif PENDING == 1:
                if i > 0:
                    _bwd_publish(prev1, m0, 1)  # the add of step i - 1 has completed
                prev1 = sem
            else:
                if i > 1:
                    _bwd_publish(prev2, m0, 2)  # the add of step i - 2 has completed
                prev2 = prev1
                prev1 = sem
            j += 1
        # drain: a later tile of this program may wait on these adds (the same head's query blocks)
        if DQ_MODE != 0:
            pass
        elif PENDING == 2:
            if n_steps > 1:
                _bwd_publish(prev2, lo, 1)
        elif PENDING >= 1:
            if n_steps > 0:
                _bwd_publish(prev1, lo, 0)


@gluon.jit
def _bwd_compute(q_desc, do_desc, k_desc, v_desc, l_desc, d_desc, q_smem, do_smem, k_smem, v_smem, ds_smem, l_smem,
                 d_smem, dq_smem, ready, kv_ready, dq_full, dq_empty, DK, DV, qk_scale, scale,
                 num_tiles, num_bh, num_heads_kv, seq_q, seq_k,
                 HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                 GQA: gl.constexpr, CAUSAL: gl.constexpr, HEAD_MAJOR: gl.constexpr, DQ_MODE: gl.constexpr):
    """The compute warps (two warpgroups, 64 keys each): TMA loads, the five matmuls, dK/dV stores; dQ_j goes to the
    writer warp through a 2-slot shared-memory buffer."""
    dtype: gl.constexpr = q_desc.dtype
    s_l: gl.constexpr = _bwd_mma(8, 1, BLOCK_M)  # S^T, dP^T: [BLOCK_N keys, BLOCK_M queries]
    kv_l: gl.constexpr = _bwd_mma(8, 1, HEAD_DIM)  # dK, dV: [BLOCK_N, D]
    dq_l: gl.constexpr = _bwd_mma(4, 2, HEAD_DIM // 2)  # dQ_j: [BLOCK_M, D], the two warpgroups split D
    op_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_l, k_width=2)
    num_heads = num_heads_kv * GQA
    keys0 = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_l))
    qrow0 = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_l))
    kv_r = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, kv_l))
    kv_c = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, kv_l))
    j = 0  # steps of this program so far (ring phases)
    t = 0  # tiles of this program so far
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        n_blk, off_b, off_hkv, h0, lo, split, hi = _bwd_tile(tile, num_tiles, num_bh, num_heads_kv, seq_q,
                                                             seq_k, BLOCK_M, BLOCK_N, GQA, CAUSAL, HEAD_MAJOR)
        n0 = n_blk * BLOCK_N
        steps = (hi - lo) // BLOCK_M
        n_steps = GQA * steps
        gl.thread_barrier()  # every warp is done with the previous tile's K, V (all its wgmma waited)
        mbarrier.expect(kv_ready.index(0), 2 * k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [off_b, off_hkv, n0, 0], kv_ready.index(0),
                                        k_smem._reinterpret(dtype, [1, 1, BLOCK_N, HEAD_DIM], k_desc.layout))
        tma.async_copy_global_to_shared(v_desc, [off_b, off_hkv, n0, 0], kv_ready.index(0),
                                        v_smem._reinterpret(dtype, [1, 1, BLOCK_N, HEAD_DIM], v_desc.layout))
        if n_steps > 0:
            _bwd_issue(q_desc, do_desc, l_desc, d_desc, q_smem, do_smem, l_smem, d_smem, ready, j, 0, steps, lo, off_b,
                       h0, num_heads, BLOCK_M, HEAD_DIM, STAGES)
        dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_l)
        dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_l)
        keys = n0 + keys0
        mbarrier.wait(kv_ready.index(0), t & 1)
        for i in range(n_steps):
            m0 = lo + (i - (i // steps) * steps) * BLOCK_M
            gl.thread_barrier()  # every warp is done with the slot that step i + 1 fills, and with ds_smem
            if i + 1 < n_steps:
                _bwd_issue(q_desc, do_desc, l_desc, d_desc, q_smem, do_smem, l_smem, d_smem, ready, j + 1, i + 1,
                           steps, lo, off_b, h0, num_heads, BLOCK_M, HEAD_DIM, STAGES)
            s = j % STAGES
            mbarrier.wait(ready.index(s), (j // STAGES) & 1)
            q_s = q_smem.index(s)
            do_s = do_smem.index(s)
            st_tok = warpgroup_mma(k_smem, q_s.permute((1, 0)), gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_l),
                                   use_acc=False, is_async=True)
            dpt_tok = warpgroup_mma(v_smem, do_s.permute((1, 0)), gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_l),
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
            pt_op = gl.convert_layout(pt.to(dtype), op_l)
            dv_tok = warpgroup_mma(pt_op, do_s, dv, is_async=True)
            dpt, pt_op = warpgroup_mma_wait(1, deps=(dpt_tok, pt_op))
            delta = d_smem.index(s).reshape([BLOCK_M]).load(gl.SliceLayout(0, s_l))
            dst = (pt * (dpt - delta[None, :])).to(dtype)  # dS = P (dP - delta), softmax backward
            dst_op = gl.convert_layout(dst, op_l)
            dk_tok = warpgroup_mma(dst_op, q_s, dk, is_async=True)
            ds_smem.store(dst)
            fence_async_shared()
            gl.thread_barrier()  # both warpgroups' halves of dS^T are in shared memory
            dq_tok = warpgroup_mma(ds_smem.permute((1, 0)), k_smem, gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, dq_l),
                                   use_acc=False, is_async=True)
            dv, dk, dq, pt_op, dst_op = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, dq_tok, pt_op, dst_op))
            slot = j % 2
            if DQ_MODE == 3:  # diagnostic: no handoff; the store never runs but keeps the dQ MMA alive
                if qk_scale < 0:
                    dq_smem.index(slot).store(dq)
            else:
                mbarrier.wait(dq_empty.index(slot), ((j // 2) & 1) ^ 1)  # the writer has added what the slot held
                dq_smem.index(slot).store(dq)
                fence_async_shared()
                mbarrier.arrive(dq_full.index(slot))  # (triton puts a barrier of these warps before the arrive)
            j += 1
        dk = dk * scale  # dS was taken w.r.t. the scaled scores: dK = scale * dS^T Q
        kv_base = ((off_b * num_heads_kv + off_hkv).to(gl.int64) * seq_k + n0) * HEAD_DIM
        kv_offs = kv_r[:, None] * HEAD_DIM + kv_c[None, :]
        inside = (n0 + kv_r[:, None]) < seq_k
        gl.store(DK + kv_base + kv_offs, dk.to(dtype), mask=inside)
        gl.store(DV + kv_base + kv_offs, dv.to(dtype), mask=inside)
        t += 1


# Lengths and counts are not specialized on divisibility: one compiled kernel serves every shape.
@gluon.jit(do_not_specialize=["num_tiles", "num_bh", "num_heads_kv", "seq_q", "seq_k", "sq_pad"])
def _attn_bwd_hopper(q_desc, do_desc, k_desc, v_desc, l_desc, d_desc, dq_desc, DK, DV, Sem, qk_scale, scale,
                     num_tiles, num_bh, num_heads_kv, seq_q, seq_k, sq_pad,
                     HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                     GQA: gl.constexpr, CAUSAL: gl.constexpr, WRITER_REGS: gl.constexpr, DQ_PENDING: gl.constexpr,
                     DQ_SWIZZLE: gl.constexpr, HEAD_MAJOR: gl.constexpr, DQ_MODE: gl.constexpr):
    """[Note] Backward roles: the default partition is the 8 compute warps (launch num_warps=8); worker 0 is the dQ
    writer warp, with WRITER_REGS registers (setmaxnreg), the compute warps get the rest."""
    gl.static_assert(BLOCK_N == 128)  # two warpgroups of 64 keys
    gl.static_assert(BLOCK_M == 64)
    dtype: gl.constexpr = q_desc.dtype
    q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
    kv_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    ds_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_sl)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_sl)
    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], kv_sl)
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], kv_sl)
    ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M], ds_sl)
    l_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M], l_desc.layout)
    d_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M], d_desc.layout)
    dq_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, HEAD_DIM], gl.NVMMASharedLayout(
        swizzle_byte_width=DQ_SWIZZLE, element_bitwidth=32, rank=2))
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    dq_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for r in gl.static_range(STAGES):
        mbarrier.init(ready.index(r), count=1)
    mbarrier.init(kv_ready.index(0), count=1)
    for r in gl.static_range(2):
        mbarrier.init(dq_full.index(r), count=1)
        mbarrier.init(dq_empty.index(r), count=1)
    fence_async_shared()
    gl.warp_specialize([
        (_bwd_compute, (q_desc, do_desc, k_desc, v_desc, l_desc, d_desc, q_smem, do_smem, k_smem, v_smem, ds_smem,
                        l_smem, d_smem, dq_smem, ready, kv_ready, dq_full, dq_empty, DK, DV, qk_scale, scale,
                        num_tiles, num_bh, num_heads_kv, seq_q, seq_k, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, GQA,
                        CAUSAL, HEAD_MAJOR, DQ_MODE)),
        (_bwd_dq_writer, (dq_desc, dq_smem, dq_full, dq_empty, Sem, num_tiles, num_bh, num_heads_kv, seq_q, seq_k,
                          sq_pad, BLOCK_M, BLOCK_N, GQA, CAUSAL, DQ_PENDING, HEAD_MAJOR, DQ_MODE)),
    ], [1], [WRITER_REGS])


# ---------------------------------------------------------------------------------------------------------------
# v1: FA3's synchronisation. Partitions: default = compute warpgroup 0 (launch num_warps=4), worker 0 = compute
# warpgroup 1, worker 1 = producer warp (TMA loads), worker 2 = dQ warp (reduce-adds). Per step j (slot s = j % STAGES):
#   compute WG w (keys n0 + 64w ..): wait ready[s]; S^T_w = K_w Q^T, dP^T_w = V_w dO^T; P^T, dS^T in registers;
#     dS^T_w -> ds_smem[j % 2] rows 64w..; dV_w += P^T dO (RS); arrive + wait ds_ready[j % 2] (both halves in);
#     dQ_j[:, half w of D] = dS K[:, half w] (SS); dK_w += dS^T Q (RS); wait for dQ only; wait dq_empty[w], store
#     the fp32 half into dq_smem[w], fence, arrive dq_full[w]; wait dK; arrive empty[s].
#   producer: wait empty[s] (both WGs), load Q, dO, lse2, delta into slot s; per tile K, V (kv_empty / kv_ready).
#   dQ warp: (DQ_MODE 0: wait its turn on the query block's counter); per half: wait dq_full[w], TMA reduce-add
#     into dQacc; wait until read; arrive dq_empty[w]; (DQ_MODE 0: wait complete, release the counter).
# ---------------------------------------------------------------------------------------------------------------
V1_PRODUCER_REGS = 24  # ptxas: 240/24/24 spills less than 240/40/24 (660 vs 832 B stores)
V1_WRITER_REGS = 24
V1_COMPUTE_REGS = 240
V1_PUB_LAG = 1  # DQ_MODE 0: publish each add one step late (_v1_dq_writer)
# Levers (seventh session; each off by default until measured, docs/hopper.md "Levers on v1"):
V1_ORDER = 0  # >= 1: [Note] Wave order (full mask: rotated starts, 1 spread, d > 1 d steps apart; causal: arrival
#   order within a wave)
V1_NAMED = 0  # 1: the dQ handoff through named barriers (bar.arrive / bar.sync); 2: also the dS^T exchange
V1_EPI_TMA = 0  # 1: dK, dV leave through the warpgroup's dQ slot and a TMA store (no pointer tensors)
V1_UNORDERED = {"SNAKE": 1}  # levers the unordered mode (DQ_MODE 1) takes by default (round B: causal 478 -> 537)
V1_DQ_SPLIT = 1  # k > 1 (deterministic): key block n adds into accumulator n % k, after key block n - k only;
#   the postprocess sums the k accumulators in order (chains k times shorter, k x the float32 dQ memory)
V1_HEADROT = 0  # 1 (unordered adds only): key block n starts at query head n % GQA (_v1_order)
V1_SNAKE = 0  # 1: odd waves of tiles taken in reverse (_v1_snake: balances the causal tiles' lengths per program)
# Schedule levers (eighth session, [Note] Launch order): GRID 1 one CTA per tile (the hardware hands out tiles in
# index order as SMs free up: FA3's backward grid); SPT 1 (causal) the shortest tiles first (key blocks in
# descending order) with the adds of a query block in descending key-block order (FA3's deterministic causal);
# HGROUP g > 0: tiles in sections of g (batch, KV head) pairs, key-block major inside a section (FA3's L2 sections).
V1_GRID = 0
V1_SPT = 0
V1_HGROUP = 0
# [Note] Fixed-point dQ (DQ_MODE 4). The ordered adds of DQ_MODE 0 make a float32 sum repeatable by fixing its order,
# and pay for it in waits (the chain of key blocks per query block). Integer addition is associative: if every
# partial dQ_j is rounded to an integer multiple of a unit fixed per row before it is added, the sum is the same
# bits in any order, so the adds need no order (DQ_MODE 1's schedule: no counters, no waits, no publishes).
# The unit must come before any partial: the preprocess bounds every partial sum of row i by
#   |sum_{j in J} dS_ij K_jd| <= max|K| sum_j P_ij |dP_ij - delta_i| <= max|K| (|dO_i|_2 max_j |V_j|_2 + |delta_i|)
# (sum_j P_ij = 1, Cauchy-Schwarz on dP_ij = dO_i . V_j), takes e = ceil(log2(2 x bound)) and the multiplier
# 2^(30 - e): a partial times it is below 2^29 in magnitude, and so is the sum over key blocks, with room to spare
# for int32 (the 2 covers P and dS rounded to bf16 and P's sum above 1 by rounding). The compute warpgroups round
# dQ_j x 2^(30 - e) to int32 (cvt.rni) into the dQ slot; the dQ warp reduce-adds int32 (the TMA unit's .add on an
# INT32 tensor map); the postprocess takes acc x scale / 2^(30 - e). The error is at most half a unit, below 2^-29
# of the row's bound, per partial. On random inputs the bound is about 2^10 above the row's largest |dQ| (float64 check,
# S 2048: 3.6e-6 of max|dQ| against float32 adds' 1.5e-7 and the bf16 output's own 2.5e-3). Exact zeros hold: a
# row that sees one key has dS = 0, hence partials 0. KVB (max|K|, max_j |V_j|_2 per KV head) comes from the host.
# Named barrier ids (triton's partitions use 0 and 2 here: lab.gluon_bwd.resources' PTX): dQ full 8 + w,
# dQ empty 10 + w, dS^T exchange 12, the epilogue's meeting 13 (unused for now).
_BAR_DQ_FULL = gl.constexpr(8)
_BAR_DQ_EMPTY = gl.constexpr(10)
_BAR_DS = gl.constexpr(12)


@gluon.constexpr_function
def _bar_asm(op, bar_id, count):
    return f"bar.{op} {bar_id}, {count}; mov.b32 $0, $1;"


@gluon.jit
def _named_bar(x, OP: gl.constexpr, ID: gl.constexpr, COUNT: gl.constexpr):
    """bar.sync / bar.arrive ID, COUNT (a named barrier; arrive does not wait). `x`: any scalar (the inline asm
    needs an operand); every thread of the calling warps executes it."""
    return gl.inline_asm_elementwise(_bar_asm(OP, ID, COUNT), "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)


# [Note] Wave order (ORDER 1). The persistent grid runs tile t in wave t // programs: each program has one tile
# per wave, so the key blocks of one KV head in a wave, [n_lo, n_hi), run at about the same time. v1's deterministic
# turn on a (query head, query block) is the key block index: with the full mask every key block of a wave walks
# the query blocks in the same order, so each one queues behind the previous one's add at every step (16% lost);
# with the causal mask key block n starts 2 query blocks after n - 1 (lo = n0), so n reaches each block first and
# waits for n - 1 anyway (and with GQA 2 more steps per query head). ORDER 1 keeps waves in key-block order and,
# inside a wave, orders the adds by arrival:
#   full mask: key block n_lo + k starts its walk over the T = GQA x steps (query head, query block) pairs at
#     k * D and wraps (ORDER 1: D = T // W, W key blocks in the wave, the starts spread over the walk; ORDER d > 1:
#     D = min(d, T // W), the wave's key blocks a few steps apart, as the causal mask has them, so that a block's
#     dQ tile and Q, dO are still in L2 when the next key block comes); at any pair the earlier waves come first,
#     then the wave's key blocks in the order they reach it (each D steps after the one before): turn = n_lo +
#     #{k' whose start lies in (k D, k D + i] cyclically}, i the step. Neighbours in a wave are D steps apart.
#   causal: the wave's key blocks in descending order (the higher one starts nearer the diagonal and arrives
#     first, for every query head); the earlier waves' key blocks that see the block come first.
# Every wait goes to an earlier wave or, in the same wave, to a key block that reached the pair at an earlier or
# equal step (ties broken by index, one way): no cycle, and each program's earlier tiles never wait on its later
# ones, so the persistent grid cannot deadlock. The adds' order per query block is fixed: bitwise repeatable.
@gluon.jit
def _v1_order(tile, n_blk, bh, num_bh, n_kblk, T, CAUSAL: gl.constexpr, ORDER: gl.constexpr,
              GQA: gl.constexpr = 1, HEADROT: gl.constexpr = 0):
    """(start offset of the walk, stride D, n_lo, n_hi) of this tile ([Note] Wave order). HEADROT (unordered adds
    only): key block n starts its walk at query head n % GQA, so that the key blocks of a KV head that run side by
    side add to different query heads' dQ tiles (where the full mask's ORDER does not rotate already)."""
    P = gl.num_programs(0)
    w0 = (tile // P) * P
    n_lo = (gl.maximum(w0 - bh, 0) + num_bh - 1) // num_bh
    n_hi = gl.minimum((gl.maximum(w0 + P - bh, 0) + num_bh - 1) // num_bh, n_kblk)
    D = T // gl.maximum(n_hi - n_lo, 1)
    if ORDER > 1:
        D = gl.minimum(D, ORDER)
    off = 0
    if HEADROT:
        off = (n_blk % GQA) * (T // GQA)
    if ORDER >= 1:
        if not CAUSAL:
            off = (n_blk - n_lo) * D
    return off, D, n_lo, n_hi


@gluon.jit
def _v1_snake(tile, num_tiles, SNAKE: gl.constexpr):
    """SNAKE 1: in every odd full wave the programs take its tiles in reverse (program p the wave's tile P - 1 - p),
    so a program that drew a long tile (a low key block: causal tiles shrink with the key block) in one wave draws
    a short one in the next. Waves and each program's increasing tile order are kept ([Note] Wave order)."""
    if SNAKE:
        P = gl.num_programs(0)
        w = tile // P
        if ((w % 2) == 1) & ((w + 1) * P <= num_tiles):
            tile = w * P + (P - 1 - gl.program_id(0))
    return tile


# [Note] Launch order. A tile index maps to (key block, (batch, KV head)) key-block major: the 132 tiles that run
# at once hold about 8 key blocks of every head. With the persistent grid each program takes every 132nd tile, so
# a program whose tile ran late (it waited for its turns) starts its next tile late, and with the full mask every
# wave's key blocks of a head start together at query block 0 and queue at each block's counter: the lags add up
# wave after wave. GRID 1 launches one CTA per tile (FA3's backward): an SM that finishes takes the next tile, so
# a tile starts after every smaller one has started, and the key block a tile waits for has a head start (with
# the full mask about 16 tiles of launches) instead of starting with it. Causal, SPT 1 (FA3's SingleTileBwdLPT
# scheduler with SPT and its descending dQ semaphore): tile order descending in the key block (shortest tiles
# first: causal tiles shrink with the key block) and the adds of query block m in descending key-block order:
# turn = cnt - 1 - n, cnt the key blocks that see m. The higher key block starts earlier and nearer the diagonal,
# so it reaches m first: the order of the turns is the order of arrival. HGROUP g: the tiles in sections of g
# (batch, KV head) pairs, key-block major inside a section, so that fewer heads' Q, dO and float32 dQ tiles are in
# flight (L2). Either way a tile waits only for tiles of smaller index: with the persistent grid they are a
# program's earlier tiles or another program's, never a later tile of its own; with GRID 1 they were launched
# before it (CUDA hands out the blocks of a 1-D grid in index order, as FA3 relies on). No cycle, no deadlock.
@gluon.jit
def _v1_sched(tile, num_tiles, num_bh, SPT: gl.constexpr, HGROUP: gl.constexpr):
    """The tile index _bwd_tile reads (key block major) for launch position `tile` ([Note] Launch order)."""
    n_kblk = num_tiles // num_bh
    if HGROUP > 0:
        sec = tile // (HGROUP * n_kblk)
        r = tile - sec * (HGROUP * n_kblk)
        gs = gl.minimum(num_bh - sec * HGROUP, HGROUP)
        n = r // gs
        bh = sec * HGROUP + (r - n * gs)
    else:
        n = tile // num_bh
        bh = tile - n * num_bh
    if SPT:
        n = n_kblk - 1 - n
    return n * num_bh + bh


@gluon.jit
def _v1_visit(i, off, T):
    """The flat (query head, query block) index of step i: the walk starts at off and wraps at T."""
    f = i + off
    return gl.where(f >= T, f - T, f)


@gluon.jit
def _v1_turn(n_blk, i, m0, off, D, n_lo, n_hi, T, n_kblk, shift, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
             CAUSAL: gl.constexpr, ORDER: gl.constexpr, DQ_SPLIT: gl.constexpr = 1, SPT: gl.constexpr = 0):
    """How many key blocks add to this step's (query head, query block) before this one ([Note] Wave order); with
    DQ_SPLIT k, in its accumulator n % k: the key blocks n - k, n - 2k, ... (all see the block if this one does)."""
    turn = n_blk
    if DQ_SPLIT > 1:
        turn = n_blk // DQ_SPLIT
    if SPT:  # [Note] Launch order: the key blocks that see the block, in descending order
        if CAUSAL:
            cnt = gl.minimum(gl.maximum(m0 + BLOCK_M + shift + BLOCK_N - 1, 0) // BLOCK_N, n_kblk)
            turn = cnt - 1 - n_blk
        else:
            turn = n_kblk - 1 - n_blk
    if ORDER >= 1:
        if CAUSAL:  # key blocks [0, cnt) see query block m0 (lo is monotone in the key block)
            cnt = gl.minimum(gl.maximum(m0 + BLOCK_M + shift + BLOCK_N - 1, 0) // BLOCK_N, n_kblk)
            turn = gl.minimum(n_lo, cnt) + gl.minimum(n_hi, cnt) - n_blk - 1
        else:
            if D > 0:
                k = n_blk - n_lo
                c1 = gl.minimum(i // D, n_hi - n_lo - k - 1)  # starts k D + D, k D + 2 D, ... before the wrap
                c2 = gl.maximum(k - (T - i + D - 1) // D + 1, 0)  # starts (k - u) D, u = 1..k, after it
                turn = n_lo + c1 + c2
    return turn


@gluon.jit
def _v1_producer(q_desc, do_desc, k_desc, v_desc, l_desc, d_desc, q_smem, do_smem, k_smem, v_smem, l_smem, d_smem,
                 ready, empty, kv_ready, kv_empty, num_tiles, num_bh, num_heads_kv, seq_q, seq_k,
                 HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                 GQA: gl.constexpr, CAUSAL: gl.constexpr, ORDER: gl.constexpr, SNAKE: gl.constexpr,
                 HEADROT: gl.constexpr, SPT: gl.constexpr, HGROUP: gl.constexpr, m_desc, m_smem):
    num_heads = num_heads_kv * GQA
    dtype: gl.constexpr = q_desc.dtype
    n_kblk = num_tiles // num_bh
    j = 0
    t = 0
    for tile0 in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        tile = _v1_sched(_v1_snake(tile0, num_tiles, SNAKE), num_tiles, num_bh, SPT, HGROUP)
        n_blk, off_b, off_hkv, h0, lo, split, hi = _bwd_tile(tile, num_tiles, num_bh, num_heads_kv, seq_q, seq_k,
                                                             BLOCK_M, BLOCK_N, GQA, CAUSAL, 0)
        n0 = n_blk * BLOCK_N
        steps = (hi - lo) // BLOCK_M
        n_steps = GQA * steps
        off, D, n_lo, n_hi = _v1_order(tile, n_blk, off_b * num_heads_kv + off_hkv, num_bh, n_kblk, n_steps, CAUSAL,
                                       ORDER, GQA, HEADROT)
        mbarrier.wait(kv_empty.index(0), (t & 1) ^ 1)  # both warpgroups are done with the previous tile's K, V
        mbarrier.expect(kv_ready.index(0), 2 * k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [off_b, off_hkv, n0, 0], kv_ready.index(0),
                                        k_smem._reinterpret(dtype, [1, 1, BLOCK_N, HEAD_DIM], k_desc.layout))
        tma.async_copy_global_to_shared(v_desc, [off_b, off_hkv, n0, 0], kv_ready.index(0),
                                        v_smem._reinterpret(dtype, [1, 1, BLOCK_N, HEAD_DIM], v_desc.layout))
        for i in range(n_steps):
            s = j % STAGES
            mbarrier.wait(empty.index(s), ((j // STAGES) & 1) ^ 1)
            _bwd_issue(q_desc, do_desc, l_desc, d_desc, q_smem, do_smem, l_smem, d_smem, ready, j,
                       _v1_visit(i, off, n_steps), steps, lo, off_b, h0, num_heads, BLOCK_M, HEAD_DIM, STAGES, m_desc,
                       m_smem)
            j += 1
        t += 1


@gluon.jit
def _v1_dq_writer(dq_desc, dq_smem, dq_full, dq_empty, Sem, num_tiles, num_bh, num_heads_kv, seq_q, seq_k, sq_pad,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GQA: gl.constexpr, CAUSAL: gl.constexpr,
                  DQ_MODE: gl.constexpr, PUB_LAG: gl.constexpr, ORDER: gl.constexpr, NAMED: gl.constexpr,
                  SNAKE: gl.constexpr, HEADROT: gl.constexpr, DQ_SPLIT: gl.constexpr, SPT: gl.constexpr,
                  HGROUP: gl.constexpr):
    """DQ_MODE 0: PUB_LAG 0 publishes a step's add once complete, before the next step; PUB_LAG 1 publishes it
    after the next step's reduces are issued (cp.async.bulk.wait_group 2: two bulk groups, one per half, per
    step), and drains at the tile's end, as c68d572's [Note] Pipelined dQ writer."""
    num_heads = num_heads_kv * GQA
    n_mblk = sq_pad // BLOCK_M
    half: gl.constexpr = dq_desc.block_type.shape[3]
    NS: gl.constexpr = dq_smem.shape[0] // 2  # dQ slots per warpgroup (DQ_SLOTS)
    if DQ_MODE == 3:
        num_tiles = 0  # diagnostic: no handoff, the dQ warp idles
    gl.static_assert((NAMED == 0) | (NS == 1))
    n_kblk = num_tiles // num_bh
    shift = seq_k - seq_q
    j = 0
    for tile0 in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        tile = _v1_sched(_v1_snake(tile0, num_tiles, SNAKE), num_tiles, num_bh, SPT, HGROUP)
        n_blk, off_b, off_hkv, h0, lo, split, hi = _bwd_tile(tile, num_tiles, num_bh, num_heads_kv, seq_q, seq_k,
                                                             BLOCK_M, BLOCK_N, GQA, CAUSAL, 0)
        steps = (hi - lo) // BLOCK_M
        n_steps = GQA * steps
        off, D, n_lo, n_hi = _v1_order(tile, n_blk, off_b * num_heads_kv + off_hkv, num_bh, n_kblk, n_steps, CAUSAL,
                                       ORDER, GQA, HEADROT)
        ob = (n_blk % DQ_SPLIT) * (num_bh // num_heads_kv) + off_b  # the batch index in the split accumulators
        prev = Sem + 1  # the counter of the add published late (PUB_LAG 1); a placeholder until step 1
        for i in range(n_steps):
            f = _v1_visit(i, off, n_steps)
            g = f // steps
            m0 = lo + (f - g * steps) * BLOCK_M
            sem = Sem + (ob * num_heads + h0 + g).to(gl.int64) * n_mblk + m0 // BLOCK_M
            if DQ_MODE == 0:
                turn = _v1_turn(n_blk, i, m0, off, D, n_lo, n_hi, n_steps, n_kblk, shift, BLOCK_M, BLOCK_N, CAUSAL,
                                ORDER, DQ_SPLIT, SPT)
                seen = gl.atomic_add(sem, 0, sem="acquire", scope="gpu")
                while seen != turn:
                    seen = gl.atomic_add(sem, 0, sem="acquire", scope="gpu")
            base = (j % NS) * 2
            for w in gl.static_range(2):
                if NAMED >= 1:
                    _named_bar(j, "sync", _BAR_DQ_FULL + w, 160)  # warpgroup w's threads stored and fenced
                else:
                    mbarrier.wait(dq_full.index(base + w), (j // NS) & 1)
                if DQ_MODE != 2:
                    _tma_reduce_add(dq_desc, [ob, h0 + g, m0, w * half],
                                    dq_smem.index(base + w)._reinterpret(dq_desc.dtype, [1, 1, BLOCK_M, half],
                                                                         dq_desc.layout))
            if DQ_MODE != 2:
                tma.store_wait(0)  # the TMA unit has read both halves (the issuing thread waits)
            if NAMED >= 1:  # every thread arrives; the issuing thread only after its wait: the slot is free then
                _named_bar(j, "arrive", _BAR_DQ_EMPTY, 160)
                _named_bar(j, "arrive", _BAR_DQ_EMPTY + 1, 160)
            else:
                gl.thread_barrier()
                mbarrier.arrive(dq_empty.index(base))
                mbarrier.arrive(dq_empty.index(base + 1))
            if DQ_MODE == 0:
                if PUB_LAG == 0:
                    _bwd_publish(sem, m0, 0)  # complete: the next key block may add now
                else:
                    if i > 0:
                        _bwd_publish(prev, m0, 2)  # the previous step's two adds are complete
                    prev = sem
            j += 1
        if DQ_MODE == 0:
            if PUB_LAG == 1:
                if n_steps > 0:
                    _bwd_publish(prev, lo, 0)  # drain: a later tile of this program may wait on it


@gluon.jit
def _v1_compute(q_smem, do_smem, k_smem, v_smem, ds_smem, l_smem, d_smem, dq_smem, ready, empty, kv_ready, kv_empty,
                ds_ready, dq_full, dq_empty, DK, DV, qk_scale, scale, num_tiles, num_bh, num_heads_kv, seq_q, seq_k,
                WG: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                STAGES: gl.constexpr, GQA: gl.constexpr, CAUSAL: gl.constexpr, DQ_MODE: gl.constexpr,
                ORDER: gl.constexpr, NAMED: gl.constexpr, EPI_TMA: gl.constexpr, SNAKE: gl.constexpr,
                HEADROT: gl.constexpr, SPT: gl.constexpr, HGROUP: gl.constexpr, m_smem, FIXED_MUT: gl.constexpr,
                FIXED_FMA: gl.constexpr = 0):
    """One compute warpgroup: keys n0 + 64 WG .. + 64 of each tile, half WG of dQ_j's head dim."""
    dtype: gl.constexpr = k_smem.dtype
    WN: gl.constexpr = BLOCK_N // 2  # keys of this warpgroup
    DH: gl.constexpr = HEAD_DIM // 2  # dQ columns of this warpgroup
    s_l: gl.constexpr = _bwd_mma(4, 1, BLOCK_M)  # S^T, dP^T: [WN keys, BLOCK_M queries]
    kv_l: gl.constexpr = _bwd_mma(4, 1, HEAD_DIM)  # dK, dV: [WN, D]
    dq_l: gl.constexpr = _bwd_mma(4, 1, DH)  # dQ_j half: [BLOCK_M, DH]
    op_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_l, k_width=2)
    keys0 = gl.arange(0, WN, layout=gl.SliceLayout(1, s_l)) + WG * WN
    qrow0 = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_l))
    kv_r = gl.arange(0, WN, layout=gl.SliceLayout(1, kv_l)) + WG * WN
    kv_c = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, kv_l))
    k_w = k_smem.slice(WG * WN, WN, dim=0)
    v_w = v_smem.slice(WG * WN, WN, dim=0)
    k_h = k_smem.slice(WG * DH, DH, dim=1)
    NS: gl.constexpr = dq_smem.shape[0] // 2  # dQ slots per warpgroup (DQ_SLOTS)
    gl.static_assert(((NAMED == 0) & (EPI_TMA == 0)) | (NS == 1))
    n_kblk = num_tiles // num_bh
    owed = 0  # NAMED: a dQ-empty sync owed for the last handoff (the dQ warp arrives once per step)
    j = 0
    t = 0
    for tile0 in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        tile = _v1_sched(_v1_snake(tile0, num_tiles, SNAKE), num_tiles, num_bh, SPT, HGROUP)
        n_blk, off_b, off_hkv, h0, lo, split, hi = _bwd_tile(tile, num_tiles, num_bh, num_heads_kv, seq_q, seq_k,
                                                             BLOCK_M, BLOCK_N, GQA, CAUSAL, 0)
        n0 = n_blk * BLOCK_N
        steps = (hi - lo) // BLOCK_M
        n_steps = GQA * steps
        off, D, n_lo, n_hi = _v1_order(tile, n_blk, off_b * num_heads_kv + off_hkv, num_bh, n_kblk, n_steps, CAUSAL,
                                       ORDER, GQA, HEADROT)
        dk = gl.zeros([WN, HEAD_DIM], gl.float32, kv_l)
        dv = gl.zeros([WN, HEAD_DIM], gl.float32, kv_l)
        keys = n0 + keys0
        mbarrier.wait(kv_ready.index(0), t & 1)
        for i in range(n_steps):
            f = _v1_visit(i, off, n_steps)
            m0 = lo + (f - (f // steps) * steps) * BLOCK_M
            s = j % STAGES
            mbarrier.wait(ready.index(s), (j // STAGES) & 1)
            q_s = q_smem.index(s)
            do_s = do_smem.index(s)
            st_tok = warpgroup_mma(k_w, q_s.permute((1, 0)), gl.zeros([WN, BLOCK_M], gl.float32, s_l),
                                   use_acc=False, is_async=True)
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
            dst = (pt * (dpt - delta[None, :])).to(dtype)  # dS = P (dP - delta), softmax backward
            dsb = j % 2
            ds_smem.index(dsb).slice(WG * WN, WN, dim=0).store(dst)
            pt_op = gl.convert_layout(pt.to(dtype), op_l)
            dv_tok = warpgroup_mma(pt_op, do_s, dv, is_async=True)
            fence_async_shared()
            if NAMED >= 2:
                _named_bar(j, "sync", _BAR_DS, 256)  # both warpgroups' halves of dS^T are in
            else:
                mbarrier.arrive(ds_ready.index(dsb))
                mbarrier.wait(ds_ready.index(dsb), (j // 2) & 1)  # both warpgroups' halves of dS^T are in
            dq_tok = warpgroup_mma(ds_smem.index(dsb).permute((1, 0)), k_h, gl.zeros([BLOCK_M, DH], gl.float32, dq_l),
                                   use_acc=False, is_async=True)
            dst_op = gl.convert_layout(dst, op_l)
            dk_tok = warpgroup_mma(dst_op, q_s, dk, is_async=True)
            dv, dq, pt_op = warpgroup_mma_wait(1, deps=(dv_tok, dq_tok, pt_op))
            if DQ_MODE == 4:  # [Note] Fixed-point dQ: int32 units of 2^(e - 30), 2^e in [2, 4) x the row's bound
                qm = m_smem.index(s).reshape([BLOCK_M]).load(gl.SliceLayout(1, dq_l))
                if FIXED_MUT:  # mutant: the row scale left out (the units lost)
                    qm = gl.full_like(qm, 1.0)
                if FIXED_FMA == 3:  # diagnostic (wrong dQ): the int32 adds without any rounding (a bitcast)
                    dq = dq.to(gl.int32, bitcast=True)
                elif FIXED_FMA:  # [Note] FMA rounding: units of 2^(e - 22), one FFMA (and one IADD: FIXED_FMA 1)
                    dq = _fma_rni(dq, qm[:, None], FIXED_FMA == 1)
                else:
                    dq = _cvt_rni(dq * qm[:, None])
            if DQ_MODE == 3:  # diagnostic: no handoff; the store never runs but keeps the dQ MMA alive
                if qk_scale < 0:
                    dq_smem.index(WG).store(dq)
            elif NAMED >= 1:  # FA3's handoff: wait for the slot (bar.sync), store, fence, bar.arrive (no wait)
                if owed:
                    _named_bar(j, "sync", _BAR_DQ_EMPTY + WG, 160)
                dq_smem.index(WG).store(dq)
                fence_async_shared()
                _named_bar(j, "arrive", _BAR_DQ_FULL + WG, 160)
                owed = 1
            else:
                dqs = (j % NS) * 2 + WG
                mbarrier.wait(dq_empty.index(dqs), ((j // NS) & 1) ^ 1)  # the dQ warp has added what it held
                dq_smem.index(dqs).store(dq)
                fence_async_shared()
                mbarrier.arrive(dq_full.index(dqs))
            dk, dst_op = warpgroup_mma_wait(0, deps=(dk_tok, dst_op))
            mbarrier.arrive(empty.index(s))  # this warpgroup is done with Q, dO, lse2, delta of slot s
            j += 1
        mbarrier.arrive(kv_empty.index(0))
        dk = dk * scale  # dS was taken w.r.t. the scaled scores: dK = scale * dS^T Q
        if EPI_TMA:  # through this warpgroup's dQ slot ([64, 64] float32 = [64, 128] bf16) and the TMA unit
            if DQ_MODE != 3:
                if NAMED >= 1:
                    if owed:
                        _named_bar(j, "sync", _BAR_DQ_EMPTY + WG, 160)
                    owed = 0
                else:
                    mbarrier.wait(dq_empty.index(WG), (j & 1) ^ 1)  # the dQ warp has read the last half
            stage = dq_smem.index(WG)._reinterpret(dtype, [WN, HEAD_DIM],
                                                   gl.NVMMASharedLayout.get_default_for([WN, HEAD_DIM], dtype))
            stage4 = dq_smem.index(WG)._reinterpret(dtype, [1, 1, WN, HEAD_DIM], DK.layout)
            stage.store(dv.to(dtype))
            fence_async_shared()
            gl.thread_barrier()
            tma.async_copy_shared_to_global(DV, [off_b, off_hkv, n0 + WG * WN, 0], stage4)  # rows past Sk: clipped
            tma.store_wait(0)
            gl.thread_barrier()
            stage.store(dk.to(dtype))
            fence_async_shared()
            gl.thread_barrier()
            tma.async_copy_shared_to_global(DK, [off_b, off_hkv, n0 + WG * WN, 0], stage4)
            tma.store_wait(0)
            gl.thread_barrier()  # the slot is free again for the next step's dQ half
        else:
            kv_base = ((off_b * num_heads_kv + off_hkv).to(gl.int64) * seq_k + n0) * HEAD_DIM
            kv_offs = kv_r[:, None] * HEAD_DIM + kv_c[None, :]
            inside = (n0 + kv_r[:, None]) < seq_k
            gl.store(DK + kv_base + kv_offs, dk.to(dtype), mask=inside)
            gl.store(DV + kv_base + kv_offs, dv.to(dtype), mask=inside)
        t += 1
    if NAMED >= 1:
        if owed:  # the dQ warp's arrive for the last handoff: consume it, leave the barrier idle at exit
            _named_bar(j, "sync", _BAR_DQ_EMPTY + WG, 160)


@gluon.jit(do_not_specialize=["num_tiles", "num_bh", "num_heads_kv", "seq_q", "seq_k", "sq_pad"])
def _attn_bwd_v1(q_desc, do_desc, k_desc, v_desc, l_desc, d_desc, dq_desc, DK, DV, Sem, qk_scale, scale,
                 num_tiles, num_bh, num_heads_kv, seq_q, seq_k, sq_pad,
                 HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                 GQA: gl.constexpr, CAUSAL: gl.constexpr, DQ_MODE: gl.constexpr, COMPUTE_REGS: gl.constexpr,
                 PRODUCER_REGS: gl.constexpr, WRITER_REGS: gl.constexpr, PUB_LAG: gl.constexpr,
                 DQ_SLOTS: gl.constexpr, ORDER: gl.constexpr = 0, NAMED: gl.constexpr = 0,
                 EPI_TMA: gl.constexpr = 0, SNAKE: gl.constexpr = 0, HEADROT: gl.constexpr = 0,
                 DQ_SPLIT: gl.constexpr = 1, GRID: gl.constexpr = 0, SPT: gl.constexpr = 0,
                 HGROUP: gl.constexpr = 0, m_desc=None, FIXED_MUT: gl.constexpr = 0,
                 FIXED_FMA: gl.constexpr = 0):
    gl.static_assert(BLOCK_N == 128)  # two warpgroups of 64 keys
    gl.static_assert((DQ_MODE == 4) == (m_desc is not None))
    gl.static_assert(((SPT == 0) & (HGROUP == 0)) | ((ORDER == 0) & (DQ_SPLIT == 1)))  # [Note] Launch order
    gl.static_assert((BLOCK_M == 64) | (BLOCK_M == 128))
    gl.static_assert((HEADROT == 0) | (DQ_MODE != 0))  # the turns assume each head's walk in key-block order
    gl.static_assert((DQ_SPLIT == 1) | (ORDER == 0))  # a split accumulator's turn: n // DQ_SPLIT
    dtype: gl.constexpr = q_desc.dtype
    q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
    kv_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    ds_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_sl)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_sl)
    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], kv_sl)
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], kv_sl)
    ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ds_sl)
    l_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M], l_desc.layout)
    d_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M], d_desc.layout)
    dq_smem = gl.allocate_shared_memory(dq_desc.dtype, [2 * DQ_SLOTS, BLOCK_M, HEAD_DIM // 2], gl.NVMMASharedLayout(
        swizzle_byte_width=128, element_bitwidth=32, rank=2))
    m_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M], l_desc.layout)
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
    mbarrier.init(kv_ready.index(0), count=1)
    mbarrier.init(kv_empty.index(0), count=2)
    for r in gl.static_range(2):
        mbarrier.init(ds_ready.index(r), count=2)
    fence_async_shared()
    gl.warp_specialize([
        (_v1_compute, (q_smem, do_smem, k_smem, v_smem, ds_smem, l_smem, d_smem, dq_smem, ready, empty, kv_ready, kv_empty,
                      ds_ready, dq_full, dq_empty, DK, DV, qk_scale, scale, num_tiles, num_bh, num_heads_kv, seq_q,
                      seq_k, 0, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, GQA, CAUSAL, DQ_MODE, ORDER, NAMED, EPI_TMA,
                      SNAKE, HEADROT, SPT, HGROUP, m_smem, FIXED_MUT, FIXED_FMA)),
        (_v1_compute, (q_smem, do_smem, k_smem, v_smem, ds_smem, l_smem, d_smem, dq_smem, ready, empty, kv_ready, kv_empty,
                      ds_ready, dq_full, dq_empty, DK, DV, qk_scale, scale, num_tiles, num_bh, num_heads_kv, seq_q,
                      seq_k, 1, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, GQA, CAUSAL, DQ_MODE, ORDER, NAMED, EPI_TMA,
                      SNAKE, HEADROT, SPT, HGROUP, m_smem, FIXED_MUT, FIXED_FMA)),
        (_v1_producer, (q_desc, do_desc, k_desc, v_desc, l_desc, d_desc, q_smem, do_smem, k_smem, v_smem, l_smem,
                        d_smem, ready, empty, kv_ready, kv_empty, num_tiles, num_bh, num_heads_kv, seq_q, seq_k,
                        HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, GQA, CAUSAL, ORDER, SNAKE,
                        HEADROT, SPT, HGROUP, m_desc, m_smem)),
        (_v1_dq_writer, (dq_desc, dq_smem, dq_full, dq_empty, Sem, num_tiles, num_bh, num_heads_kv, seq_q, seq_k,
                         sq_pad, BLOCK_M, BLOCK_N, GQA, CAUSAL, DQ_MODE, PUB_LAG, ORDER, NAMED, SNAKE,
                         HEADROT, DQ_SPLIT, SPT, HGROUP)),
    ], [4, 1, 1], [COMPUTE_REGS, PRODUCER_REGS, WRITER_REGS])


def _v1_args(q, do, k, v, lse2, delta, dq_acc, dk, dv, sem, scale, num_tiles, num_bh, hkv, sq, sk, sq_pad, causal,
             dq_mode, block_m=BWD_BLOCK_M, **constexprs):
    """(args, constexprs) of _attn_bwd_v1; `constexprs` override the module defaults. With EPI_TMA, DK and DV are
    TMA descriptors in boxes of one warpgroup's [64, D] rows, else pointers."""
    gqa = q.shape[1] // k.shape[1]
    d = q.shape[-1]
    kw = dict(HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=BWD_BLOCK_N, STAGES=BWD_STAGES, GQA=gqa, CAUSAL=causal,
              DQ_MODE=dq_mode, COMPUTE_REGS=V1_COMPUTE_REGS, PRODUCER_REGS=V1_PRODUCER_REGS,
              WRITER_REGS=V1_WRITER_REGS, PUB_LAG=V1_PUB_LAG, DQ_SLOTS=1, ORDER=V1_ORDER, NAMED=V1_NAMED,
              EPI_TMA=V1_EPI_TMA, SNAKE=V1_SNAKE, HEADROT=V1_HEADROT, DQ_SPLIT=V1_DQ_SPLIT, GRID=V1_GRID, SPT=V1_SPT,
              HGROUP=V1_HGROUP, num_warps=4)
    if dq_mode in (1, 4):
        kw.update(V1_UNORDERED)
    kw.update(constexprs)
    if kw["EPI_TMA"]:
        dk, dv = _descriptor(dk, BWD_BLOCK_N // 2), _descriptor(dv, BWD_BLOCK_N // 2)
    args = (_descriptor(q, block_m), _descriptor(do, block_m), _descriptor(k, BWD_BLOCK_N),
            _descriptor(v, BWD_BLOCK_N), _bwd_row_descriptor(lse2, block_m), _bwd_row_descriptor(delta, block_m),
            _bwd_acc_descriptor(dq_acc, block_m, cols=d // 2, swizzle=128), dk, dv, sem, scale * 1.4426950408889634,
            scale, num_tiles, num_bh, hkv, sq, sk, sq_pad)
    return args, kw


def _bwd_acc_descriptor(t, block_m=BWD_BLOCK_M, cols=None, swizzle=BWD_DQ_SWIZZLE):
    """The float32 dQ accumulator [B, H, sq_pad, D] in boxes of [block_m, cols] (default D)."""
    layout = gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=32, rank=4)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, block_m, cols or t.shape[-1]], layout)


def _bwd_row_descriptor(t, block_m=BWD_BLOCK_M):
    """lse2 / delta [B, H, sq_pad] float32, as [B * H, sq_pad] in boxes of one row of block_m."""
    t2 = t.view(-1, t.shape[-1])
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    return TensorDescriptor(t2, list(t2.shape), list(t2.stride()), [1, block_m], layout)


def _sms(device):
    dev = device.index if device.index is not None else torch.cuda.current_device()
    if dev not in _NUM_SMS:
        _NUM_SMS[dev] = torch.cuda.get_device_properties(dev).multi_processor_count
    return _NUM_SMS[dev]


def _v0_args(q, do, k, v, lse2, delta, dq_acc, dk, dv, sem, scale, num_tiles, num_bh, hkv, sq, sk, sq_pad, causal,
             dq_mode):
    gqa = q.shape[1] // k.shape[1]
    args = (_descriptor(q, BWD_BLOCK_M), _descriptor(do, BWD_BLOCK_M), _descriptor(k, BWD_BLOCK_N),
            _descriptor(v, BWD_BLOCK_N), _bwd_row_descriptor(lse2), _bwd_row_descriptor(delta),
            _bwd_acc_descriptor(dq_acc), dk, dv, sem, scale * 1.4426950408889634, scale,
            num_tiles, num_bh, hkv, sq, sk, sq_pad)
    kw = dict(HEAD_DIM=q.shape[-1], BLOCK_M=BWD_BLOCK_M, BLOCK_N=BWD_BLOCK_N, STAGES=BWD_STAGES, GQA=gqa,
              CAUSAL=causal, WRITER_REGS=BWD_WRITER_REGS, DQ_PENDING=BWD_DQ_PENDING, DQ_SWIZZLE=BWD_DQ_SWIZZLE,
              HEAD_MAJOR=BWD_HEAD_MAJOR, DQ_MODE=dq_mode, num_warps=8)
    return args, kw


def backward(do, q, k, v, out, lse, scale, causal, variant="v0", dq_mode=0, block_m=BWD_BLOCK_M, **constexprs):
    """(dq, dk, dv) for contiguous bf16/fp16 [B, H, S, D] inputs; lse [B, Hq, Sq] natural log from the forward.
    variant "v0" (c68d572) or "v1" (FA3 synchronisation); dq_mode as the module docstring says."""
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    q, k, v, do, out = (t.contiguous() for t in (q, k, v, do, out))
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    sq_pad = triton.cdiv(sq, block_m) * block_m  # block_m: 64 or 128 (v1 only), a multiple of the pre/post 64
    delta = torch.empty((b, hq, sq_pad), dtype=torch.float32, device=q.device)
    lse2 = torch.empty_like(delta)
    fixed = variant == "v1" and dq_mode == 4
    qmul = kvb = None
    if fixed:  # [Note] Fixed-point dQ
        qmul = torch.empty_like(delta)
        kvb = torch.stack([k.abs().amax(dim=(2, 3)).float(), torch.linalg.vector_norm(v, dim=-1).amax(-1).float()],
                          -1).contiguous()
    _bwd_preprocess[(sq_pad // BWD_BLOCK_M, b * hq)](out, do, lse.contiguous(), delta, lse2, sq, sq_pad,
                                                     HEAD_DIM=d, BLOCK_M=BWD_BLOCK_M, QMul=qmul, KVB=kvb,
                                                     GQA=hq // hkv, QBITS=22 if constexprs.get("FIXED_FMA") else 30,
                                                     num_warps=4)
    nsplit = constexprs.get("DQ_SPLIT", V1_DQ_SPLIT) if variant == "v1" else 1
    dq_acc = torch.zeros((nsplit * b, hq, sq_pad, d), dtype=torch.int32 if fixed else torch.float32, device=q.device)
    sem = torch.zeros((nsplit * b, hq, sq_pad // block_m), dtype=torch.int32, device=q.device)
    num_bh = b * hkv
    num_tiles = triton.cdiv(sk, BWD_BLOCK_N) * num_bh
    grid = (min(num_tiles, _sms(q.device)), )  # every program resident: the fixed-order dQ needs it
    if variant == "v1" and constexprs.get("GRID", V1_GRID):
        grid = (num_tiles, )  # [Note] Launch order
    if variant == "v0":
        args, kw = _v0_args(q, do, k, v, lse2, delta, dq_acc, dk, dv, sem, scale, num_tiles, num_bh, hkv, sq, sk,
                            sq_pad, causal, dq_mode)
        _attn_bwd_hopper[grid](*args, **kw)
    else:
        args, kw = _v1_args(q, do, k, v, lse2, delta, dq_acc, dk, dv, sem, scale, num_tiles, num_bh, hkv, sq, sk,
                            sq_pad, causal, dq_mode, block_m, **constexprs)
        if fixed:
            kw["m_desc"] = _bwd_row_descriptor(qmul, block_m)
        _attn_bwd_v1[grid](*args, **kw)
    magic = fixed and constexprs.get("FIXED_FMA") == 2  # [Note] FMA rounding: the adds' offsets out
    _dq_convert[(sq_pad // BWD_BLOCK_M, b * hq)](dq_acc, dq, scale, sq, sq_pad, HEAD_DIM=d, BLOCK_M=BWD_BLOCK_M,
                                                 NSPLIT=nsplit, QMul=qmul, seq_k=sk, MAGIC_CNT=int(magic),
                                                 CAUSAL=int(causal), MAIN_M=block_m, MAIN_N=BWD_BLOCK_N, num_warps=4)
    return dq, dk, dv


def compile_for(variant="v0", head_dim=128, gqa=1, causal=True, dq_mode=0, dtype=torch.bfloat16, seq_q=1000,
                seq_k=1000, block_m=BWD_BLOCK_M, **constexprs):
    """Build the main kernel for sm_90 without a GPU (triton's bundled ptxas); returns the CompiledKernel."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    sq_pad = triton.cdiv(seq_q, block_m) * block_m
    q = torch.empty((1, gqa, seq_q, head_dim), dtype=dtype)
    k = torch.empty((1, 1, seq_k, head_dim), dtype=dtype)
    rows = torch.empty((1, gqa, sq_pad), dtype=torch.float32)
    acc = torch.empty((1, gqa, sq_pad, head_dim), dtype=torch.int32 if dq_mode == 4 else torch.float32)
    sem = torch.empty(4, dtype=torch.int32)
    fn, argf = (_attn_bwd_hopper, _v0_args) if variant == "v0" else (_attn_bwd_v1, _v1_args)
    if variant == "v1":
        args, kw = argf(q, q, k, k, rows, rows, acc, k, k, sem, 0.5, 2, 2, 2, seq_q, seq_k, sq_pad, causal, dq_mode,
                        block_m, **constexprs)
    else:
        args, kw = argf(q, q, k, k, rows, rows, acc, k, k, sem, 0.5, 2, 2, 2, seq_q, seq_k, sq_pad, causal, dq_mode)
        kw.update(constexprs)
    if variant == "v1" and dq_mode == 4:
        kw["m_desc"] = _bwd_row_descriptor(rows, block_m)
    names = [n for n in fn.arg_names][:len(args)]
    num_warps = kw.pop("num_warps")
    signature = {n: mangle_type(a) for n, a in zip(names, args)}
    if "m_desc" in kw:
        signature["m_desc"] = mangle_type(kw.pop("m_desc"))
        names.append("m_desc")
    signature.update({n: "constexpr" for n in kw})
    src = GluonASTSource(fn=fn, signature=signature, constexprs=kw)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


def resources(ck):
    """ptxas -v and PTX counts of an sm_90 build: registers, spill bytes, stack, shared memory, and per-kernel
    counts of bar.sync/bar.arrive, mbarrier waits/arrives, wgmma, TMA reduces, fences."""
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    from fagen.aot.nvcc import parse_resources
    ptx = ck.asm["ptx"]
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.ptx"
        path.write_text(ptx)
        r = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(path), "-o", f"{path}.cubin"], capture_output=True,
                           text=True)
    res = next(iter(parse_resources(r.stdout + r.stderr).values()))
    count = {k: len(re.findall(p, ptx)) for k, p in (
        ("bar.sync", r"\bbar\.sync\b|\bbarrier\.sync\b"), ("bar.arrive", r"\bbar\.arrive\b|\bbarrier\.arrive\b"),
        ("mbar.wait", r"mbarrier\.try_wait"), ("mbar.arrive", r"mbarrier\.arrive"),
        ("wgmma", r"wgmma\.mma_async"), ("reduce", r"cp\.reduce\.async\.bulk"), ("fence.proxy", r"fence\.proxy"),
        ("setmaxnreg", r"setmaxnreg"))}
    return dict(registers=res.registers, spill_stores=res.spill_stores, spill_loads=res.spill_loads, stack=res.stack,
                shared=ck.metadata.shared, **count)


def step_sass(ck, min_hgmma=24):
    """Per innermost SASS loop with at least min_hgmma HGMMA (a compute step): instructions, HGMMA, LDL, STL."""
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(ck.asm["cubin"])
        sass = subprocess.run([str(cuobjdump), "-sass", str(path)], capture_output=True, text=True).stdout
    ins = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = []
    for a, t in ins:
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", t)
        if m and int(m.group(1), 16) < a:
            loops.append((int(m.group(1), 16), a))
    body = {r: [t for a, t in ins if r[0] <= a <= r[1]] for r in loops}
    found = [r for r in loops if sum("HGMMA" in t for t in body[r]) >= min_hgmma]
    inner = [r for r in found if not any(o != r and r[0] <= o[0] and o[1] <= r[1] for o in found)]
    return [dict(instructions=len(body[r]), hgmma=sum("HGMMA" in t for t in body[r]),
                 ldl=sum(bool(re.search(r"\bLDL\b", t)) for t in body[r]),
                 stl=sum(bool(re.search(r"\bSTL\b", t)) for t in body[r])) for r in sorted(inner)]
