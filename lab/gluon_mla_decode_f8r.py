"""Lab (not the product): the MLA absorbed decode over an fp8 e4m3 latent cache with register-A scores, sm_90, Gluon.
Eleventh session (issue 27 part 2: an fp8 latent read at >= 90% of copy; the ninth session's swap-AB lab kernel,
lab/gluon_mla_decode_fp8.py, reads it at 46-70%, the product's Triton decode at 31-51%).

Contract as lab/gluon_mla_decode_fp8.py: q [B, Hq, Sq, 576] bf16 (Hq x Sq <= 16), cache [num_pages, PAGE, 1, 576]
float8_e4m3fn (PAGE a multiple of 64), one scale a token (float32 [num_pages, PAGE, 1]) or one a tensor (a float),
block_table int32 [B, width], seqlens_k int32 [B]; out [B, Hq, Sq, 512] bf16, lse [B, Hq, Sq]; causal as fagen's
decode.

[Note] Lab register-A scores. The ninth session's step stores the whole converted block (64 keys x 576, 72 KB of
bf16) into shared memory and its scores' wgmma read it back as their A operand: S^T = K Q^T with K as A reads
2 KB of shared memory a k16-step for 64 x 16 x 16 multiply-adds, and with the store, V^T's reads for P V and Q's,
about 240 KB of shared-memory traffic a 36 KB block a CTA (the SM's 128 B a clock: ~1 us a block a CTA, two CTAs
an SM sharing it). Here the scores take K from registers:
  - each 64-column chunk J (9: 8 latent, 1 rope) of the block's fp8 rows comes by one 16-byte load a row a thread in
    the layout of the wgmma's A fragment (thread lane l of warp w holds rows 16 w + l // 4 and + 8, bytes
    16 (l % 4) .. + 15 of the chunk), one block ahead as in the ninth session's kernel;
  - converted in registers, 4 bytes at a time, by the exact integer asm ([Note] fp8 conversion);
  - the K dimension permuted inside each chunk so that the bytes a thread loads are the A fragment's elements:
    logical column L = 16 s + 8 h + 2 t + i (s the k16-step, t = l % 4, h, i in {0, 1}) is byte P(L) = 16 t + 4 s +
    2 h + i of the chunk; Q's columns are stored in shared memory permuted the same way (once a CTA), so S^T is
    unchanged (the sum over the 576 columns in another order). The bytes' register order to the fragment's is a
    register renaming (convert_layout(..., assert_trivial=True));
  - the 8 latent chunks' bf16 values also go to shared memory as V (64 x 512, 64 KB: no rope tile) for O^T += V^T
    P^T, as before; the scores' wgmma are issued a chunk at a time, asynchronously, each chunk's fragment
    registers kept until the wgmma that reads them has retired (wait with one outstanding).
Shared-memory traffic a block: V's store 64 KB and its reads for P V 64 KB, Q 18 KB, P: ~150 KB. One warpgroup a
CTA, 84 KB: two CTAs an SM. Splits and the merge as the ninth session's kernel.
"""
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, \
    warpgroup_mma_init, warpgroup_mma_wait

from lab.gluon_mla_decode_fp8 import D, DV, DV_K, D_K, _mma, _page, _pow2_scale, splits_for  # noqa: F401

ROW_W = gl.constexpr(144)  # int32 words a cache row


@gluon.constexpr_function
def _frag_words():
    """[64 rows, 16 words] of a chunk's bytes as int32 words: a thread 4 consecutive words (16 bytes) of two rows
    (l // 4 and + 8 of its warp's 16), as the wgmma's A fragment holds them ([Note] Lab register-A scores)."""
    return gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [8, 0]],
                                      lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
                                      warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 16])


@gluon.jit
def _cvt4(x):
    """Four fp8 e4m3 bytes in an int32 word as four bf16 values, exactly: the decode template's integer asm ([Note]
    fp8 conversion in fagen/templates/triton/decode.py.j2); the words stay words in the loop-carried registers."""
    return gl.inline_asm_elementwise(
        asm="""{
        .reg .b32 a, b, c, d, s, z;
        prmt.b32 a, $4, 0, 0x1404;
        prmt.b32 b, $4, 0, 0x3424;
        and.b32 c, a, 0x7f007f00;
        and.b32 d, b, 0x7f007f00;
        shr.b32 c, c, 4;
        shr.b32 d, d, 4;
        and.b32 a, a, 0x80008000;
        and.b32 b, b, 0x80008000;
        or.b32 c, c, a;
        or.b32 d, d, b;
        mov.b32 s, 0x7b807b80;
        mov.b32 z, 0x80008000;
        fma.rn.bf16x2 c, c, s, z;
        fma.rn.bf16x2 d, d, s, z;
        mov.b32 {$0, $1}, c;
        mov.b32 {$2, $3}, d;
        }""",
        constraints="=h,=h,=h,=h,r", args=[x], dtype=(gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16),
        is_pure=True, pack=1)


@gluon.jit
def _cvt4h(x):
    """Four fp8 e4m3 bytes in an int32 word as four fp16 values, exactly: the hardware's cvt, two values an
    instruction ([Note] Lab fp16 dots in lab/gluon_mla_decode_fp8.py)."""
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
def _bf16_bytes(x, F16: gl.constexpr):
    """A chunk's words [64, 16] as its bf16 (fp16 under F16) values [64, 64] in byte order."""
    if F16:
        e0, e1, e2, e3 = _cvt4h(x)
    else:
        e0, e1, e2, e3 = _cvt4(x)
    return gl.reshape(gl.join(gl.join(e0, e2), gl.join(e1, e3)), [64, 64])


@gluon.jit
def _frag(xb, a_layout: gl.constexpr):
    """A chunk's bf16 values in byte order [64, 64] as the wgmma A fragment over the permuted columns ([Note] Lab
    register-A scores): byte 16 t + 4 s + 2 h + i is column 16 s + 8 h + 2 t + i."""
    y = gl.reshape(xb, [64, 4, 4, 2, 2])
    y = gl.permute(y, [0, 2, 3, 1, 4])
    y = gl.reshape(y, [64, 64])
    return gl.convert_layout(y, a_layout, assert_trivial=True)


@gluon.constexpr_function
def _warp_keys():
    """[64] keys, each warp all 64 (two a lane): a block's per-token scales, reduced within a warp ([Note] Lab warp
    max of the scales)."""
    return gl.DistributedLinearLayout(reg_bases=[[1]], lane_bases=[[2], [4], [8], [16], [32]], warp_bases=[[0], [0]],
                                      block_bases=[], shape=[64])


@gluon.jit
def _page_raw(BlockTable, bt_row, start, ok_block, PAGE: gl.constexpr):
    """The block table's entry for key `start` (0 when not ok_block), unclamped: [Note] Lab late page clamp."""
    return gl.load(BlockTable + bt_row + start // PAGE, mask=ok_block, other=0)


@gluon.jit
def _rows(Cache, page, start, seq_len, ok_block, PAGE: gl.constexpr):
    """The word pointers [64, 16] of the first chunk of the 64 keys from `start` (on `page`), their mask (zeros past
    seq_len or when not ok_block) and the first key's cache row."""
    lw: gl.constexpr = _frag_words()
    row0 = page.to(gl.int64) * PAGE + start % PAGE
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, lw))
    c = gl.arange(0, 16, layout=gl.SliceLayout(0, lw))
    ok = ((start + r < seq_len) & ok_block)[:, None]
    return Cache + (row0 + r.to(gl.int64))[:, None] * ROW_W + c[None, :], ok, row0


@gluon.jit
def _fetch(Cache, page, start, seq_len, ok_block, PAGE: gl.constexpr):
    """The fp8 bytes of the 64 keys from `start` (on `page`) as 9 chunks of int32 words [64, 16] in _frag_words
    (8 latent, 1 rope), zeros past seq_len or when not ok_block."""
    lw: gl.constexpr = _frag_words()
    row0 = page.to(gl.int64) * PAGE + start % PAGE
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, lw))
    c = gl.arange(0, 16, layout=gl.SliceLayout(0, lw))
    ok = ((start + r < seq_len) & ok_block)[:, None]
    base = Cache + (row0 + r.to(gl.int64))[:, None] * ROW_W + c[None, :]
    x0 = gl.load(base, mask=ok, other=0)
    x1 = gl.load(base + 16, mask=ok, other=0)
    x2 = gl.load(base + 32, mask=ok, other=0)
    x3 = gl.load(base + 48, mask=ok, other=0)
    x4 = gl.load(base + 64, mask=ok, other=0)
    x5 = gl.load(base + 80, mask=ok, other=0)
    x6 = gl.load(base + 96, mask=ok, other=0)
    x7 = gl.load(base + 112, mask=ok, other=0)
    x8 = gl.load(base + 128, mask=ok, other=0)
    return x0, x1, x2, x3, x4, x5, x6, x7, x8, row0


@gluon.jit
def _chunk(x, v_dst, q_src, tok, prev, a_layout: gl.constexpr, FIRST: gl.constexpr, STORE: gl.constexpr,
           F16: gl.constexpr):
    """One chunk: convert, store V's part (STORE), issue its scores' wgmma (A from registers) and retire the
    previous chunk's (one outstanding). Returns (token, this chunk's fragment)."""
    xb = _bf16_bytes(x, F16)
    if STORE:
        v_dst.store(xb)
    a = _frag(xb, a_layout)
    if FIRST:
        tok = warpgroup_mma(a, q_src.permute((1, 0)), tok, use_acc=False, is_async=True)
    else:
        tok = warpgroup_mma(a, q_src.permute((1, 0)), tok, is_async=True)
        tok, prev = warpgroup_mma_wait(1, deps=(tok, prev))
    return tok, a


@gluon.jit(do_not_specialize=["stride_bt", "bt_width", "num_pages", "num_splits", "per"])
def _mla_decode_f8r(Q, Cache, KTok, BlockTable, Seqlens, Out, Lse, PartO, PartLse, stride_bt, bt_width, num_pages,
                    qk_scale, v_mul, num_splits, per, ROWS: gl.constexpr, NQ: gl.constexpr, SQ: gl.constexpr,
                    PAGE: gl.constexpr, CAUSAL: gl.constexpr, DIRECT: gl.constexpr, PER_TOKEN: gl.constexpr,
                    L_PART: gl.constexpr, F16: gl.constexpr, EARLY: gl.constexpr, PAGE_LATE: gl.constexpr):
    gl.static_assert(PAGE % 64 == 0)
    gl.static_assert(NQ == 16 and NQ >= ROWS)
    split = gl.program_id(0)
    b = gl.program_id(1)
    s_layout: gl.constexpr = _mma(NQ)
    o_layout: gl.constexpr = _mma(NQ)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    kcol: gl.constexpr = gl.SliceLayout(1, s_layout)  # a key (a row of S^T)
    qcol: gl.constexpr = gl.SliceLayout(0, s_layout)  # a query row (a column of S^T)
    # [Note] Lab fp16 dots (F16), as lab/gluon_mla_decode_fp8.py: the hardware cvt, q c_q and P ks c_j in fp16
    dt: gl.constexpr = gl.float16 if F16 else gl.bfloat16
    v_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 64], dt)
    q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([NQ, 64], dt)
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, NQ], dt)
    # V: 8 chunks of [64 keys, 64 latent columns], each its own allocation (Triton's barrier pass sees any two
    # stores into one allocation as a conflict: a CTA barrier before each; [Note] Lab separate buffers)
    v0 = gl.allocate_shared_memory(dt, [1, 64, 64], v_sl)
    v1 = gl.allocate_shared_memory(dt, [1, 64, 64], v_sl)
    v2 = gl.allocate_shared_memory(dt, [1, 64, 64], v_sl)
    v3 = gl.allocate_shared_memory(dt, [1, 64, 64], v_sl)
    v4 = gl.allocate_shared_memory(dt, [1, 64, 64], v_sl)
    v5 = gl.allocate_shared_memory(dt, [1, 64, 64], v_sl)
    v6 = gl.allocate_shared_memory(dt, [1, 64, 64], v_sl)
    v7 = gl.allocate_shared_memory(dt, [1, 64, 64], v_sl)
    q_s = gl.allocate_shared_memory(dt, [9, NQ, 64], q_sl)  # Q, each chunk's columns permuted
    p_s = gl.allocate_shared_memory(dt, [1, 64, NQ], p_sl)

    # q rows b * ROWS + n (n < ROWS; the rest zero), chunk J's column L from column 64 J + P(L)
    lq: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    qn = gl.arange(0, NQ, layout=gl.SliceLayout(1, lq))
    L = gl.arange(0, 64, layout=gl.SliceLayout(0, lq))
    src = 16 * ((L >> 1) & 3) + 4 * (L >> 4) + 2 * ((L >> 3) & 1) + (L & 1)
    qbase = Q + (b * ROWS + qn).to(gl.int64)[:, None] * D_K + src[None, :]
    qok = (qn < ROWS)[:, None]
    if F16:  # q c_q (c_q the power of two putting the CTA's largest |q| in [2^14, 2^15)), 1/c_q in the score scale
        amax = gl.max(gl.max(gl.abs(gl.load(qbase, mask=qok, other=0.0).to(gl.float32)), 1), 0)
        for J in gl.static_range(1, 9):
            amax = gl.maximum(amax, gl.max(gl.max(gl.abs(gl.load(qbase + 64 * J, mask=qok, other=0.0).to(gl.float32)),
                                                  1), 0))
        cq = _pow2_scale(amax)
        qk_scale = qk_scale / cq
        for J in gl.static_range(9):
            q_s.index(J).store((gl.load(qbase + 64 * J, mask=qok, other=0.0).to(gl.float32) * cq).to(dt))
    else:
        for J in gl.static_range(9):
            q_s.index(J).store(gl.load(qbase + 64 * J, mask=qok, other=0.0))
    c_prev = gl.max(gl.full([NQ], 1.0, gl.float32, qcol), 0)  # P's scale ([Note] Lab fp16 dots); 1 in bf16
    if F16:
        if not PER_TOKEN:
            c_prev = c_prev * 16384.0

    seq_len = gl.minimum(gl.maximum(gl.load(Seqlens + b), 0), bt_width * PAGE)  # memory safety, as the product
    n_all = (seq_len + 63) // 64
    j_lo = gl.minimum(split * per, n_all)
    n_blocks = gl.minimum(n_all - j_lo, per)
    k_lo = j_lo * 64
    bt_row = b.to(gl.int64) * stride_bt
    n = gl.arange(0, NQ, layout=qcol)
    if CAUSAL:
        lim = seq_len - SQ + n % SQ
    else:
        lim = gl.full([NQ], 0, gl.int32, qcol) + (seq_len - 1)
    m_i = gl.full([NQ], float("-inf"), gl.float32, qcol)
    l_i = gl.zeros([NQ], gl.float32, qcol)
    l_p = gl.zeros([64, NQ], gl.float32, s_layout)  # [Note] Lab partial row sums (lab/gluon_mla_decode_f8x.py)
    o0 = gl.zeros([64, NQ], gl.float32, o_layout)
    o1 = gl.zeros([64, NQ], gl.float32, o_layout)
    o2 = gl.zeros([64, NQ], gl.float32, o_layout)
    o3 = gl.zeros([64, NQ], gl.float32, o_layout)
    o4 = gl.zeros([64, NQ], gl.float32, o_layout)
    o5 = gl.zeros([64, NQ], gl.float32, o_layout)
    o6 = gl.zeros([64, NQ], gl.float32, o_layout)
    o7 = gl.zeros([64, NQ], gl.float32, o_layout)
    o8 = gl.zeros([64, NQ], gl.float32, o_layout)  # L_PART 2: every row the running row sums (x P's scale)
    if L_PART == 2:  # [Note] Lab row sums by the tensor cores: a [64, 64] tile of ones as a ninth V^T chunk
        gl.static_assert(not PER_TOKEN)  # P carries the per-token scales: its column sums are not l
        v_one = gl.allocate_shared_memory(dt, [1, 64, 64], v_sl)
        v_one.index(0).store(gl.full([64, 64], 1.0, dt, gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])))
    fence_async_shared()
    gl.thread_barrier()

    pg = _page(BlockTable, bt_row, k_lo, num_pages, n_blocks > 0, PAGE)
    pg_next = _page(BlockTable, bt_row, k_lo + 64, num_pages, n_blocks > 1, PAGE)  # [Note] Lab page prefetch
    pg_raw = pg_next
    x0, x1, x2, x3, x4, x5, x6, x7, x8, row0 = _fetch(Cache, pg, k_lo, seq_len, n_blocks > 0, PAGE)
    keys0 = gl.arange(0, 64, layout=kcol)
    if PER_TOKEN:
        ks = gl.load(KTok + row0 + keys0, mask=k_lo + keys0 < seq_len, other=0.0)
        if F16:  # [Note] Lab warp max of the scales: each warp loads the block's 64 and takes their max in-warp
            keysw = gl.arange(0, 64, layout=_warp_keys())
            ksw = gl.load(KTok + row0 + keysw, mask=k_lo + keysw < seq_len, other=0.0)
    t0 = warpgroup_mma_init(o0)
    t1 = warpgroup_mma_init(o1)
    t2 = warpgroup_mma_init(o2)
    t3 = warpgroup_mma_init(o3)
    t4 = warpgroup_mma_init(o4)
    t5 = warpgroup_mma_init(o5)
    t6 = warpgroup_mma_init(o6)
    t7 = warpgroup_mma_init(o7)
    t8 = warpgroup_mma_init(o8)
    for j in range(n_blocks):
        start = k_lo + j * 64
        # the previous block's P V read V and P: wait before overwriting them
        if L_PART == 2:
            o0, o1, o2, o3, o4, o5, o6, o7, o8 = warpgroup_mma_wait(0, deps=(t0, t1, t2, t3, t4, t5, t6, t7, t8))
        else:
            o0, o1, o2, o3, o4, o5, o6, o7 = warpgroup_mma_wait(0, deps=(t0, t1, t2, t3, t4, t5, t6, t7))
        z = j >> 30  # a 0 the compiler cannot fold ([Note] Seesaw descriptors)
        s0 = gl.zeros([64, NQ], gl.float32, s_layout)
        # [Note] Lab early loads (EARLY): each chunk's next-block bytes are loaded as soon as the chunk is converted
        nxt = start + 64
        if PAGE_LATE:  # [Note] Lab late page clamp: the entry loaded a step ago, clamped where it is used
            pg_next = gl.minimum(gl.maximum(pg_raw, 0), num_pages - 1)
        base_n, ok_n, row_e = _rows(Cache, pg_next, nxt, seq_len, j + 1 < n_blocks, PAGE)
        tok, a = _chunk(x0, v0.index(z), q_s.index(0 + z), s0, s0, a_layout, True, True, F16)
        if EARLY:
            x0 = gl.load(base_n, mask=ok_n, other=0)
        tok, a = _chunk(x1, v1.index(z), q_s.index(1 + z), tok, a, a_layout, False, True, F16)
        if EARLY:
            x1 = gl.load(base_n + 16, mask=ok_n, other=0)
        tok, a = _chunk(x2, v2.index(z), q_s.index(2 + z), tok, a, a_layout, False, True, F16)
        if EARLY:
            x2 = gl.load(base_n + 32, mask=ok_n, other=0)
        tok, a = _chunk(x3, v3.index(z), q_s.index(3 + z), tok, a, a_layout, False, True, F16)
        if EARLY:
            x3 = gl.load(base_n + 48, mask=ok_n, other=0)
        tok, a = _chunk(x4, v4.index(z), q_s.index(4 + z), tok, a, a_layout, False, True, F16)
        if EARLY:
            x4 = gl.load(base_n + 64, mask=ok_n, other=0)
        tok, a = _chunk(x5, v5.index(z), q_s.index(5 + z), tok, a, a_layout, False, True, F16)
        if EARLY:
            x5 = gl.load(base_n + 80, mask=ok_n, other=0)
        tok, a = _chunk(x6, v6.index(z), q_s.index(6 + z), tok, a, a_layout, False, True, F16)
        if EARLY:
            x6 = gl.load(base_n + 96, mask=ok_n, other=0)
        tok, a = _chunk(x7, v7.index(z), q_s.index(7 + z), tok, a, a_layout, False, True, F16)
        if EARLY:
            x7 = gl.load(base_n + 112, mask=ok_n, other=0)
        tok, a = _chunk(x8, v7.index(z), q_s.index(8 + z), tok, a, a_layout, False, False, F16)
        if EARLY:
            x8 = gl.load(base_n + 128, mask=ok_n, other=0)
        if PER_TOKEN:
            ks_j = ks
            if F16:
                ksw_j = ksw
        # the next block's bytes, in flight under this block's work
        if EARLY:
            row_n = row_e
        else:
            x0, x1, x2, x3, x4, x5, x6, x7, x8, row_n = _fetch(Cache, pg_next, nxt, seq_len, j + 1 < n_blocks, PAGE)
        if PER_TOKEN:
            ks = gl.load(KTok + row_n + keys0, mask=(nxt + keys0 < seq_len) & (j + 1 < n_blocks), other=0.0)
            if F16:
                ksw = gl.load(KTok + row_n + keysw, mask=(nxt + keysw < seq_len) & (j + 1 < n_blocks), other=0.0)
        if PAGE_LATE:
            pg_raw = _page_raw(BlockTable, bt_row, nxt + 64, j + 2 < n_blocks, PAGE)
        else:
            pg_next = _page(BlockTable, bt_row, nxt + 64, num_pages, j + 2 < n_blocks, PAGE)
        s, a = warpgroup_mma_wait(0, deps=(tok, a))
        keys = start + keys0
        s = s * qk_scale
        if PER_TOKEN:
            s = s * ks_j[:, None]
        s = gl.where(keys[:, None] <= lim[None, :], s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 0))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(s - m_use[None, :])
        if L_PART == 1:
            l_p = l_p * alpha[None, :] + p
        elif L_PART == 0:
            l_i = l_i * alpha + gl.sum(p, 0)
        m_i = m_new
        if F16:
            if PER_TOKEN:  # P ks c_j; the accumulators' old terms move from c_{j-1} to c_j
                c_new = _pow2_scale(gl.max(ksw_j, 0))
                alpha = alpha * (c_new / c_prev)
                p = p * (ks_j * c_new)[:, None]
                c_prev = c_new
            else:
                p = p * 16384.0
        elif PER_TOKEN:
            p = p * ks_j[:, None]  # V's per-token scale on P's rows (keys)
        p_s.index(0).store(p.to(dt))
        fence_async_shared()  # V's chunks and P, for the async proxy
        gl.thread_barrier()
        a_ = gl.convert_layout(alpha, gl.SliceLayout(0, o_layout))[None, :]
        o0 = o0 * a_
        o1 = o1 * a_
        o2 = o2 * a_
        o3 = o3 * a_
        o4 = o4 * a_
        o5 = o5 * a_
        o6 = o6 * a_
        o7 = o7 * a_
        if L_PART == 2:
            o8 = o8 * a_
        t0 = warpgroup_mma(v0.index(z).permute((1, 0)), p_s.index(z), o0, is_async=True)
        t1 = warpgroup_mma(v1.index(z).permute((1, 0)), p_s.index(z), o1, is_async=True)
        t2 = warpgroup_mma(v2.index(z).permute((1, 0)), p_s.index(z), o2, is_async=True)
        t3 = warpgroup_mma(v3.index(z).permute((1, 0)), p_s.index(z), o3, is_async=True)
        t4 = warpgroup_mma(v4.index(z).permute((1, 0)), p_s.index(z), o4, is_async=True)
        t5 = warpgroup_mma(v5.index(z).permute((1, 0)), p_s.index(z), o5, is_async=True)
        t6 = warpgroup_mma(v6.index(z).permute((1, 0)), p_s.index(z), o6, is_async=True)
        t7 = warpgroup_mma(v7.index(z).permute((1, 0)), p_s.index(z), o7, is_async=True)
        if L_PART == 2:
            t8 = warpgroup_mma(v_one.index(z).permute((1, 0)), p_s.index(z), o8, is_async=True)
        if L_PART == 2:  # retired here, before the loop's back edge: with the wait at the loop's top ptxas serialises
            # the wgmma (C7515: the back edge's register copies define accumulator registers inside the stage)
            o0, o1, o2, o3, o4, o5, o6, o7, o8 = warpgroup_mma_wait(0, deps=(t0, t1, t2, t3, t4, t5, t6, t7, t8))
            t8 = warpgroup_mma_init(o8)
        if L_PART == 1:
            o0, o1, o2, o3, o4, o5, o6, o7 = warpgroup_mma_wait(0, deps=(t0, t1, t2, t3, t4, t5, t6, t7))
        if L_PART != 0:
            t0 = warpgroup_mma_init(o0)
            t1 = warpgroup_mma_init(o1)
            t2 = warpgroup_mma_init(o2)
            t3 = warpgroup_mma_init(o3)
            t4 = warpgroup_mma_init(o4)
            t5 = warpgroup_mma_init(o5)
            t6 = warpgroup_mma_init(o6)
            t7 = warpgroup_mma_init(o7)
    if L_PART == 2:
        o0, o1, o2, o3, o4, o5, o6, o7, o8 = warpgroup_mma_wait(0, deps=(t0, t1, t2, t3, t4, t5, t6, t7, t8))
    else:
        o0, o1, o2, o3, o4, o5, o6, o7 = warpgroup_mma_wait(0, deps=(t0, t1, t2, t3, t4, t5, t6, t7))

    if L_PART == 1:
        l_i = gl.sum(l_p, 0)
    if L_PART == 2:  # every row of o8 holds sum P = c l
        l_i = gl.convert_layout(gl.max(o8, 0), qcol) / c_prev
    l_safe = gl.where(l_i == 0.0, 1.0, l_i)
    inv = gl.convert_layout(v_mul / (l_safe * c_prev), gl.SliceLayout(0, o_layout))[None, :]
    m_fin = gl.where(m_i == float("-inf"), 0.0, m_i)
    lse2 = gl.where(l_i == 0.0, float("-inf"), m_fin + gl.log2(l_safe))
    on = gl.arange(0, NQ, layout=gl.SliceLayout(0, o_layout))
    om = gl.arange(0, 64, layout=gl.SliceLayout(1, o_layout))
    real = (on < ROWS)[None, :] & (om < 64)[:, None]
    if DIRECT:
        base = Out + (b * ROWS + on).to(gl.int64)[None, :] * DV_K + om[:, None]
        gl.store(base, (o0 * inv).to(gl.bfloat16), mask=real)
        gl.store(base + 64, (o1 * inv).to(gl.bfloat16), mask=real)
        gl.store(base + 128, (o2 * inv).to(gl.bfloat16), mask=real)
        gl.store(base + 192, (o3 * inv).to(gl.bfloat16), mask=real)
        gl.store(base + 256, (o4 * inv).to(gl.bfloat16), mask=real)
        gl.store(base + 320, (o5 * inv).to(gl.bfloat16), mask=real)
        gl.store(base + 384, (o6 * inv).to(gl.bfloat16), mask=real)
        gl.store(base + 448, (o7 * inv).to(gl.bfloat16), mask=real)
        gl.store(Lse + b * ROWS + n, lse2 * 0.6931471805599453, mask=n < ROWS)
    else:
        prow = (b * num_splits + split) * ROWS
        base = PartO + (prow + on).to(gl.int64)[None, :] * DV_K + om[:, None]
        gl.store(base, o0 * inv, mask=real)
        gl.store(base + 64, o1 * inv, mask=real)
        gl.store(base + 128, o2 * inv, mask=real)
        gl.store(base + 192, o3 * inv, mask=real)
        gl.store(base + 256, o4 * inv, mask=real)
        gl.store(base + 320, o5 * inv, mask=real)
        gl.store(base + 384, o6 * inv, mask=real)
        gl.store(base + 448, o7 * inv, mask=real)
        gl.store(PartLse + prow + n, lse2, mask=n < ROWS)


def _args(q, cache, block_table, seqlens_k, scale, k_scale, num_splits, causal, sms=132, per_sm=2, l_part=False,
          f16=False, early=False, page_late=False):
    bsz, hq, sq, d = q.shape
    rows = hq * sq
    assert d == D and rows <= 16 and cache.shape[-1] == D and cache.shape[2] == 1 and cache.shape[1] % 64 == 0
    page = cache.shape[1]
    per, splits = splits_for(bsz, block_table.shape[1] * page, sms, num_splits, per_sm)
    direct = splits == 1
    out = torch.empty((bsz, hq, sq, DV), dtype=q.dtype, device=q.device)
    lse = torch.empty((bsz, hq, sq), dtype=torch.float32, device=q.device)
    if direct:
        part_o, part_lse = out, lse
    else:
        part_o = torch.empty((bsz * splits * rows, DV), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((bsz * splits * rows, ), dtype=torch.float32, device=q.device)
    per_token = isinstance(k_scale, torch.Tensor)
    ktok = k_scale.reshape(-1) if per_token else lse  # never read per tensor
    mul = 1.0 if per_token else float(k_scale)
    args = (q, cache.view(torch.int32), ktok, block_table, seqlens_k, out, lse, part_o, part_lse,
            block_table.stride(0), block_table.shape[1], cache.shape[0], scale * 1.4426950408889634 * mul, mul,
            splits, per)
    kw = dict(ROWS=rows, NQ=16, SQ=sq, PAGE=page, CAUSAL=causal, DIRECT=direct, PER_TOKEN=per_token, L_PART=int(l_part), F16=f16,
              EARLY=early, PAGE_LATE=page_late)
    return args, kw, out, lse, part_o, part_lse, splits


def mla_decode_f8r(q, cache, block_table, seqlens_k, scale, k_scale, num_splits=None, causal=True, per_sm=2,
                   l_part=False, f16=False, early=False, page_late=False):
    """out [B, Hq, Sq, 512], lse [B, Hq, Sq]; q contiguous bf16 (Hq x Sq <= 16), cache [num_pages, PAGE, 1, 576]
    float8_e4m3fn contiguous, k_scale a float or float32 [num_pages, PAGE, 1] contiguous."""
    assert q.is_contiguous() and cache.is_contiguous() and q.dtype == torch.bfloat16
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    args, kw, out, lse, part_o, part_lse, splits = _args(q, cache, block_table, seqlens_k, scale, k_scale,
                                                         num_splits, causal, sms, per_sm, l_part, f16, early,
                                                         page_late)
    bsz = q.shape[0]
    _mla_decode_f8r[(splits, bsz)](*args, **kw, num_warps=4)
    if splits > 1:
        from lab.gluon_mla_decode import _merge
        rows = kw["ROWS"]
        _merge[(-(-rows // 16), bsz)](part_o, part_lse, out, lse, ROWS=rows, NUM_SPLITS=splits, BLOCK_R=16, DV_=DV,
                                      num_warps=4)
    return out, lse


def compile_for(hq=16, sq=1, page=64, num_splits=1, causal=True, per_token=True, l_part=False, f16=False,
                early=False, page_late=False):
    """Build the kernel for sm_90 without a GPU (triton's bundled ptxas); returns the CompiledKernel."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    q = torch.empty((2, hq, sq, D), dtype=torch.bfloat16)
    cache = torch.empty((8, page, 1, D), dtype=torch.float8_e4m3fn)
    table = torch.zeros((2, 4), dtype=torch.int32)
    lens = torch.zeros((2, ), dtype=torch.int32)
    ks = torch.ones((8, page, 1), dtype=torch.float32) if per_token else 0.5
    args, kw, *_ = _args(q, cache, table, lens, 0.1, ks, num_splits, causal, l_part=l_part, f16=f16, early=early,
                         page_late=page_late)
    names = list(_mla_decode_f8r.arg_names)[:len(args)]
    signature = {n: mangle_type(a) for n, a in zip(names, args)}
    signature.update({n: "constexpr" for n in kw})
    attrs = {(i, ): [["tt.divisibility", 16]] for i, n in enumerate(names) if signature[n].startswith("*")}
    src = GluonASTSource(fn=_mla_decode_f8r, signature=signature, constexprs=kw, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


class Module:
    """The decode contract's two entries over mla_decode_f8r (scripts/gpu_fp8lat_s11.py)."""

    def __init__(self, causal=True, per_sm=2, l_part=False, f16=False, early=False, page_late=False):
        self.causal, self.per_sm = causal, per_sm
        self.kw = dict(l_part=l_part, f16=f16, early=early, page_late=page_late)

    def forward(self, q, k, v, *, block_table, seqlens_k, scale, k_scale):
        assert v is None
        return mla_decode_f8r(q, k, block_table, seqlens_k, scale, k_scale, None, self.causal, self.per_sm,
                              **self.kw)

    def forward_split(self, q, k, v, *, num_splits, block_table, seqlens_k, scale, k_scale):
        assert v is None
        return mla_decode_f8r(q, k, block_table, seqlens_k, scale, k_scale, num_splits, self.causal, **self.kw)
