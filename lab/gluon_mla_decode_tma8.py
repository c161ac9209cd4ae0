"""Lab (not the product): the MLA absorbed decode over an fp8 e4m3 latent cache, its bytes TMA-staged in a ring
of STAGES blocks (tenth session; issue 27: >= 90% of copy counted in the fp8 bytes read at Hq 16 Sq 1).

q [B, Hq, Sq, 576] bf16, cache [num_pages, PAGE, 1, 576] float8_e4m3fn (PAGE a multiple of 64), one scale a token
(float32 [num_pages, PAGE, 1]) or one a tensor (a float), block_table int32 [B, width], seqlens_k int32 [B];
out [B, Hq, Sq, 512] bf16, lse [B, Hq, Sq] (natural log). Causal as fagen's decode contract.

[Note] Lab fp8 TMA ring. The ninth session's lab kernel (lab/gluon_mla_decode_fp8.py, [Note] Lab fp8 swap-AB) kept
one 36 KB block in flight a CTA (the next block's words in registers) and read 46-70% of copy; one CTA an SM read
37-46%. Here a block's fp8 bytes (64 rows x 576 B: four [64, 32] int32 boxes and a [64, 16] one) go by TMA into
one of STAGES ring slots, issued STAGES blocks ahead, so 2-3 blocks (72-108 KB) are in flight an SM whatever the
warps do. Per block j:
  - wait slot j's mbarrier; its words go from shared memory into registers (16-byte loads) and are converted to
    bf16 (the decode template's exact integer asm) while P_{j-1} V_{j-1} still runs; rows past the sequence end
    become zero words (a page holds anything there, NaN included);
  - wait P_{j-1} V_{j-1} (the bf16 tiles are free); store the bf16 tiles (int32 views, [Note] Lab fp8 words);
    fence, CTA barrier: slot j's bytes are all read, so block j + STAGES's TMA goes into it (its page loaded a
    block before: [Note] Lab page prefetch);
  - S^T = K Q^T (wgmma: M the 64 keys, N the NQ query rows), softmax down S^T's columns, the per-token scale on
    S^T's rows and on P's, P^T to shared memory; O^T += V^T P^T issued asynchronously (four [128, NQ]
    accumulators, V^T the same bf16 tiles read transposed).
WARPS 8 (two warpgroups, one CTA an SM): the conversion is split across 8 warps (half the instructions a warp of
the 4-warp kernel); S^T's wgmma is warps [4, 2] (each warpgroup 64 keys x NQ/2 rows: the softmax stays inside a
warpgroup). [Note] Lab O split: O^T's accumulators are warps [4, 2] under O_SPLIT_N (each warpgroup all 512 latent
rows of its NQ/2 query rows: V^T read from shared memory by both) or [8, 1] (each warpgroup 64 of a 128-row
accumulator's rows, V^T read once; sm_90 ptxas then serialises every wgmma, C7515, whatever the order of the
accumulators' rescale). WARPS 4: one warpgroup.
Shared memory: STAGES x 36 KB ring + 72 KB bf16 tiles + Q (NQ x 1152 B) + P: STAGES 3, NQ 16: 200 KB.
Rows beyond NQ (Hq x Sq of 32 to 256) take more CTAs (grid axis 2), each converting the same block.
Splits: whole blocks, about one wave of CTAs; the lab merge of lab/gluon_mla_decode.py.
"""
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, \
    warpgroup_mma_init, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

D, DV, DR = 576, 512, 64
D_K, DV_K = gl.constexpr(576), gl.constexpr(512)
BLOCK_N = 64
MAX_SPLITS = 32


@gluon.constexpr_function
def _mma(n, wm, wn):
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[wm, wn], instr_shape=[16, n // wn, 16])


@gluon.jit
def _cvt(x):
    """Four fp8 e4m3 bytes in an int32 word as two words of bf16 pairs (bytes 0, 1 and bytes 2, 3), exactly ([Note]
    fp8 conversion in fagen/templates/triton/decode.py.j2)."""
    return gl.inline_asm_elementwise(
        asm="""{
        .reg .b32 a, b, c, d, s, z;
        prmt.b32 a, $2, 0, 0x1404;
        prmt.b32 b, $2, 0, 0x3424;
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
        fma.rn.bf16x2 $0, c, s, z;
        fma.rn.bf16x2 $1, d, s, z;
        }""",
        constraints="=r,=r,r", args=[x], dtype=(gl.int32, gl.int32), is_pure=True, pack=1)


@gluon.jit
def _cvt16(x):
    """Four fp8 e4m3 bytes in an int32 word as two words of fp16 pairs, exactly: the hardware's cvt, two values an
    instruction."""
    return gl.inline_asm_elementwise(
        asm="""{
        .reg .b16 l, h;
        mov.b32 {l, h}, $2;
        cvt.rn.f16x2.e4m3x2 $0, l;
        cvt.rn.f16x2.e4m3x2 $1, h;
        }""",
        constraints="=r,=r,r", args=[x], dtype=(gl.int32, gl.int32), is_pure=True, pack=1)


@gluon.jit
def _pow2_scale(m):
    """The power of two c with m c in [2^14, 2^15), 1 where m < 2^-102 or not finite ([Note] fp16 dots in
    fagen/templates/triton/decode.py.j2)."""
    e = (m.to(gl.int32, bitcast=True) & 0x7F800000) >> 23
    return gl.where((e > 24) & (e < 255), ((268 - e) << 23).to(gl.float32, bitcast=True), 1.0)


@gluon.jit
def _words(src, ok, layout: gl.constexpr, F16: gl.constexpr):
    """An int32 ring box [64, W] into registers, zero in rows not ok, as bf16 (fp16 under F16) words [64, 2 W]."""
    x = src.load(layout)
    x = gl.where(ok, x, gl.zeros_like(x))
    if F16:
        lo, hi = _cvt16(x)
    else:
        lo, hi = _cvt(x)
    return gl.join(lo, hi)


@gluon.jit
def _issue(kc8, kr8, ring0, ring1, ring2, ring3, ring_r, bar, page, start, st, PAGE: gl.constexpr):
    """TMA of the fp8 bytes of the 64 keys from `start` (on `page`) into ring slot st: four [64, 32] int32 boxes of
    the latent and the [64, 16] rope box."""
    row = page * PAGE + start % PAGE
    mbarrier.expect(bar.index(st), 4 * kc8.block_type.nbytes + kr8.block_type.nbytes)
    tma.async_copy_global_to_shared(kc8, [row, 0], bar.index(st), ring0.index(st))
    tma.async_copy_global_to_shared(kc8, [row, 32], bar.index(st), ring1.index(st))
    tma.async_copy_global_to_shared(kc8, [row, 64], bar.index(st), ring2.index(st))
    tma.async_copy_global_to_shared(kc8, [row, 96], bar.index(st), ring3.index(st))
    tma.async_copy_global_to_shared(kr8, [row, 128], bar.index(st), ring_r.index(st))


@gluon.jit
def _page(BlockTable, bt_row, start, num_pages, ok, PAGE: gl.constexpr):
    page = gl.load(BlockTable + bt_row + start // PAGE, mask=ok, other=0)
    return gl.minimum(gl.maximum(page, 0), num_pages - 1)  # as the product's [Note] Gluon decode memory safety


@gluon.jit(do_not_specialize=["stride_bt", "bt_width", "num_pages", "num_splits", "per"])
def _mla_decode_tma8(Q, kc8, kr8, KTok, BlockTable, Seqlens, Out, Lse, PartO, PartLse, stride_bt, bt_width,
                     num_pages, qk_scale, v_mul, num_splits, per, ROWS: gl.constexpr, NQ: gl.constexpr,
                     SQ: gl.constexpr, PAGE: gl.constexpr, CAUSAL: gl.constexpr, DIRECT: gl.constexpr,
                     PER_TOKEN: gl.constexpr, STAGES: gl.constexpr, WARPS: gl.constexpr,
                     O_SPLIT_N: gl.constexpr, F16: gl.constexpr, S_ACCS: gl.constexpr):
    gl.static_assert(PAGE % 64 == 0)
    gl.static_assert(NQ % 16 == 0)
    split = gl.program_id(0)
    b = gl.program_id(1)
    r0 = gl.program_id(2) * NQ  # this CTA's first query row of the sequence's ROWS
    WN: gl.constexpr = 2 if WARPS == 8 else 1
    s_layout: gl.constexpr = _mma(NQ, 4, WN)
    o_layout: gl.constexpr = _mma(NQ, 4, WN) if O_SPLIT_N else _mma(NQ, WARPS, 1)  # [Note] Lab O split
    kcol: gl.constexpr = gl.SliceLayout(1, s_layout)
    qcol: gl.constexpr = gl.SliceLayout(0, s_layout)
    dt: gl.constexpr = gl.float16 if F16 else gl.bfloat16  # [Note] Lab fp16 dots in lab/gluon_mla_decode_fp8.py
    k_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 128], dt)
    r_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 64], dt)
    q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([NQ, 128], dt)
    qr_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([NQ, 64], dt)
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, NQ], dt)
    # [Note] Lab separate buffers: each ring part and each bf16 tile its own allocation (the membar pass put a CTA
    # barrier before each TMA issue and each tile store into one multi-buffer allocation: 9 of 16 a step)
    ring0 = gl.allocate_shared_memory(gl.int32, [STAGES, 64, 32], kc8.layout)
    ring1 = gl.allocate_shared_memory(gl.int32, [STAGES, 64, 32], kc8.layout)
    ring2 = gl.allocate_shared_memory(gl.int32, [STAGES, 64, 32], kc8.layout)
    ring3 = gl.allocate_shared_memory(gl.int32, [STAGES, 64, 32], kc8.layout)
    ring_r = gl.allocate_shared_memory(gl.int32, [STAGES, 64, 16], kr8.layout)
    kc0 = gl.allocate_shared_memory(dt, [1, 64, 128], k_sl)
    kc1 = gl.allocate_shared_memory(dt, [1, 64, 128], k_sl)
    kc2 = gl.allocate_shared_memory(dt, [1, 64, 128], k_sl)
    kc3 = gl.allocate_shared_memory(dt, [1, 64, 128], k_sl)
    kr_s = gl.allocate_shared_memory(dt, [1, 64, 64], r_sl)
    wl: gl.constexpr = gl.NVMMASharedLayout(128, 32, rank=2)  # [Note] Lab fp8 words
    kw0 = kc0._reinterpret(gl.int32, [1, 64, 64], wl)
    kw1 = kc1._reinterpret(gl.int32, [1, 64, 64], wl)
    kw2 = kc2._reinterpret(gl.int32, [1, 64, 64], wl)
    kw3 = kc3._reinterpret(gl.int32, [1, 64, 64], wl)
    kr_w = kr_s._reinterpret(gl.int32, [1, 64, 32], wl)
    qc_s = gl.allocate_shared_memory(dt, [4, NQ, 128], q_sl)
    qr_s = gl.allocate_shared_memory(dt, [1, NQ, 64], qr_sl)
    p_s = gl.allocate_shared_memory(dt, [1, 64, NQ], p_sl)
    bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bar.index(i), count=1)

    seq_len = gl.minimum(gl.maximum(gl.load(Seqlens + b), 0), bt_width * PAGE)  # memory safety, as the product
    n_all = (seq_len + 63) // 64
    j_lo = gl.minimum(split * per, n_all)
    n_blocks = gl.minimum(n_all - j_lo, per)
    k_lo = j_lo * 64
    bt_row = b.to(gl.int64) * stride_bt
    fence_async_shared()
    gl.thread_barrier()
    pages = _page(BlockTable, bt_row, k_lo, num_pages, n_blocks > 0, PAGE)
    for i in gl.static_range(STAGES):  # the first STAGES blocks, at once
        if i < n_blocks:
            _issue(kc8, kr8, ring0, ring1, ring2, ring3, ring_r, bar, pages, k_lo + i * 64, i, PAGE)
        pages = _page(BlockTable, bt_row, k_lo + (i + 1) * 64, num_pages, i + 1 < n_blocks, PAGE)
    # pages: the page of block STAGES ([Note] Lab page prefetch)

    lq: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [WARPS, 1], [1, 0])
    qn = gl.arange(0, NQ, layout=gl.SliceLayout(1, lq))
    qc = gl.arange(0, 128, layout=gl.SliceLayout(0, lq))
    qok = (r0 + qn < ROWS)[:, None]
    qbase = Q + (b * ROWS + r0 + qn).to(gl.int64)[:, None] * D_K + qc[None, :]
    q0 = gl.load(qbase, mask=qok, other=0.0)
    q1 = gl.load(qbase + 128, mask=qok, other=0.0)
    q2 = gl.load(qbase + 256, mask=qok, other=0.0)
    q3 = gl.load(qbase + 384, mask=qok, other=0.0)
    lqr: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])
    qn2 = gl.arange(0, NQ, layout=gl.SliceLayout(1, lqr))
    qc2 = gl.arange(0, 64, layout=gl.SliceLayout(0, lqr))
    qr = gl.load(Q + (b * ROWS + r0 + qn2).to(gl.int64)[:, None] * D_K + DV_K + qc2[None, :],
                 mask=(r0 + qn2 < ROWS)[:, None], other=0.0)
    if F16:  # q c_q in fp16, 1/c_q into the score scale (c_q a power of two: [Note] Lab fp16 dots)
        amax = gl.max(gl.max(gl.abs(qr.to(gl.float32)), 1), 0)
        amax = gl.maximum(amax, gl.max(gl.max(gl.abs(q0.to(gl.float32)), 1), 0))
        amax = gl.maximum(amax, gl.max(gl.max(gl.abs(q1.to(gl.float32)), 1), 0))
        amax = gl.maximum(amax, gl.max(gl.max(gl.abs(q2.to(gl.float32)), 1), 0))
        amax = gl.maximum(amax, gl.max(gl.max(gl.abs(q3.to(gl.float32)), 1), 0))
        cq = _pow2_scale(amax)
        qk_scale = qk_scale / cq
        qc_s.index(0).store((q0.to(gl.float32) * cq).to(dt))
        qc_s.index(1).store((q1.to(gl.float32) * cq).to(dt))
        qc_s.index(2).store((q2.to(gl.float32) * cq).to(dt))
        qc_s.index(3).store((q3.to(gl.float32) * cq).to(dt))
        qr_s.index(0).store((qr.to(gl.float32) * cq).to(dt))
    else:
        qc_s.index(0).store(q0)
        qc_s.index(1).store(q1)
        qc_s.index(2).store(q2)
        qc_s.index(3).store(q3)
        qr_s.index(0).store(qr)

    n = gl.arange(0, NQ, layout=qcol)
    if CAUSAL:
        lim = seq_len - SQ + (r0 + n) % SQ
    else:
        lim = gl.full([NQ], 0, gl.int32, qcol) + (seq_len - 1)
    m_i = gl.full([NQ], float("-inf"), gl.float32, qcol)
    l_i = gl.zeros([NQ], gl.float32, qcol)
    c_prev = gl.max(gl.full([NQ], 1.0, gl.float32, qcol), 0)  # P's scale ([Note] Lab fp16 dots); 1 in bf16
    if F16:
        if not PER_TOKEN:
            c_prev = c_prev * 16384.0
    o0 = gl.zeros([128, NQ], gl.float32, o_layout)
    o1 = gl.zeros([128, NQ], gl.float32, o_layout)
    o2 = gl.zeros([128, NQ], gl.float32, o_layout)
    o3 = gl.zeros([128, NQ], gl.float32, o_layout)
    t0 = warpgroup_mma_init(o0)
    t1 = warpgroup_mma_init(o1)
    t2 = warpgroup_mma_init(o2)
    t3 = warpgroup_mma_init(o3)
    keys0 = gl.arange(0, 64, layout=kcol)
    if PER_TOKEN:  # the per-token scales one block ahead in registers, their page two ([Note] Lab page prefetch)
        pg_s = _page(BlockTable, bt_row, k_lo, num_pages, n_blocks > 0, PAGE)
        ks = gl.load(KTok + pg_s.to(gl.int64) * PAGE + k_lo % PAGE + keys0, mask=k_lo + keys0 < seq_len, other=0.0)
        pg_s = _page(BlockTable, bt_row, k_lo + 64, num_pages, n_blocks > 1, PAGE)
    ld: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [WARPS, 1], [1, 0])  # 16 B a thread, 128 B rows
    ldr: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [WARPS, 1], [1, 0])  # 64 B rows
    rc = gl.arange(0, 64, layout=gl.SliceLayout(1, ld))
    rr = gl.arange(0, 64, layout=gl.SliceLayout(1, ldr))
    fence_async_shared()
    gl.thread_barrier()
    for j in range(n_blocks):
        st = j % STAGES
        start = k_lo + j * 64
        if PER_TOKEN:  # block j's scales (masked past the sequence end); block j + 1's loads now
            ks_j = ks
            nxt = start + 64
            ks = gl.load(KTok + pg_s.to(gl.int64) * PAGE + nxt % PAGE + keys0,
                         mask=(nxt + keys0 < seq_len) & (j + 1 < n_blocks), other=0.0)
            pg_s = _page(BlockTable, bt_row, nxt + 64, num_pages, j + 2 < n_blocks, PAGE)
        mbarrier.wait(bar.index(st), (j // STAGES) & 1)
        okc = (start + rc < seq_len)[:, None]
        okr = (start + rr < seq_len)[:, None]
        w0 = _words(ring0.index(st), okc, ld, F16)
        w1 = _words(ring1.index(st), okc, ld, F16)
        w2 = _words(ring2.index(st), okc, ld, F16)
        w3 = _words(ring3.index(st), okc, ld, F16)
        wr = _words(ring_r.index(st), okr, ldr, F16)
        o0, o1, o2, o3 = warpgroup_mma_wait(0, deps=(t0, t1, t2, t3))  # P_{j-1} V_{j-1}: the tiles are free
        kw0.index(0).store(gl.reshape(w0, [64, 64]))
        kw1.index(0).store(gl.reshape(w1, [64, 64]))
        kw2.index(0).store(gl.reshape(w2, [64, 64]))
        kw3.index(0).store(gl.reshape(w3, [64, 64]))
        kr_w.index(0).store(gl.reshape(wr, [64, 32]))
        fence_async_shared()
        gl.thread_barrier()
        if j + STAGES < n_blocks:  # slot st is read: block j + STAGES into it
            _issue(kc8, kr8, ring0, ring1, ring2, ring3, ring_r, bar, pages, start + STAGES * 64, st, PAGE)
            pages = _page(BlockTable, bt_row, start + (STAGES + 1) * 64, num_pages, j + STAGES + 1 < n_blocks, PAGE)
        z = j >> 30  # a 0 the compiler cannot fold ([Note] Seesaw descriptors)
        if S_ACCS == 2:  # [Note] Lab two score chains: rope + latent 0, 1 and latent 2, 3, summed after the wait
            tok = warpgroup_mma(kr_s.index(z), qr_s.index(z).permute((1, 0)),
                                gl.zeros([64, NQ], gl.float32, s_layout), use_acc=False, is_async=True)
            tok2 = warpgroup_mma(kc2.index(z), qc_s.index(2 + z).permute((1, 0)),
                                 gl.zeros([64, NQ], gl.float32, s_layout), use_acc=False, is_async=True)
            tok = warpgroup_mma(kc0.index(z), qc_s.index(0 + z).permute((1, 0)), tok, is_async=True)
            tok2 = warpgroup_mma(kc3.index(z), qc_s.index(3 + z).permute((1, 0)), tok2, is_async=True)
            tok = warpgroup_mma(kc1.index(z), qc_s.index(1 + z).permute((1, 0)), tok, is_async=True)
            s, s2 = warpgroup_mma_wait(0, deps=(tok, tok2))
            s = s + s2
        else:
            tok = warpgroup_mma(kr_s.index(z), qr_s.index(z).permute((1, 0)),
                                gl.zeros([64, NQ], gl.float32, s_layout), use_acc=False, is_async=True)
            tok = warpgroup_mma(kc0.index(z), qc_s.index(0 + z).permute((1, 0)), tok, is_async=True)
            tok = warpgroup_mma(kc1.index(z), qc_s.index(1 + z).permute((1, 0)), tok, is_async=True)
            tok = warpgroup_mma(kc2.index(z), qc_s.index(2 + z).permute((1, 0)), tok, is_async=True)
            tok = warpgroup_mma(kc3.index(z), qc_s.index(3 + z).permute((1, 0)), tok, is_async=True)
            s = warpgroup_mma_wait(0, deps=(tok, ))
        keys = start + keys0
        s = s * qk_scale
        if PER_TOKEN:
            s = s * ks_j[:, None]
        s = gl.where(keys[:, None] <= lim[None, :], s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 0))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(s - m_use[None, :])
        l_i = l_i * alpha + gl.sum(p, 0)
        m_i = m_new
        if F16:
            if PER_TOKEN:  # P ks c_j; the accumulators' old terms move from c_{j-1} to c_j
                c_new = _pow2_scale(gl.max(ks_j, 0))
                alpha = alpha * (c_new / c_prev)
                p = p * (ks_j * c_new)[:, None]
                c_prev = c_new
            else:
                p = p * 16384.0
        elif PER_TOKEN:
            p = p * ks_j[:, None]  # V's per-token scale on P's rows (keys)
        p_s.index(0).store(p.to(dt))
        fence_async_shared()
        gl.thread_barrier()
        a = gl.convert_layout(alpha, gl.SliceLayout(0, o_layout))[None, :]
        o0 = o0 * a  # every accumulator rescaled before the first P V wgmma (no register def inside the group)
        o1 = o1 * a
        o2 = o2 * a
        o3 = o3 * a
        t0 = warpgroup_mma(kc0.index(z).permute((1, 0)), p_s.index(z), o0, is_async=True)
        t1 = warpgroup_mma(kc1.index(z).permute((1, 0)), p_s.index(z), o1, is_async=True)
        t2 = warpgroup_mma(kc2.index(z).permute((1, 0)), p_s.index(z), o2, is_async=True)
        t3 = warpgroup_mma(kc3.index(z).permute((1, 0)), p_s.index(z), o3, is_async=True)
    o0, o1, o2, o3 = warpgroup_mma_wait(0, deps=(t0, t1, t2, t3))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bar.index(i))

    l_safe = gl.where(l_i == 0.0, 1.0, l_i)
    inv = gl.convert_layout(v_mul / (l_safe * c_prev), gl.SliceLayout(0, o_layout))[None, :]
    m_fin = gl.where(m_i == float("-inf"), 0.0, m_i)
    lse2 = gl.where(l_i == 0.0, float("-inf"), m_fin + gl.log2(l_safe))
    on = gl.arange(0, NQ, layout=gl.SliceLayout(0, o_layout))
    om = gl.arange(0, 128, layout=gl.SliceLayout(1, o_layout))
    real = (r0 + on < ROWS)[None, :] & (om < 128)[:, None]
    if DIRECT:
        base = Out + (b * ROWS + r0 + on).to(gl.int64)[None, :] * DV_K + om[:, None]
        gl.store(base, (o0 * inv).to(gl.bfloat16), mask=real)
        gl.store(base + 128, (o1 * inv).to(gl.bfloat16), mask=real)
        gl.store(base + 256, (o2 * inv).to(gl.bfloat16), mask=real)
        gl.store(base + 384, (o3 * inv).to(gl.bfloat16), mask=real)
        gl.store(Lse + b * ROWS + r0 + n, lse2 * 0.6931471805599453, mask=r0 + n < ROWS)
    else:
        prow = (b * num_splits + split) * ROWS + r0
        base = PartO + (prow + on).to(gl.int64)[None, :] * DV_K + om[:, None]
        gl.store(base, o0 * inv, mask=real)
        gl.store(base + 128, o1 * inv, mask=real)
        gl.store(base + 256, o2 * inv, mask=real)
        gl.store(base + 384, o3 * inv, mask=real)
        gl.store(PartLse + prow + n, lse2, mask=r0 + n < ROWS)


def splits_for(batch, span, ctas_per_seq, sms=132, num_splits=None):
    """(per, splits): key blocks per split and the split count; by default about one wave (one CTA an SM)."""
    blocks = max(1, -(-span // BLOCK_N))
    if num_splits is None:
        num_splits = max(1, min(MAX_SPLITS, sms // max(batch * ctas_per_seq, 1)))
    per = -(-blocks // num_splits)
    return per, -(-blocks // per)


def _descs(cache):
    w = cache.view(torch.int32).view(-1, D // 4)  # a cache row: 144 int32 words

    def desc(cols):
        layout = gl.NVMMASharedLayout.get_default_for([64, cols], gl.int32)
        return TensorDescriptor(w, list(w.shape), list(w.stride()), [64, cols], layout)
    return desc(32), desc(16)


def _args(q, cache, block_table, seqlens_k, scale, k_scale, num_splits, causal, sms=132, nq=16, stages=3, warps=8,
          o_split_n=True, f16=False, s_accs=1):
    bsz, hq, sq, d = q.shape
    rows = hq * sq
    assert d == D and cache.shape[-1] == D and cache.shape[2] == 1 and cache.shape[1] % 64 == 0
    nq = min(nq, max(16, -(-rows // 16) * 16))
    tiles = -(-rows // nq)
    page = cache.shape[1]
    per, splits = splits_for(bsz, block_table.shape[1] * page, tiles, sms, num_splits)
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
    kc8, kr8 = _descs(cache)
    args = (q, kc8, kr8, ktok, block_table, seqlens_k, out, lse, part_o, part_lse, block_table.stride(0),
            block_table.shape[1], cache.shape[0], scale * 1.4426950408889634 * mul, mul, splits, per)
    kw = dict(ROWS=rows, NQ=nq, SQ=sq, PAGE=page, CAUSAL=causal, DIRECT=direct, PER_TOKEN=per_token, STAGES=stages,
              WARPS=warps, O_SPLIT_N=o_split_n and warps == 8, F16=f16,
              S_ACCS=s_accs)
    return args, kw, out, lse, part_o, part_lse, (splits, bsz, tiles)


_SMS = {}


def mla_decode_tma8(q, cache, block_table, seqlens_k, scale, k_scale, num_splits=None, causal=True, nq=16, stages=3,
                    warps=8, o_split_n=True, f16=False, s_accs=1):
    """out [B, Hq, Sq, 512], lse [B, Hq, Sq]; q contiguous bf16, cache [num_pages, PAGE, 1, 576] float8_e4m3fn
    contiguous, k_scale a float or float32 [num_pages, PAGE, 1] contiguous."""
    assert q.is_contiguous() and cache.is_contiguous() and q.dtype == torch.bfloat16
    assert cache.dtype == torch.float8_e4m3fn
    dev = q.device.index or 0
    if dev not in _SMS:
        _SMS[dev] = torch.cuda.get_device_properties(q.device).multi_processor_count
    args, kw, out, lse, part_o, part_lse, grid = _args(q, cache, block_table, seqlens_k, scale, k_scale, num_splits,
                                                       causal, _SMS[dev], nq, stages, warps, o_split_n, f16,
                                                       s_accs)
    _mla_decode_tma8[grid](*args, **kw, num_warps=warps)
    splits, bsz = grid[0], grid[1]
    if splits > 1:
        from lab.gluon_mla_decode import _merge
        rows = kw["ROWS"]
        _merge[(-(-rows // 16), bsz)](part_o, part_lse, out, lse, ROWS=rows, NUM_SPLITS=splits, BLOCK_R=16, DV_=DV,
                                      num_warps=4)
    return out, lse


def compile_for(hq=16, sq=1, page=64, num_splits=1, causal=True, per_token=True, nq=16, stages=3, warps=8,
                o_split_n=True, f16=False, s_accs=1):
    """Build the kernel for sm_90 without a GPU (triton's bundled ptxas); returns the CompiledKernel."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    q = torch.empty((2, hq, sq, D), dtype=torch.bfloat16)
    cache = torch.empty((8, page, 1, D), dtype=torch.float8_e4m3fn)
    table = torch.zeros((2, 4), dtype=torch.int32)
    lens = torch.zeros((2, ), dtype=torch.int32)
    ks = torch.ones((8, page, 1), dtype=torch.float32) if per_token else 0.5
    args, kw, *_ = _args(q, cache, table, lens, 0.1, ks, num_splits, causal, nq=nq, stages=stages, warps=warps,
                         o_split_n=o_split_n, f16=f16, s_accs=s_accs)
    names = list(_mla_decode_tma8.arg_names)[:len(args)]
    signature = {n: mangle_type(a) for n, a in zip(names, args)}
    signature.update({n: "constexpr" for n in kw})
    attrs = {(i, ): [["tt.divisibility", 16]] for i, n in enumerate(names) if signature[n].startswith("*")}
    src = GluonASTSource(fn=_mla_decode_tma8, signature=signature, constexprs=kw, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


class Module:
    """The decode contract's two entries over mla_decode_tma8 (for scripts/gpu_mladec_s10.py)."""

    def __init__(self, causal=True, nq=16, stages=3, warps=8, o_split_n=True, f16=False, s_accs=1):
        self.causal, self.nq, self.stages, self.warps = causal, nq, stages, warps
        self.o_split_n, self.f16, self.s_accs = o_split_n, f16, s_accs

    def forward(self, q, k, v, *, block_table, seqlens_k, scale, k_scale):
        assert v is None
        return mla_decode_tma8(q, k, block_table, seqlens_k, scale, k_scale, None, self.causal, self.nq,
                               self.stages, self.warps, self.o_split_n, self.f16, self.s_accs)

    def forward_split(self, q, k, v, *, num_splits, block_table, seqlens_k, scale, k_scale):
        assert v is None
        return mla_decode_tma8(q, k, block_table, seqlens_k, scale, k_scale, num_splits, self.causal, self.nq,
                               self.stages, self.warps, self.o_split_n, self.f16, self.s_accs)
