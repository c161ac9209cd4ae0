"""Lab (seventeenth session; issue 27): the paged fp8 KV decode in Gluon with the fp8 MLA latent decode's structure
(fagen/templates/gluon/mla_decode_fp8.py.j2) on d128 GQA 4, on the sixteenth session's cp.async ring
(lab/pagedfp8_gluon_decode.py). vLLM's [num_pages, PAGE, Hkv, 128] e4m3 caches, per-KV-head (or no) scales, bf16
queries, one query a sequence, Hq = 4 Hkv.

One warpgroup a program, one program per (split, KV head, sequence): the product's grid (splits, Hkv, B) and split
rule. Swap-AB: S^T = K Q^T by wgmma with a block's 64 keys as M and the group's 4 query rows (padded with zeros to
NQ = 8, the wgmma's smallest N) as N; O^T += V^T P^T into two [64, NQ] fp32 accumulators (d 0..63, 64..127).
  - block j + STAGES - 1's K and V rows are gathered through the block table by cp.async (16 bytes a piece,
    masked past the split's end: zero-filled, not read) into a STAGES-deep shared ring in step j (EARLY: where),
    their page numbers loaded a step before (carried; clamped into the cache). Each thread copies exactly the
    16-byte pieces it reads back (the wgmma A fragment's layout, _frag_words: two rows a thread, 16 consecutive
    bytes of each of a row's two 64-byte halves), so the ring needs no barrier of its own: at the step's end
    wait_group for the next block of the thread's own groups and one barrier (with V's tiles and P);
  - K's bytes are converted in registers by the hardware's e4m3x2 -> f16x2 cvt (exact) and become the scores'
    A fragment by a register renaming (_frag: K's columns permuted within each 64-column chunk, Q's the same way
    once a program, so S^T is unchanged);
  - V's bytes are converted the same way and stored as fp16 [64 keys, 64 d] tiles (two) in shared memory, the
    PV wgmma's A operand (V^T, MN-major);
  - the online softmax in fp32 on S^T: a program's 4 (NQ) columns' max over the block's 64 keys (one cross-warp
    reduction a step), the row sums kept as a [64, NQ] tile a thread and reduced once after the loop, P^T
    (fp16, P * 2^14) through shared memory as the PV wgmma's B;
  - fp16 dots: q * cq (cq the power of two putting max |q| in [2^14, 2^15)), 1 / cq and the KV head's k scale
    into the score scale; v's scale and 1 / 2^14 at the end.
O * v_scale / l and lse = m + log2 l: one split (DIRECT) writes out (bf16) and lse (natural log) itself; several
write the product's partial layout (fp32 [splits, B, Hq, 1, 128] and log2 lse [splits, B, Hq, 1]) and the lab's
_merge (lab/pagedfp8_gluon_decode.py: the product's _merge_splits arithmetic) combines the used splits.
Variants (kernel constexprs): STAGES, PIPE, RED, EARLY, NOCOPY (a timing diagnostic); see _paged_swap.
H100 (docs/serving.md, "Paged fp8 KV decode (seventeenth session)"): s4 0.913 of copy at the bench row against the
Triton default's 0.927 (round A).

    PYTHONPATH=$PWD python3 lab/pagedfp8_swap_decode.py [STAGES,PIPE,RED,EARLY ...]   # sm_90 builds on the CPU:
                                                        # registers, smem, SASS of the key loop, warp instr. a key
"""
import math
import os
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pagedfp8_gluon_decode as s16  # noqa: E402  (the merge and the workspace)

GQA = gl.constexpr(4)
ROW_W = gl.constexpr(32)  # int32 words of a 128-byte row


@gluon.constexpr_function
def _mma(n):
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


@gluon.constexpr_function
def _frag_words():
    """[64 rows, 16 words] of a 64-byte half row as int32 words: a thread 4 consecutive words (16 bytes) of two rows
    (l // 4 and + 8 of its warp's 16), as the wgmma's A fragment holds them (the MLA decode's)."""
    return gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [8, 0]],
                                      lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
                                      warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 16])


@gluon.jit
def _cvt4h(x):
    """Four fp8 e4m3 bytes in an int32 word as four fp16 values, exactly (the hardware's cvt)."""
    return gl.inline_asm_elementwise(
        asm="""{
        .reg .b16 l, h;
        .reg .b32 c, d;
        mov.b32 {l, h}, $4;
        cvt.rn.f16x2.e4m3x2 c, l;
        cvt.rn.f16x2.e4m3x2 d, h;
        mov.b32 {$0, $1}, c;
        mov.b32 {$2, $3}, d;
        }""",
        constraints="=h,=h,=h,=h,r", args=[x], dtype=(gl.float16, gl.float16, gl.float16, gl.float16),
        is_pure=True, pack=1)


@gluon.jit
def _halves(x):
    """Words [64, 16] as their fp16 values [64, 64] in byte order."""
    e0, e1, e2, e3 = _cvt4h(x)
    return gl.reshape(gl.join(gl.join(e0, e2), gl.join(e1, e3)), [64, 64])


@gluon.jit
def _frag(xb, a_layout: gl.constexpr):
    """Values in byte order [64, 64] as the wgmma A fragment over the permuted columns: byte 16 t + 4 s + 2 h + i is
    column 16 s + 8 h + 2 t + i (a register renaming)."""
    y = gl.reshape(xb, [64, 4, 4, 2, 2])
    y = gl.permute(y, [0, 2, 3, 1, 4])
    y = gl.reshape(y, [64, 64])
    return gl.convert_layout(y, a_layout, assert_trivial=True)


@gluon.jit
def _pow2_scale(m):
    """The power of two c with m c in [2^14, 2^15), 1 where m < 2^-102 or not finite."""
    e = (m.to(gl.int32, bitcast=True) & 0x7F800000) >> 23
    return gl.where((e > 24) & (e < 255), ((268 - e) << 23).to(gl.float32, bitcast=True), 1.0)


@gluon.jit
def _pages(BlockTable, bt_row, start, r, k_hi, num_pages, PAGE: gl.constexpr):
    """Page numbers of keys start + r (0 past k_hi), clamped into [0, num_pages - 1]."""
    pg = gl.load(BlockTable + bt_row + (start + r) // PAGE, mask=(start + r) < k_hi, other=0)
    return gl.minimum(gl.maximum(pg, 0), num_pages - 1)


@gluon.constexpr_function
def _copy_words():
    """[2 halves, 64 rows, 16 words] of a block's 128-byte rows: _frag_words for each half, one copy op a block."""
    return gl.DistributedLinearLayout(reg_bases=[[0, 0, 1], [0, 0, 2], [0, 8, 0], [1, 0, 0]],
                                      lane_bases=[[0, 0, 4], [0, 0, 8], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
                                      warp_bases=[[0, 16, 0], [0, 32, 0]], block_bases=[], shape=[2, 64, 16])


@gluon.jit
def _issue(K, V, k_s, v_s, slot, pg, start, r, cw, k_hi, stride_p, stride_s, head_off, PAGE: gl.constexpr,
           NOCOPY: gl.constexpr = 0):
    """cp.async of keys start + r's K and V rows (pages pg; int32 word views; cw [2, 1, 16] the words of a row's two
    halves) into ring slot `slot` ([2, 64, 16] each), one group; keys >= k_hi: zero-filled. NOCOPY (a timing
    diagnostic, wrong values): no copy, an empty group."""
    if not NOCOPY:
        ok = ((start + r) < k_hi)[None, :, None]
        rows = pg.to(gl.int64) * stride_p + ((start + r) % PAGE) * stride_s + head_off
        off = rows[None, :, None] + cw
        async_copy.async_copy_global_to_shared(k_s.index(slot), K + off, mask=ok)
        async_copy.async_copy_global_to_shared(v_s.index(slot), V + off, mask=ok)
    async_copy.commit_group()


@gluon.constexpr_function
def _warp_cols(nq):
    """[4 warps, nq columns] with the 4 warps' values in every thread's registers and the columns where the wgmma
    accumulator's column slice holds them (two adjacent a thread, lanes l % 4): the cross-warp max read back."""
    return gl.DistributedLinearLayout(reg_bases=[[0, 1], [1, 0], [2, 0]],
                                      lane_bases=[[0, 2], [0, 4], [0, 0], [0, 0], [0, 0]] if nq == 8 else
                                      [[0, 2], [0, 4], [0, 8], [0, 0], [0, 0]],
                                      warp_bases=[[0, 0], [0, 0]], block_bases=[], shape=[4, nq])


@gluon.jit
def _col_max(s, red_s, NQ: gl.constexpr, qcol: gl.constexpr):
    """max over the 64 rows of s [64, NQ] (the 4 warps' 16 each): each warp's max within the warp (shuffles), the 4
    through red_s [4, NQ] and one barrier (RED 1; the caller's next barrier comes before red_s is written again)."""
    w = gl.max(gl.reshape(s, [4, 16, NQ]), 1)
    red_s.store(w)
    gl.thread_barrier()
    return gl.convert_layout(gl.max(red_s.load(_warp_cols(NQ)), 0), qcol, assert_trivial=True)


@gluon.jit
def _scores(k_s, slot, q_s, z, s0, l3: gl.constexpr, lw: gl.constexpr, a_layout: gl.constexpr):
    """S^T of the block in ring slot `slot` issued (async): its K words into registers, converted, as the A fragment
    of each half against Q^T's half. Returns (token, the two fragments)."""
    xk0, xk1 = gl.split(gl.permute(k_s.index(slot).load(l3), [1, 2, 0]))  # two [64, 16] in _frag_words
    a0 = _frag(_halves(xk0), a_layout)
    tok = warpgroup_mma(a0, q_s.index(0 + z).permute((1, 0)), s0, use_acc=False, is_async=True)
    a1 = _frag(_halves(xk1), a_layout)
    tok = warpgroup_mma(a1, q_s.index(1 + z).permute((1, 0)), tok, is_async=True)
    return tok, a0, a1


@gluon.jit(do_not_specialize=["num_pages", "stride_bt", "n_cap", "chunk"])
def _paged_swap(Q, K, V, KScale, VScale, BlockTable, Seqlens, Dst, DstLse, num_pages, stride_bt, n_cap, chunk,
                qk_scale, k_mul, v_mul, stride_p, stride_s, stride_ds, stride_db, stride_ls, stride_lb,
                HKV: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr, DIRECT: gl.constexpr,
                SCALES: gl.constexpr, NQ: gl.constexpr, PIPE: gl.constexpr, RED: gl.constexpr,
                EARLY: gl.constexpr, NOCOPY: gl.constexpr):
    """K, V: int32 views of the caches ([pages, PAGE, Hkv, 32]; strides in words). SCALES 1: KScale / VScale are
    float32 [Hkv] (per KV head); 0: k_mul / v_mul (floats). PIPE 1: block j + 1's S^T is issued before block j's
    softmax and retired with block j's P V (its K words read a step earlier: STAGES >= 3). RED 1: the scores'
    column max across the warps by _col_max (one barrier) instead of Triton's reduction (two). EARLY: where the
    step issues block j + STAGES - 1's copies: 0 after P's store, 1 right after the column max's barriers, 2 right
    after the step's ring reads (one more barrier), 3 first (one more barrier). NOCOPY 1: a timing diagnostic (wrong values): no copies, the
    steps compute on whatever the ring holds: the step's own time without its reads."""
    gl.static_assert(STAGES >= 2 + PIPE)
    split = gl.program_id(0)
    h = gl.program_id(1)
    b = gl.program_id(2)
    s_layout: gl.constexpr = _mma(NQ)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    kcol: gl.constexpr = gl.SliceLayout(1, s_layout)  # a key (a row of S^T) / a d (a row of O^T)
    qcol: gl.constexpr = gl.SliceLayout(0, s_layout)  # a query row (a column)
    lw: gl.constexpr = _frag_words()
    dt: gl.constexpr = gl.float16
    ring_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0])
    k_s = gl.allocate_shared_memory(gl.int32, [STAGES, 2, 64, 16], ring_sl)
    v_s = gl.allocate_shared_memory(gl.int32, [STAGES, 2, 64, 16], ring_sl)
    v_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 64], dt)
    q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([NQ, 64], dt)
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, NQ], dt)
    v0 = gl.allocate_shared_memory(dt, [1, 64, 64], v_sl)  # V's d 0..63 (fp16), one allocation a half
    v1 = gl.allocate_shared_memory(dt, [1, 64, 64], v_sl)
    q_s = gl.allocate_shared_memory(dt, [2, NQ, 64], q_sl)  # Q's halves, columns permuted as K's fragment
    p_s = gl.allocate_shared_memory(dt, [1, 64, NQ], p_sl)
    red_s = gl.allocate_shared_memory(gl.float32, [4, NQ], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    l3: gl.constexpr = _copy_words()
    r = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(2, l3)))
    cw = (gl.arange(0, 2, layout=gl.SliceLayout(1, gl.SliceLayout(2, l3)))[:, None, None] * 16
          + gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, l3)))[None, None, :])

    n_k = gl.minimum(gl.maximum(gl.load(Seqlens + b), 0), gl.where(num_pages > 0, n_cap, 0))  # memory safety
    lo = split * chunk
    k_hi = gl.minimum(lo + chunk, n_k)
    n_blocks = gl.cdiv(k_hi - lo, 64)
    if not DIRECT:
        if lo >= k_hi:  # a split with no key writes nothing (the merge reads the used splits only)
            return
    bt_row = b.to(gl.int64) * stride_bt
    head_off = h * ROW_W
    for i in gl.static_range(STAGES - 1):
        pg = _pages(BlockTable, bt_row, lo + i * 64, r, k_hi, num_pages, PAGE)
        _issue(K, V, k_s, v_s, i, pg, lo + i * 64, r, cw, k_hi, stride_p, stride_s, head_off, PAGE, NOCOPY)
    pg_next = _pages(BlockTable, bt_row, lo + (STAGES - 1) * 64, r, k_hi, num_pages, PAGE)

    # Q: the group's 4 rows (the rest zero), half J's column L from column 64 J + P(L) (K's fragment's permutation)
    lq: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    qn = gl.arange(0, NQ, layout=gl.SliceLayout(1, lq))
    L = gl.arange(0, 64, layout=gl.SliceLayout(0, lq))
    src = 16 * ((L >> 1) & 3) + 4 * (L >> 4) + 2 * ((L >> 3) & 1) + (L & 1)
    qbase = Q + (b.to(gl.int64) * (HKV * GQA) + h * GQA + qn)[:, None] * 128 + src[None, :]
    qok = (qn < GQA)[:, None]
    q0 = gl.load(qbase, mask=qok, other=0.0).to(gl.float32)
    q1 = gl.load(qbase + 64, mask=qok, other=0.0).to(gl.float32)
    cq = _pow2_scale(gl.maximum(gl.max(gl.max(gl.abs(q0), 1), 0), gl.max(gl.max(gl.abs(q1), 1), 0)))
    q_s.index(0).store((q0 * cq).to(dt))
    q_s.index(1).store((q1 * cq).to(dt))
    if SCALES == 1:
        k_mul = gl.load(KScale + h)
        v_mul = gl.load(VScale + h)
    qk_scale = qk_scale * k_mul / cq
    async_copy.wait_group(STAGES - 2 - PIPE)  # block 0 (PIPE: and 1) landed (this thread's copies)
    fence_async_shared()  # q, for the async proxy
    gl.thread_barrier()

    keys0 = gl.arange(0, 64, layout=kcol)
    m_i = gl.full([NQ], float("-inf"), gl.float32, qcol)
    l_p = gl.zeros([64, NQ], gl.float32, s_layout)  # the row sums, a tile a thread
    o0 = gl.zeros([64, NQ], gl.float32, s_layout)  # O^T, d 0..63
    o1 = gl.zeros([64, NQ], gl.float32, s_layout)  # d 64..127
    s_nx = gl.zeros([64, NQ], gl.float32, s_layout)  # PIPE: the next block's S^T
    if PIPE:
        tok, a0, a1 = _scores(k_s, 0, q_s, 0, s_nx, l3, lw, a_layout)
        s_nx, a0, a1 = warpgroup_mma_wait(0, deps=(tok, a0, a1))
    for j in range(n_blocks):
        # block j landed (the previous step's wait and barrier)
        z = 0  # (the MLA decode folds a j >> 30 here to keep its descriptors in the loop: 41 more SASS a step here)
        slot = j % STAGES
        if EARLY == 3:  # the copies first, into the slot block j - 1 left (read before the last step's barrier);
            # Triton's barrier pass then puts a barrier between them and this step's ring reads
            ahead = lo + (j + STAGES - 1) * 64
            _issue(K, V, k_s, v_s, (j + STAGES - 1) % STAGES, pg_next, ahead, r, cw, k_hi, stride_p, stride_s,
                   head_off, PAGE, NOCOPY)
            pg_next = _pages(BlockTable, bt_row, ahead + 64, r, k_hi, num_pages, PAGE)
        if PIPE:
            s = s_nx
            tok, a0, a1 = _scores(k_s, (j + 1) % STAGES, q_s, z, s_nx, l3, lw, a_layout)  # block j + 1's
            xv0, xv1 = gl.split(gl.permute(v_s.index(slot).load(l3), [1, 2, 0]))
        else:
            tok, a0, a1 = _scores(k_s, slot, q_s, z, s_nx, l3, lw, a_layout)
            xv0, xv1 = gl.split(gl.permute(v_s.index(slot).load(l3), [1, 2, 0]))  # before the reduction's barriers
            s, a0, a1 = warpgroup_mma_wait(0, deps=(tok, a0, a1))
        if EARLY == 2:  # the copies right after the step's ring reads (Triton's barrier pass adds one between)
            ahead = lo + (j + STAGES - 1) * 64
            _issue(K, V, k_s, v_s, (j + STAGES - 1) % STAGES, pg_next, ahead, r, cw, k_hi, stride_p, stride_s,
                   head_off, PAGE, NOCOPY)
            pg_next = _pages(BlockTable, bt_row, ahead + 64, r, k_hi, num_pages, PAGE)
        s = gl.where((lo + j * 64 + keys0 < k_hi)[:, None], s * qk_scale, float("-inf"))
        if RED:
            m_new = gl.maximum(m_i, _col_max(s, red_s, NQ, qcol))
        else:
            m_new = gl.maximum(m_i, gl.max(s, 0))  # the one cross-warp reduction of a step
        if EARLY == 1:  # the copies right after the reduction's barriers (no barrier of their own)
            ahead = lo + (j + STAGES - 1) * 64
            _issue(K, V, k_s, v_s, (j + STAGES - 1) % STAGES, pg_next, ahead, r, cw, k_hi, stride_p, stride_s,
                   head_off, PAGE, NOCOPY)
            pg_next = _pages(BlockTable, bt_row, ahead + 64, r, k_hi, num_pages, PAGE)
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(s - m_use[None, :])
        l_p = l_p * alpha[None, :] + p
        m_i = m_new
        # V's words into its fp16 tiles after the reduction's barriers (the previous step's P V read the tiles)
        v0.index(z).store(_halves(xv0))
        v1.index(z).store(_halves(xv1))
        p_s.index(0).store((p * 16384.0).to(dt))
        fence_async_shared()  # V's tiles and P, for the async proxy
        # block j + STAGES - 1's copies into the slot block j - 1 left (every thread read it before the reduction's
        # barriers), then block j + 1 waited for: one barrier covers V's tiles, P and the ring
        ahead = lo + (j + STAGES - 1) * 64
        if EARLY == 0:
            _issue(K, V, k_s, v_s, (j + STAGES - 1) % STAGES, pg_next, ahead, r, cw, k_hi, stride_p, stride_s,
                   head_off, PAGE, NOCOPY)
            pg_next = _pages(BlockTable, bt_row, ahead + 64, r, k_hi, num_pages, PAGE)
        async_copy.wait_group(STAGES - 2 - PIPE)  # block j + 1 (PIPE: j + 2) landed
        gl.thread_barrier()
        t0 = warpgroup_mma(v0.index(z).permute((1, 0)), p_s.index(z), o0 * alpha[None, :], is_async=True)
        t1 = warpgroup_mma(v1.index(z).permute((1, 0)), p_s.index(z), o1 * alpha[None, :], is_async=True)
        if PIPE:  # retired before V and P are overwritten (with block j + 1's S^T)
            o0, o1, s_nx, a0, a1 = warpgroup_mma_wait(0, deps=(t0, t1, tok, a0, a1))
        else:
            o0, o1 = warpgroup_mma_wait(0, deps=(t0, t1))  # retired before V and P are overwritten
    async_copy.wait_group(0)

    # empty rows: no key seen -> l 0, out 0, lse -inf
    l_i = gl.sum(l_p, 0)
    seen = l_i != 0
    l_safe = gl.where(seen, l_i, 1.0)
    inv = gl.where(seen, v_mul / (l_safe * 16384.0), 0.0)[None, :]
    lse = gl.where(seen, gl.where(seen, m_i, 0.0) + gl.log2(l_safe), float("-inf"))
    on = gl.arange(0, NQ, layout=qcol)
    om = gl.arange(0, 64, layout=kcol)
    ok = (on < GQA)[None, :] & (om < 64)[:, None]
    head = b.to(gl.int64) * stride_db + (h * GQA + on) * 128  # [B, Hq, 1, D] rows of Dst (a split's part)
    lhead = b.to(gl.int64) * stride_lb + h * GQA + on
    if DIRECT:
        base = Dst + head[None, :] + om[:, None]
        gl.store(base, (o0 * inv).to(gl.bfloat16), mask=ok)
        gl.store(base + 64, (o1 * inv).to(gl.bfloat16), mask=ok)
        gl.store(DstLse + lhead, lse * 0.6931471805599453, mask=on < GQA)
    else:
        base = Dst + split.to(gl.int64) * stride_ds + head[None, :] + om[:, None]
        gl.store(base, o0 * inv, mask=ok)
        gl.store(base + 64, o1 * inv, mask=ok)
        gl.store(DstLse + split.to(gl.int64) * stride_ls + lhead, lse, mask=on < GQA)


# [Lab] Two warpgroups, 128-key blocks (the seventeenth session's next lever, W8). The 64-key kernel's step is the
# same work a warp at any block size (16 keys' K and V words a warp, 8 score and 8 P V k-steps a warpgroup), so on
# 8 warps with 128-key blocks (M = 128: warpgroup w takes keys 64 w .. 64 w + 63 of S^T and d 64 w .. 64 w + 63 of
# O^T over all 128 keys) a step covers twice the keys for one chain of latencies, and two programs an SM are 16
# warps. Shared memory: the ring of 128-key blocks (32 KB a stage), V's fp16 [128, 128] tile (32 KB), P, Q: s2
# 101 KB. With s2 the copies go first in a step (EARLY 3: block j + 1 into the slot block j - 1 left) and the
# step's end waits for them: a step of cover.
@gluon.constexpr_function
def _mma8(n):
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, n, 16])


@gluon.constexpr_function
def _frag_words8():
    """_frag_words over 128 rows and 8 warps."""
    return gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [8, 0]],
                                      lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
                                      warp_bases=[[16, 0], [32, 0], [64, 0]], block_bases=[], shape=[128, 16])


@gluon.constexpr_function
def _copy_words8():
    """_copy_words over 128 rows and 8 warps."""
    return gl.DistributedLinearLayout(reg_bases=[[0, 0, 1], [0, 0, 2], [0, 8, 0], [1, 0, 0]],
                                      lane_bases=[[0, 0, 4], [0, 0, 8], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
                                      warp_bases=[[0, 16, 0], [0, 32, 0], [0, 64, 0]], block_bases=[],
                                      shape=[2, 128, 16])


@gluon.constexpr_function
def _warp_cols8():
    """_warp_cols(8) over 8 warps."""
    return gl.DistributedLinearLayout(reg_bases=[[0, 1], [1, 0], [2, 0], [4, 0]],
                                      lane_bases=[[0, 2], [0, 4], [0, 0], [0, 0], [0, 0]],
                                      warp_bases=[[0, 0], [0, 0], [0, 0]], block_bases=[], shape=[8, 8])


@gluon.jit
def _halves8(x):
    """Words [128, 16] as their fp16 values [128, 64] in byte order."""
    e0, e1, e2, e3 = _cvt4h(x)
    return gl.reshape(gl.join(gl.join(e0, e2), gl.join(e1, e3)), [128, 64])


@gluon.jit
def _frag8(xb, a_layout: gl.constexpr):
    """_frag over 128 rows."""
    y = gl.reshape(xb, [128, 4, 4, 2, 2])
    y = gl.permute(y, [0, 2, 3, 1, 4])
    y = gl.reshape(y, [128, 64])
    return gl.convert_layout(y, a_layout, assert_trivial=True)


@gluon.jit
def _issue8(K, V, k_s, v_s, slot, pg, start, r, cw, k_hi, stride_p, stride_s, head_off, PAGE: gl.constexpr):
    """_issue for 128-key blocks (r [128])."""
    ok = ((start + r) < k_hi)[None, :, None]
    rows = pg.to(gl.int64) * stride_p + ((start + r) % PAGE) * stride_s + head_off
    off = rows[None, :, None] + cw
    async_copy.async_copy_global_to_shared(k_s.index(slot), K + off, mask=ok)
    async_copy.async_copy_global_to_shared(v_s.index(slot), V + off, mask=ok)
    async_copy.commit_group()


@gluon.jit(do_not_specialize=["num_pages", "stride_bt", "n_cap", "chunk"])
def _paged_swap8(Q, K, V, KScale, VScale, BlockTable, Seqlens, Dst, DstLse, num_pages, stride_bt, n_cap, chunk,
                 qk_scale, k_mul, v_mul, stride_p, stride_s, stride_ds, stride_db, stride_ls, stride_lb,
                 HKV: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr, DIRECT: gl.constexpr,
                 SCALES: gl.constexpr):
    """_paged_swap on two warpgroups and 128-key blocks ([Lab] Two warpgroups), RED's column max, the copies first
    in a step; NQ 8."""
    gl.static_assert(STAGES >= 2)
    NQ: gl.constexpr = 8
    split = gl.program_id(0)
    h = gl.program_id(1)
    b = gl.program_id(2)
    s_layout: gl.constexpr = _mma8(NQ)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    kcol: gl.constexpr = gl.SliceLayout(1, s_layout)
    qcol: gl.constexpr = gl.SliceLayout(0, s_layout)
    dt: gl.constexpr = gl.float16
    ring_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0])
    k_s = gl.allocate_shared_memory(gl.int32, [STAGES, 2, 128, 16], ring_sl)
    v_s = gl.allocate_shared_memory(gl.int32, [STAGES, 2, 128, 16], ring_sl)
    v_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([128, 128], dt)
    q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([NQ, 64], dt)
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([128, NQ], dt)
    v_t = gl.allocate_shared_memory(dt, [1, 128, 128], v_sl)  # V fp16 [keys, d]
    q_s = gl.allocate_shared_memory(dt, [2, NQ, 64], q_sl)
    p_s = gl.allocate_shared_memory(dt, [1, 128, NQ], p_sl)
    red_s = gl.allocate_shared_memory(gl.float32, [8, NQ], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    l3: gl.constexpr = _copy_words8()
    r = gl.arange(0, 128, layout=gl.SliceLayout(0, gl.SliceLayout(2, l3)))
    cw = (gl.arange(0, 2, layout=gl.SliceLayout(1, gl.SliceLayout(2, l3)))[:, None, None] * 16
          + gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, l3)))[None, None, :])

    n_k = gl.minimum(gl.maximum(gl.load(Seqlens + b), 0), gl.where(num_pages > 0, n_cap, 0))
    lo = split * chunk
    k_hi = gl.minimum(lo + chunk, n_k)
    n_blocks = gl.cdiv(k_hi - lo, 128)
    if not DIRECT:
        if lo >= k_hi:
            return
    bt_row = b.to(gl.int64) * stride_bt
    head_off = h * ROW_W
    for i in gl.static_range(STAGES - 1):
        pg = _pages(BlockTable, bt_row, lo + i * 128, r, k_hi, num_pages, PAGE)
        _issue8(K, V, k_s, v_s, i, pg, lo + i * 128, r, cw, k_hi, stride_p, stride_s, head_off, PAGE)
    pg_next = _pages(BlockTable, bt_row, lo + (STAGES - 1) * 128, r, k_hi, num_pages, PAGE)

    lq: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
    qn = gl.arange(0, NQ, layout=gl.SliceLayout(1, lq))
    L = gl.arange(0, 64, layout=gl.SliceLayout(0, lq))
    src = 16 * ((L >> 1) & 3) + 4 * (L >> 4) + 2 * ((L >> 3) & 1) + (L & 1)
    qbase = Q + (b.to(gl.int64) * (HKV * GQA) + h * GQA + qn)[:, None] * 128 + src[None, :]
    qok = (qn < GQA)[:, None]
    q0 = gl.load(qbase, mask=qok, other=0.0).to(gl.float32)
    q1 = gl.load(qbase + 64, mask=qok, other=0.0).to(gl.float32)
    cq = _pow2_scale(gl.maximum(gl.max(gl.max(gl.abs(q0), 1), 0), gl.max(gl.max(gl.abs(q1), 1), 0)))
    q_s.index(0).store((q0 * cq).to(dt))
    q_s.index(1).store((q1 * cq).to(dt))
    if SCALES == 1:
        k_mul = gl.load(KScale + h)
        v_mul = gl.load(VScale + h)
    qk_scale = qk_scale * k_mul / cq
    async_copy.wait_group(STAGES - 2)  # block 0 landed (this thread's copies)
    fence_async_shared()
    gl.thread_barrier()

    keys0 = gl.arange(0, 128, layout=kcol)
    m_i = gl.full([NQ], float("-inf"), gl.float32, qcol)
    l_p = gl.zeros([128, NQ], gl.float32, s_layout)
    o = gl.zeros([128, NQ], gl.float32, s_layout)  # O^T [d, queries]
    lw: gl.constexpr = _frag_words8()
    for j in range(n_blocks):
        slot = j % STAGES
        ahead = lo + (j + STAGES - 1) * 128  # the copies first ([Lab] Two warpgroups)
        _issue8(K, V, k_s, v_s, (j + STAGES - 1) % STAGES, pg_next, ahead, r, cw, k_hi, stride_p, stride_s,
                head_off, PAGE)
        pg_next = _pages(BlockTable, bt_row, ahead + 128, r, k_hi, num_pages, PAGE)
        s0 = gl.zeros([128, NQ], gl.float32, s_layout)
        xk0, xk1 = gl.split(gl.permute(k_s.index(slot).load(l3), [1, 2, 0]))
        a0 = _frag8(_halves8(xk0), a_layout)
        tok = warpgroup_mma(a0, q_s.index(0).permute((1, 0)), s0, use_acc=False, is_async=True)
        a1 = _frag8(_halves8(xk1), a_layout)
        tok = warpgroup_mma(a1, q_s.index(1).permute((1, 0)), tok, is_async=True)
        xv0, xv1 = gl.split(gl.permute(v_s.index(slot).load(l3), [1, 2, 0]))
        s, a0, a1 = warpgroup_mma_wait(0, deps=(tok, a0, a1))
        s = gl.where((lo + j * 128 + keys0 < k_hi)[:, None], s * qk_scale, float("-inf"))
        wm = gl.max(gl.reshape(s, [8, 16, NQ]), 1)  # each warp's 16 keys
        red_s.store(wm)
        gl.thread_barrier()
        m_new = gl.maximum(m_i, gl.convert_layout(gl.max(red_s.load(_warp_cols8()), 0), qcol, assert_trivial=True))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(s - m_use[None, :])
        l_p = l_p * alpha[None, :] + p
        m_i = m_new
        vb = gl.reshape(gl.permute(gl.join(_halves8(xv0), _halves8(xv1)), [0, 2, 1]), [128, 128])
        v_t.index(0).store(vb)
        p_s.index(0).store((p * 16384.0).to(dt))
        fence_async_shared()
        async_copy.wait_group(STAGES - 2)  # block j + 1 landed
        gl.thread_barrier()
        t0 = warpgroup_mma(v_t.index(0).permute((1, 0)), p_s.index(0), o * alpha[None, :], is_async=True)
        o = warpgroup_mma_wait(0, deps=(t0,))
    async_copy.wait_group(0)

    l_i = gl.sum(l_p, 0)
    seen = l_i != 0
    l_safe = gl.where(seen, l_i, 1.0)
    inv = gl.where(seen, v_mul / (l_safe * 16384.0), 0.0)[None, :]
    lse = gl.where(seen, gl.where(seen, m_i, 0.0) + gl.log2(l_safe), float("-inf"))
    on = gl.arange(0, NQ, layout=qcol)
    om = gl.arange(0, 128, layout=kcol)
    ok = (on < GQA)[None, :] & (om < 128)[:, None]
    head = b.to(gl.int64) * stride_db + (h * GQA + on) * 128
    lhead = b.to(gl.int64) * stride_lb + h * GQA + on
    if DIRECT:
        gl.store(Dst + head[None, :] + om[:, None], (o * inv).to(gl.bfloat16), mask=ok)
        gl.store(DstLse + lhead, lse * 0.6931471805599453, mask=on < GQA)
    else:
        gl.store(Dst + split.to(gl.int64) * stride_ds + head[None, :] + om[:, None], o * inv, mask=ok)
        gl.store(DstLse + split.to(gl.int64) * stride_ls + lhead, lse, mask=on < GQA)


def forward(q, k_cache, v_cache, *, block_table, seqlens_k, k_scale=None, v_scale=None, scale=None, num_splits=1,
            stages=4, nq=8, pipe=0, red=0, early=0, nocopy=0, w8=0):
    """(out [B, Hq, 1, 128] bf16, lse [B, Hq, 1] fp32): the product's forward for this lab's shapes. k_scale /
    v_scale: float32 [Hkv] tensors, floats or None; num_splits the split count (chunks of whole 64-key blocks)."""
    bsz, hq, sq, d = q.shape
    pages, page, hkv, d2 = k_cache.shape
    assert sq == 1 and d == d2 == 128 and hq == 4 * hkv and q.dtype == torch.bfloat16 and q.is_contiguous()
    assert k_cache.dtype == torch.float8_e4m3fn and k_cache.stride() == v_cache.stride() and k_cache.is_contiguous()
    assert page & (page - 1) == 0
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    width = block_table.shape[1]
    n_cap = width * page
    bn = 128 if w8 else 64  # keys a step
    chunk = -(-(-(-n_cap // num_splits)) // bn) * bn
    splits = max(1, -(-n_cap // chunk))
    per_head = isinstance(k_scale, torch.Tensor)
    assert per_head == isinstance(v_scale, torch.Tensor)
    km = 1.0 if per_head or k_scale is None else float(k_scale)
    vm = 1.0 if per_head or v_scale is None else float(v_scale)
    ks, vs = (k_scale, v_scale) if per_head else (seqlens_k, seqlens_k)  # unread when SCALES 0
    out = torch.empty_like(q)
    lse = torch.empty(bsz, hq, 1, dtype=torch.float32, device=q.device)
    direct = splits == 1
    if direct:
        dst, dlse = out, lse
    else:
        key = (splits, bsz, hq, q.device)
        if key not in s16._WS:
            s16._WS[key] = (torch.empty(splits, bsz, hq, 1, 128, dtype=torch.float32, device=q.device),
                            torch.empty(splits, bsz, hq, 1, dtype=torch.float32, device=q.device))
        dst, dlse = s16._WS[key]
    kw, vw = k_cache.view(torch.int32), v_cache.view(torch.int32)
    common = (q, kw, vw, ks, vs, block_table, seqlens_k, dst, dlse, pages, block_table.stride(0), n_cap, chunk,
              scale * 1.4426950408889634, km, vm, kw.stride(0), kw.stride(1),
              dst.stride(0) if not direct else 0, dst.stride(0) if direct else dst.stride(1),
              dlse.stride(0) if not direct else 0, dlse.stride(0) if direct else dlse.stride(1))
    if w8:
        _paged_swap8[(splits, hkv, bsz)](*common, HKV=hkv, PAGE=page, STAGES=stages, DIRECT=direct,
                                         SCALES=int(per_head), num_warps=8)
    else:
        _paged_swap[(splits, hkv, bsz)](*common, HKV=hkv, PAGE=page, STAGES=stages, DIRECT=direct,
                                        SCALES=int(per_head), NQ=nq, PIPE=pipe, RED=red, EARLY=early, NOCOPY=nocopy,
                                        num_warps=4)
    if not direct:
        s16._merge[(hkv, bsz)](dst, dlse, out, lse, seqlens_k, pages, n_cap, chunk, dst.stride(0), dst.stride(1),
                               dlse.stride(0), dlse.stride(1), HKV=hkv, ROWS=16, num_warps=4)
    return out, lse


def build_sm90(stages=4, nq=8, direct=True, scales=1, pipe=0, red=0, early=0, nocopy=0, w8=0):
    """The kernel built for sm_90 on the CPU: (compiled kernel, ptxas resources); w8: _paged_swap8 (stages, direct,
    scales only)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource as ASTSource
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from sm90 import ptxas
    sig = dict(Q="*bf16", K="*i32", V="*i32", KScale="*fp32", VScale="*fp32", BlockTable="*i32",
               Seqlens="*i32", Dst="*bf16" if direct else "*fp32", DstLse="*fp32", num_pages="i32", stride_bt="i32",
               n_cap="i32", chunk="i32", qk_scale="fp32", k_mul="fp32", v_mul="fp32", stride_p="i32",
               stride_s="i32", stride_ds="i32", stride_db="i32", stride_ls="i32", stride_lb="i32",
               HKV="constexpr", PAGE="constexpr", STAGES="constexpr", DIRECT="constexpr", SCALES="constexpr",
               NQ="constexpr", PIPE="constexpr", RED="constexpr", EARLY="constexpr", NOCOPY="constexpr")
    names = list(sig)
    div = [names.index(n) for n in ("Q", "K", "V", "KScale", "VScale", "BlockTable", "Seqlens", "Dst", "DstLse",
                                    "stride_p", "stride_s", "stride_db", "stride_lb")]
    consts = dict(HKV=8, PAGE=16, STAGES=stages, DIRECT=direct, SCALES=scales)
    if w8:
        for n in ("NQ", "PIPE", "RED", "EARLY", "NOCOPY"):
            del sig[n]
    else:
        consts.update(NQ=nq, PIPE=pipe, RED=red, EARLY=early, NOCOPY=nocopy)
    src = ASTSource(fn=_paged_swap8 if w8 else _paged_swap, signature=sig, constexprs=consts,
                    attrs={(i,): [["tt.divisibility", 16]] for i in div})
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 128), options=dict(num_warps=8 if w8 else 4))
    res = next(iter(ptxas(ck.asm["ptx"])[0].values()))
    return ck, res


def loop_sass(ck, keys=64, warps=4, marker="GMMA"):
    """The innermost SASS loops holding `marker` (the key step): instructions, warp instructions a key
    (instructions x warps / keys), barriers, and the top opcodes."""
    import re
    import subprocess
    import tempfile
    from collections import Counter
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
    body = {lp: [t for a, t in ins if lp[0] <= a <= lp[1]] for lp in loops}
    found = [lp for lp in loops if any(marker in t for t in body[lp])]
    inner = [lp for lp in found if not any(o != lp and lp[0] <= o[0] and o[1] <= lp[1] for o in found)]
    out = []
    for lp in sorted(inner):
        ops = Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body[lp])
        out.append(dict(instructions=len(body[lp]), per_key=round(len(body[lp]) * warps / keys, 1),
                        bar=ops.get("BAR", 0), top=dict(ops.most_common(12))))
    return out


if __name__ == "__main__":  # the sm_90 builds on the CPU
    for cfg in sys.argv[1:] or ["3,0,0,0", "4,0,0,0", "3,1,0,0", "4,1,0,0", "4,0,1,0", "4,1,1,0", "4,0,1,1",
                                "5,0,1,1", "4,0,1,2"]:
        st, pipe, red, early = (int(x) for x in cfg.split(","))
        ck, res = build_sm90(st, pipe=pipe, red=red, early=early)
        print(dict(stages=st, pipe=pipe, red=red, early=early, regs=res.registers, spills=res.spill_stores + res.spill_loads,
                   smem=ck.metadata.shared,
                   loops=loop_sass(ck)), flush=True)
