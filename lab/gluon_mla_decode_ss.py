"""Lab (not the product): the seesaw ("ss") variant of lab/gluon_mla_decode.py, FlashMLA's two-warpgroup schedule
(csrc/sm90/decode/dense/splitkv_mla.cuh, read, not copied) as gl.warp_specialize partitions; the same inputs, outputs,
splits and merge as the one-partition kernel there (mla_decode(..., variant="ss") runs it)."""
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, \
    warpgroup_mma_init, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

D, DV, DR = 576, gl.constexpr(512), gl.constexpr(64)  # q/k width, latent (V) width, rope width


# "ss": FlashMLA's seesaw for two warpgroups (csrc/sm90/decode/dense/splitkv_mla.cuh, read, not copied), as
# gl.warp_specialize partitions: WG0 (the default partition) and WG1 own the 256 left / right output columns; the
# key blocks go in pairs, block a = 2i to WG0 (slot 0) and b = 2i + 1 to WG1 (slot 1), and each warpgroup computes
# the whole 64 x 64 score tile of its own block (wgmma n64: Q's 2 KB A tile per k-step feeds 32 cycles of math, not
# 8 as with 32-key blocks split over both warpgroups). A 1-warp loader streams the slots.
# [Note] Seesaw pair. Per pair, with m the running max (log2 domain) before it:
#   WG0: S_a -> m0 = max(m, rowmax S_a), scale0 = 2^(m - m0), P_a = 2^(S_a - m0); O_L *= scale0; publish m0, scale0
#        (s0_ready); O_L += P_a V_aL (P_a in registers)
#   WG1: waits s0_ready; S_b -> m1 = max(m0, rowmax S_b), scale1 = 2^(m0 - m1), P_b = 2^(S_b - m1);
#        O_R *= scale0 scale1; publish m1, scale1 (s1_ready); P_b to shared memory (p1_ready); O_R += P_b V_bR
#   WG0: waits s1_ready; P_a' = P_a scale1 to shared memory (p0_ready); O_L *= scale1; O_L += P_b V_bL (p1_ready)
#   WG1: O_R += P_a' V_aR (p0_ready)
# so after the pair both halves of O and the row sums (each warpgroup keeps the sum of its own blocks' P, added
# once at the end) are relative to m1. Then each warpgroup issues the next pair's S under its second P V.
# [Note] Seesaw order. A warpgroup frees a slot part as soon as its last read of it retires, and issues the next
# S's parts in the order they free up: rope and its own half (which only it reads; WG1 first retires P_b V_bR,
# wait_group 1), then, once its second P V has retired (wait_group 2, the two S groups still running) and it has
# freed the other warpgroup's half, the other half of its own slot, which the other warpgroup frees the same way.
# Freeing parts only at the end of the pair deadlocked the two warpgroups: each waited for the other's part.
# [Note] Seesaw slots. A slot is three TMA parts, latent left [64, 256], latent right [64, 256] and rope [64, 64],
# each with its own ready/empty barriers, freed by their readers only: slot w's rope by WG w's S; its own half (left
# for slot 0, right for slot 1) by WG w's S and P V (one arrival, after the P V); the other half by WG w's S and the
# other warpgroup's P V (two arrivals). So the loader refills slot 0's left half as soon as WG0's P_a V_aL retires,
# while WG1 still reads the right half, as FlashMLA's per-64-column barriers allow.
# Q's rope tile goes to registers (the rope part of S is a register-A wgmma) and its shared buffer becomes P_b's:
# Q 72 KB + 2 slots x 72 KB + P_a' 8 KB = 224 KB.

@gluon.constexpr_function
def _mma1(n):
    """One warpgroup's wgmma layout (a warp_specialize partition of 4 warps)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


@gluon.jit
def _ss_load_part(desc, dst, ready, empty, use, row, col):
    """TMA of one slot part (its use-th fill) once its readers have freed it."""
    mbarrier.wait(empty, (use & 1) ^ 1)
    mbarrier.expect(ready, desc.block_type.nbytes)
    tma.async_copy_global_to_shared(desc, [row, col], ready, dst)


@gluon.jit
def _ss_loader(q256, q64, k256, k64, qcl, qcr, qr, kcl, kcr, kr, q_ready, ready, empty, BlockTable, bt_row, q_row,
               k_lo, n_blocks, PAGE: gl.constexpr):
    """The loader warp: Q, then the key blocks in pairs, block 2u into slot 0 and 2u + 1 into slot 1."""
    mbarrier.expect(q_ready.index(0), 2 * q256.block_type.nbytes + q64.block_type.nbytes)
    tma.async_copy_global_to_shared(q256, [q_row, 0], q_ready.index(0), qcl.index(0))
    tma.async_copy_global_to_shared(q256, [q_row, 256], q_ready.index(0), qcr.index(0))
    tma.async_copy_global_to_shared(q64, [q_row, DV], q_ready.index(0), qr.index(0))
    for u in range((n_blocks + 1) // 2):  # [Note] Seesaw order: the parts in the order their readers free them
        start = k_lo + u * 128
        page = gl.load(BlockTable + bt_row + start // PAGE)
        row_a = page * PAGE + start % PAGE
        has_b = 2 * u + 1 < n_blocks
        page = gl.load(BlockTable + bt_row + (start + 64 * has_b.to(gl.int32)) // PAGE)
        row_b = page * PAGE + (start + 64) % PAGE
        _ss_load_part(k64, kr.index(0), ready.index(2), empty.index(2), u, row_a, DV)
        if has_b:
            _ss_load_part(k64, kr.index(1), ready.index(5), empty.index(5), u, row_b, DV)
        _ss_load_part(k256, kcl.index(0), ready.index(0), empty.index(0), u, row_a, 0)
        if has_b:
            _ss_load_part(k256, kcr.index(1), ready.index(4), empty.index(4), u, row_b, 256)
        _ss_load_part(k256, kcr.index(0), ready.index(1), empty.index(1), u, row_a, 256)
        if has_b:
            _ss_load_part(k256, kcl.index(1), ready.index(3), empty.index(3), u, row_b, 0)


@gluon.jit
def _ss_scores_first(q_rope, qcl, qcr, kcl, kcr, kr, ready, W: gl.constexpr, use, z):
    """The first two parts of S for WG W's block (slot W, its use-th fill): the rope part (Q's rope from registers)
    and the slot's own half, each once it has landed; asynchronous (two commit groups), the last token."""
    s_layout: gl.constexpr = _mma1(64)
    ph = use & 1
    mbarrier.wait(ready.index(W * 3 + 2), ph)
    tok = warpgroup_mma(q_rope, kr.index(W + z).permute((1, 0)), gl.zeros([64, 64], gl.float32, s_layout),
                        use_acc=False, is_async=True)
    if W == 0:
        mbarrier.wait(ready.index(0), ph)
        tok = warpgroup_mma(qcl.index(z), kcl.index(z).permute((1, 0)), tok, is_async=True)
    else:
        mbarrier.wait(ready.index(4), ph)
        tok = warpgroup_mma(qcr.index(z), kcr.index(1 + z).permute((1, 0)), tok, is_async=True)
    return tok


@gluon.jit
def _ss_scores_rest(tok, qcl, qcr, kcl, kcr, ready, W: gl.constexpr, use, z):
    """The last part of S: the slot's other half (freed by the other warpgroup's P V)."""
    ph = use & 1
    if W == 0:
        mbarrier.wait(ready.index(1), ph)
        tok = warpgroup_mma(qcr.index(z), kcr.index(z).permute((1, 0)), tok, is_async=True)
    else:
        mbarrier.wait(ready.index(3), ph)
        tok = warpgroup_mma(qcl.index(z), kcl.index(1 + z).permute((1, 0)), tok, is_async=True)
    return tok


@gluon.jit
def _ss_zero_rows(buf, valid):
    """Rows >= valid of a [64, 256] latent part become 0 ([Note] Lab tail), 16 rows at a time (the whole part at
    once is 64 registers a thread next to O's 128)."""
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    for c in gl.static_range(4):
        part = buf.slice(c * 16, 16, dim=0)
        x = part.load(ld)
        r = c * 16 + gl.arange(0, 16, layout=gl.SliceLayout(1, ld))
        part.store(gl.where(r[:, None] < valid, x, gl.zeros_like(x)))


@gluon.jit
def _ss_wg(qcl, qcr, qr, kcl, kcr, kr, p0_s, small, q_ready, ready, empty, sync, Out, Lse, PartO, PartLse,
           qk_scale, seq_len, k_lo, n_blocks, b, tile, split, num_splits, ROWS: gl.constexpr,
           SQ: gl.constexpr, CAUSAL: gl.constexpr, DIRECT: gl.constexpr, W: gl.constexpr):
    """Warpgroup W of the seesaw ([Note] Seesaw pair): output columns [256 W, 256 W + 256)."""
    dtype: gl.constexpr = qcl.dtype
    s_layout: gl.constexpr = _mma1(64)
    o_layout: gl.constexpr = _mma1(256)
    srow: gl.constexpr = gl.SliceLayout(1, s_layout)
    orow: gl.constexpr = gl.SliceLayout(1, o_layout)
    p_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    q_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    # small: 8 fp32 rows of 64: 0 m0, 1 scale0, 2 m1, 3 scale1, 4 l of WG0, 5 l of WG1
    # sync: 0 s0_ready, 1 s1_ready, 2 p0_ready, 3 p1_ready, 4 qr_free (2), 5 l0_ready, 6 l1_ready
    p1_s = qr  # [Note] Seesaw slots: Q's rope buffer holds P_b once both warpgroups have Q's rope in registers
    mbarrier.wait(q_ready.index(0), 0)
    q_rope = qr.index(0).load(q_op)
    gl.thread_barrier()
    mbarrier.arrive(sync.index(4))
    rows = tile * 64 + gl.arange(0, 64, layout=srow)
    if CAUSAL:
        lim = seq_len - SQ + rows % SQ
    else:
        lim = gl.full([64], 0, gl.int32, srow) + (seq_len - 1)
    m_i = gl.full([64], float("-inf"), gl.float32, srow)
    l_i = gl.zeros([64], gl.float32, srow)
    o_acc = gl.zeros([64, 256], gl.float32, o_layout)
    n_pairs = (n_blocks + 1) // 2
    s_acc = gl.full([64, 64], float("-inf"), gl.float32, s_layout)
    if W < n_blocks:  # S of the first pair's own block
        tok = _ss_scores_first(q_rope, qcl, qcr, kcl, kcr, kr, ready, W, 0, 0)
        tok = _ss_scores_rest(tok, qcl, qcr, kcl, kcr, ready, W, 0, 0)
        s_acc = warpgroup_mma_wait(0, deps=(tok, ))
        mbarrier.arrive(empty.index(W * 3 + 2))  # rope: read by this S only
        mbarrier.arrive(empty.index(W * 3 + 1 - W))  # the other half: this S and the other warpgroup's P V
    for i in range(n_pairs):
        ph = i & 1
        # [Note] Seesaw descriptors: 0, but not to the compiler, so that the wgmma shared-memory descriptors are
        # computed in the loop instead of hoisted (44 64-bit descriptors live across the loop spilled ~800 bytes)
        z = i >> 30
        blk = 2 * i + W
        cols = k_lo + blk * 64 + gl.arange(0, 64, layout=gl.SliceLayout(0, s_layout))
        s = gl.where(cols[None, :] <= lim[:, None], s_acc * qk_scale, float("-inf"))  # none if blk >= n_blocks
        if W == 0:
            m_in = m_i
        else:
            mbarrier.wait(sync.index(0), ph)
            m_in = small.slice((0) * 64, 64).load(srow)
            scale0 = small.slice((1) * 64, 64).load(srow)
        m_new = gl.maximum(m_in, gl.max(s, 1))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        scale = gl.exp2(m_in - m_use)
        p = gl.exp2(s - m_use[:, None])
        pb = p.to(dtype)  # P in bf16 from here on: its fp32 registers die with the row sum
        if W == 0:
            l_i = l_i * scale + gl.sum(p, 1)
            o_acc = o_acc * gl.convert_layout(scale, orow)[:, None]
            small.slice((0) * 64, 64).store(m_new)
            small.slice((1) * 64, 64).store(scale)
            gl.thread_barrier()
            mbarrier.arrive(sync.index(0))
        else:
            l_i = l_i * (scale0 * scale) + gl.sum(p, 1)
            o_acc = o_acc * gl.convert_layout(scale0 * scale, orow)[:, None]
            small.slice((2) * 64, 64).store(m_new)
            small.slice((3) * 64, 64).store(scale)
            gl.thread_barrier()
            mbarrier.arrive(sync.index(1))
            m_i = m_new
        # [Note] Lab tail: the owner zeroes the rows past the end (or the whole slot: no block) in both halves
        end = k_lo + (blk + 1) * 64
        if end > seq_len:
            valid = gl.maximum(seq_len - (end - 64), 0)
            _ss_zero_rows(kcl.index(W), valid)
            _ss_zero_rows(kcr.index(W), valid)
            fence_async_shared()
            gl.thread_barrier()
        if W == 1:
            if i == 0:
                mbarrier.wait(sync.index(4), 0)  # both warpgroups hold Q's rope: its buffer is P_b's
            p1_s.index(0).store(pb)
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(sync.index(3))
            o_tok = warpgroup_mma(gl.convert_layout(pb, p_op), kcr.index(1 + z), o_acc, is_async=True)
        else:
            o_tok = warpgroup_mma(gl.convert_layout(pb, p_op), kcl.index(z), o_acc, is_async=True)
            o_acc = warpgroup_mma_wait(0, deps=(o_tok, ))
            mbarrier.arrive(empty.index(0))  # slot 0's left half: P_a V_aL was its last reader
            mbarrier.wait(sync.index(1), ph)
            m_i = small.slice((2) * 64, 64).load(srow)
            scale1 = small.slice((3) * 64, 64).load(srow)
            p0_s.index(0).store((pb.to(gl.float32) * scale1[:, None]).to(dtype))  # P_a' rounded twice (bf16 P, then x scale1)
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(sync.index(2))
            l_i = l_i * scale1
            o_tok = warpgroup_mma_init(o_acc * gl.convert_layout(scale1, orow)[:, None])
        # the other warpgroup's block: P from shared memory, this warpgroup's half of its latent
        if W == 0:
            mbarrier.wait(sync.index(3), ph)
            o_tok = warpgroup_mma(p1_s.index(z), kcl.index(1 + z), o_tok, is_async=True)
        else:
            mbarrier.wait(sync.index(2), ph)
            o_tok = warpgroup_mma(p0_s.index(z), kcr.index(z), o_tok, is_async=True)
        # [Note] Seesaw order: the next pair's S under this P V, the parts in the order their slots free up
        if W == 1:
            l_i = warpgroup_mma_wait(1, deps=(l_i, ))  # P_b V_bR retired (P_a' V_aR may still run)
            mbarrier.arrive(empty.index(4))  # slot 1's right half: WG1's S_b and P_b V_bR read it
        nxt = blk + 2
        if nxt < n_blocks:
            tok = _ss_scores_first(q_rope, qcl, qcr, kcl, kcr, kr, ready, W, i + 1, z)
            l_i = warpgroup_mma_wait(2, deps=(l_i, ))  # the second P V retired; the two S groups may still run
            mbarrier.arrive(empty.index(3 - 2 * W))  # W 0: slot 1's left half; W 1: slot 0's right half
            tok = _ss_scores_rest(tok, qcl, qcr, kcl, kcr, ready, W, i + 1, z)
            o_acc, s_acc = warpgroup_mma_wait(0, deps=(o_tok, tok))
            mbarrier.arrive(empty.index(W * 3 + 2))  # the new S's rope part
            mbarrier.arrive(empty.index(W * 3 + 1 - W))  # and its slot's other half (this S's arrival)
        else:
            o_acc = warpgroup_mma_wait(0, deps=(o_tok, ))
            mbarrier.arrive(empty.index(3 - 2 * W))
            s_acc = gl.full([64, 64], float("-inf"), gl.float32, s_layout)

    # l = l of WG0 + l of WG1 (in that order in both), then each warpgroup writes its half
    small.slice((4 + W) * 64, 64).store(l_i)
    gl.thread_barrier()
    mbarrier.arrive(sync.index(5 + W))
    mbarrier.wait(sync.index(6 - W), 0)
    l_tot = small.slice((4) * 64, 64).load(srow) + small.slice((5) * 64, 64).load(srow)
    l_safe = gl.where(l_tot == 0.0, 1.0, l_tot)
    out = o_acc / gl.convert_layout(l_safe, orow)[:, None]
    m_fin = gl.where(m_i == float("-inf"), 0.0, m_i)
    lse2 = gl.where(l_tot == 0.0, float("-inf"), m_fin + gl.log2(l_safe))
    orows = tile * 64 + gl.arange(0, 64, layout=orow)
    ocols = W * 256 + gl.arange(0, 256, layout=gl.SliceLayout(0, o_layout))
    if DIRECT:
        gl.store(Out + (b * ROWS + orows).to(gl.int64)[:, None] * DV + ocols[None, :], out.to(Out.dtype.element_ty))
        if W == 0:
            gl.store(Lse + b * ROWS + rows, lse2 * 0.6931471805599453)
    else:
        prow = (b * num_splits + split) * ROWS
        gl.store(PartO + (prow + orows).to(gl.int64)[:, None] * DV + ocols[None, :], out)
        if W == 0:
            gl.store(PartLse + prow + rows, lse2)


@gluon.jit
def _ss_wg0(qcl, qcr, qr, kcl, kcr, kr, p0_s, small, q_ready, ready, empty, sync, Out, Lse, PartO, PartLse,
            qk_scale, seq_len, k_lo, n_blocks, b, tile, split, num_splits, ROWS: gl.constexpr,
            SQ: gl.constexpr, CAUSAL: gl.constexpr, DIRECT: gl.constexpr):
    _ss_wg(qcl, qcr, qr, kcl, kcr, kr, p0_s, small, q_ready, ready, empty, sync, Out, Lse, PartO, PartLse,
           qk_scale, seq_len, k_lo, n_blocks, b, tile, split, num_splits, ROWS, SQ, CAUSAL, DIRECT, 0)


@gluon.jit
def _ss_wg1(qcl, qcr, qr, kcl, kcr, kr, p0_s, small, q_ready, ready, empty, sync, Out, Lse, PartO, PartLse,
            qk_scale, seq_len, k_lo, n_blocks, b, tile, split, num_splits, ROWS: gl.constexpr,
            SQ: gl.constexpr, CAUSAL: gl.constexpr, DIRECT: gl.constexpr):
    _ss_wg(qcl, qcr, qr, kcl, kcr, kr, p0_s, small, q_ready, ready, empty, sync, Out, Lse, PartO, PartLse,
           qk_scale, seq_len, k_lo, n_blocks, b, tile, split, num_splits, ROWS, SQ, CAUSAL, DIRECT, 1)


@gluon.jit(do_not_specialize=["stride_bt", "num_splits"])
def _mla_decode_ss(q256, q64, k256, k64, BlockTable, Seqlens, Out, Lse, PartO, PartLse, stride_bt, qk_scale,
                   num_splits, ROWS: gl.constexpr, SQ: gl.constexpr, PAGE: gl.constexpr, CAUSAL: gl.constexpr,
                   DIRECT: gl.constexpr, WG_REGS: gl.constexpr, LOADER_REGS: gl.constexpr):
    gl.static_assert(PAGE % 64 == 0)
    gl.static_assert(ROWS % 64 == 0)
    tile = gl.program_id(0)
    split = gl.program_id(1)
    b = gl.program_id(2)
    dtype: gl.constexpr = q256.dtype
    qcl = gl.allocate_shared_memory(dtype, [1, 64, 256], q256.layout)  # [Note] Seesaw descriptors: indexed
    qcr = gl.allocate_shared_memory(dtype, [1, 64, 256], q256.layout)
    qr = gl.allocate_shared_memory(dtype, [1, 64, DR], q64.layout)
    kcl = gl.allocate_shared_memory(dtype, [2, 64, 256], k256.layout)
    kcr = gl.allocate_shared_memory(dtype, [2, 64, 256], k256.layout)
    kr = gl.allocate_shared_memory(dtype, [2, 64, DR], k64.layout)
    p0_s = gl.allocate_shared_memory(dtype, [1, 64, 64], q64.layout)
    small = gl.allocate_shared_memory(gl.float32, [8 * 64], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    q_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [6, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [6, 1], mbarrier.MBarrierLayout())
    sync = gl.allocate_shared_memory(gl.int64, [7, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready.index(0), count=1)
    for s in gl.static_range(2):
        for t in gl.static_range(3):
            mbarrier.init(ready.index(s * 3 + t), count=1)
            # [Note] Seesaw slots: readers of part t of slot s
            mbarrier.init(empty.index(s * 3 + t), count=2 if t == 1 - s else 1)
    for i in gl.static_range(7):
        mbarrier.init(sync.index(i), count=2 if i == 4 else 1)
    fence_async_shared()

    seq_len = gl.load(Seqlens + b)
    n_all = (seq_len + 63) // 64
    per = (n_all + num_splits - 1) // num_splits
    per = (per + 1) // 2 * 2  # splits of whole pairs
    j_lo = gl.minimum(split * per, n_all)
    n_blocks = gl.minimum(n_all - j_lo, per)
    k_lo = j_lo * 64
    bt_row = b.to(gl.int64) * stride_bt
    q_row = b * ROWS + tile * 64
    gl.warp_specialize([
        (_ss_wg0, (qcl, qcr, qr, kcl, kcr, kr, p0_s, small, q_ready, ready, empty, sync, Out, Lse, PartO, PartLse,
                   qk_scale, seq_len, k_lo, n_blocks, b, tile, split, num_splits, ROWS, SQ, CAUSAL, DIRECT)),
        (_ss_wg1, (qcl, qcr, qr, kcl, kcr, kr, p0_s, small, q_ready, ready, empty, sync, Out, Lse, PartO, PartLse,
                   qk_scale, seq_len, k_lo, n_blocks, b, tile, split, num_splits, ROWS, SQ, CAUSAL, DIRECT)),
        (_ss_loader, (q256, q64, k256, k64, qcl, qcr, qr, kcl, kcr, kr, q_ready, ready, empty, BlockTable, bt_row,
                      q_row, k_lo, n_blocks, PAGE)),
    ], [4, 1], [WG_REGS, LOADER_REGS])


def _args_ss(q, cache, block_table, seqlens_k, scale, num_splits, causal):
    """The seesaw kernel's arguments: latent halves [64, 256] and rope [64, 64] boxes of q and the cache."""
    bsz, hq, sq, d = q.shape
    gdt = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[q.dtype]
    q2, c2 = q.view(-1, D), cache.view(-1, D)

    def desc(t, cols):
        layout = gl.NVMMASharedLayout.get_default_for([64, cols], gdt)
        return TensorDescriptor(t, list(t.shape), list(t.stride()), [64, cols], layout)
    rows = hq * sq
    direct = num_splits == 1
    out = torch.empty((bsz, hq, sq, DV), dtype=q.dtype, device=q.device)
    lse = torch.empty((bsz, hq, sq), dtype=torch.float32, device=q.device)
    if direct:
        part_o, part_lse = out, lse
    else:
        part_o = torch.empty((bsz * num_splits * rows, DV), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((bsz * num_splits * rows, ), dtype=torch.float32, device=q.device)
    args = (desc(q2, 256), desc(q2, 64), desc(c2, 256), desc(c2, 64), block_table, seqlens_k, out, lse, part_o,
            part_lse, block_table.stride(0), scale * 1.4426950408889634, num_splits)
    kw = dict(ROWS=rows, SQ=sq, PAGE=cache.shape[1], CAUSAL=causal, DIRECT=direct, WG_REGS=SS_WG_REGS,
              LOADER_REGS=SS_LOADER_REGS)
    return args, kw, out, lse, part_o, part_lse


SS_WG_REGS = 240  # setmaxnreg of WG1 (the default partition, WG0, gets what is left) and of the loader warp
SS_LOADER_REGS = 24
