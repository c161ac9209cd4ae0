"""Lab (not the product): the MLA absorbed decode over an fp8 e4m3 latent cache for the memory-bound shapes
(Hq x Sq of 16 to 64 rows: MLA's Hq 16, Sq 1), sm_90, Gluon. Ninth session (issue 27 part 2: >= 95% of copy
bandwidth counted in the bytes read; the Triton decode reads it at 39-44%).

q [B, Hq, Sq, 576] bf16, cache [num_pages, PAGE, 1, 576] float8_e4m3fn (PAGE a multiple of 64), one scale a token
(float32 [num_pages, PAGE, 1]) or one a tensor (a float), block_table int32 [B, width], seqlens_k int32 [B];
out [B, Hq, Sq, 512] bf16, lse [B, Hq, Sq] (natural log). Causal as fagen's decode contract.

[Note] Lab fp8 swap-AB. Why the Triton decode reads an fp8 latent at under half of copy: its 16-row tile runs
mma.sync, and a 32-key step costs about the same time with an fp8 tile as with a bf16 one (sm_90 SASS of the
unmasked loop, m16n32w4s3: 833 instructions a step against 806 for bf16: the conversion adds 74 F2FP, 16 STS.128
and 17 LDS, the fp8 tile saves 6 LDGSTS), while it holds half the bytes. The step is a chain: the converted tile's
store and a CTA barrier, the scores' 36 dependent HMMA (each warp one 8-key column of S over 576 columns), a
softmax whose row max and sum cross the 4 warps (7 BAR.SYNC a step), P to shared memory, then P V; two programs
an SM (255 registers, 90 KB) overlap two such chains. bf16 streams at copy speed with that chain; fp8 needs twice
the steps a second. Here, per 64-key block:
  - the fp8 block (one page's 64 rows, 36 KB) comes by plain 16-byte loads into registers one block ahead (no
    shared-memory staging for the bytes), is converted to bf16 (the decode template's exact integer asm, [Note]
    fp8 conversion) and stored once into shared memory as four [64, 128] latent tiles and the [64, 64] rope tile;
  - scores transposed, S^T [64 keys, NQ] = K Q^T (wgmma M = the 64 keys, N = NQ, the 16 query rows: no padding,
    A = the converted tiles, B = Q from shared memory), one warpgroup;
  - softmax down the columns (a query row is a column of S^T), the per-token scale on S^T's rows and on P's;
  - O^T [512, NQ] += V^T P^T (A = the same latent tiles read transposed, B = P^T from shared memory), four
    accumulators of [128, NQ] (64 registers a thread in all).
One warpgroup a CTA, 92 KB of shared memory: two CTAs an SM, each converting while the other's wgmma run.
Splits: whole blocks; the lab merge of lab/gluon_mla_decode.py.
"""
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, \
    warpgroup_mma_init, warpgroup_mma_wait

D, DV, DR = 576, 512, 64
D_K, DV_K = gl.constexpr(576), gl.constexpr(512)  # the same, as the kernels read them
W_ROW = gl.constexpr(144)  # int32 words a cache row (576 fp8 bytes)
BLOCK_N = 64
MAX_SPLITS = 32


@gluon.constexpr_function
def _mma(n):
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


@gluon.jit
def _cvt(x):
    """Four fp8 e4m3 bytes in an int32 word as two words of bf16 pairs (bytes 0, 1 and bytes 2, 3), exactly: the
    decode template's integer asm ([Note] fp8 conversion in fagen/templates/triton/decode.py.j2)."""
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
    instruction (as Triton's x.to(tl.float16) emits it)."""
    return gl.inline_asm_elementwise(
        asm="""{
        .reg .b16 l, h;
        mov.b32 {l, h}, $2;
        cvt.rn.f16x2.e4m3x2 $0, l;
        cvt.rn.f16x2.e4m3x2 $1, h;
        }""",
        constraints="=r,=r,r", args=[x], dtype=(gl.int32, gl.int32), is_pure=True, pack=1)


@gluon.jit
def _stage(dst, x, ROWS_: gl.constexpr, WORDS: gl.constexpr, F16: gl.constexpr):
    """Words of fp8 bytes [ROWS_, WORDS] as bf16 (fp16 under F16) words [ROWS_, 2 WORDS] into an int32 view of the
    tile ([Note] Lab fp8 words)."""
    if F16:
        lo, hi = _cvt16(x)
    else:
        lo, hi = _cvt(x)
    dst.store(gl.reshape(gl.join(lo, hi), [ROWS_, 2 * WORDS]))


@gluon.jit
def _pow2_scale(m):
    """The power of two c with m c in [2^14, 2^15) (fp16's range with room), 1 where m < 2^-102 or not finite
    ([Note] fp16 dots in fagen/templates/triton/decode.py.j2)."""
    e = (m.to(gl.int32, bitcast=True) & 0x7F800000) >> 23
    return gl.where((e > 24) & (e < 255), ((268 - e) << 23).to(gl.float32, bitcast=True), 1.0)


@gluon.jit
def _page(BlockTable, bt_row, start, num_pages, ok_block, PAGE: gl.constexpr):
    """The page holding key `start` (0 when not ok_block), clamped to the cache ([Note] Gluon decode memory safety
    in the product template). [Note] Lab page prefetch: loaded a step before the block's bytes, so that the table
    read and the bytes it addresses are not a chain of two loads in one step (round A, 2026-11-27: with the chain,
    one CTA an SM streamed a 36 KB block in ~3.3 us, about two DRAM latencies)."""
    page = gl.load(BlockTable + bt_row + start // PAGE, mask=ok_block, other=0)
    return gl.minimum(gl.maximum(page, 0), num_pages - 1)


@gluon.jit
def _fetch(Cache, page, start, seq_len, ok_block, PAGE: gl.constexpr):
    """The fp8 bytes of the 64 keys from `start` (one page's rows, on `page`) as int32 words: four latent [64, 32]
    tiles (128 bytes a row each) and the rope [64, 16], zeros past seq_len or when not ok_block."""
    ld: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
    ldr: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0])
    row0 = page.to(gl.int64) * PAGE + start % PAGE
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, ld))
    c = gl.arange(0, 32, layout=gl.SliceLayout(0, ld))
    ok = ((start + r < seq_len) & ok_block)[:, None]
    base = Cache + (row0 + r.to(gl.int64))[:, None] * W_ROW + c[None, :]
    x0 = gl.load(base, mask=ok, other=0)
    x1 = gl.load(base + 32, mask=ok, other=0)
    x2 = gl.load(base + 64, mask=ok, other=0)
    x3 = gl.load(base + 96, mask=ok, other=0)
    rr = gl.arange(0, 64, layout=gl.SliceLayout(1, ldr))
    cr = gl.arange(0, 16, layout=gl.SliceLayout(0, ldr))
    okr = ((start + rr < seq_len) & ok_block)[:, None]
    xr = gl.load(Cache + (row0 + rr.to(gl.int64))[:, None] * W_ROW + 128 + cr[None, :], mask=okr, other=0)
    return x0, x1, x2, x3, xr, row0


@gluon.jit(do_not_specialize=["stride_bt", "bt_width", "num_pages", "num_splits", "per"])
def _mla_decode_fp8(Q, Cache, KTok, BlockTable, Seqlens, Out, Lse, PartO, PartLse, stride_bt, bt_width, num_pages,
                    qk_scale, v_mul, num_splits, per, ROWS: gl.constexpr, NQ: gl.constexpr, SQ: gl.constexpr,
                    PAGE: gl.constexpr, CAUSAL: gl.constexpr, DIRECT: gl.constexpr, PER_TOKEN: gl.constexpr,
                    F16: gl.constexpr, S_ACCS: gl.constexpr = 1):
    gl.static_assert(PAGE % 64 == 0)
    gl.static_assert(NQ % 16 == 0 and NQ >= ROWS)
    split = gl.program_id(0)
    b = gl.program_id(1)
    s_layout: gl.constexpr = _mma(NQ)
    o_layout: gl.constexpr = _mma(NQ)
    kcol: gl.constexpr = gl.SliceLayout(1, s_layout)  # a key (a row of S^T)
    qcol: gl.constexpr = gl.SliceLayout(0, s_layout)  # a query row (a column of S^T)
    # [Note] Lab fp16 dots (F16): the fp8 tiles convert to fp16 (one cvt for two values, against the bf16 asm's
    # ~10 integer ops a word), q goes in as q c_q (c_q the power of two putting the CTA's largest |q| in [2^14,
    # 2^15): exact for all but components 2^-28 below it) with 1/c_q in the score scale, and P as P ks c_j (c_j
    # putting the block's largest per-token scale, or 1, at 2^14), the accumulators rescaled by c_j / c_{j-1}
    # (powers of two) and divided by the last c at the end, as the Triton decode's [Note] fp16 dots.
    dt: gl.constexpr = gl.float16 if F16 else gl.bfloat16
    k_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 128], dt)
    r_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 64], dt)
    q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([NQ, 128], dt)
    qr_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([NQ, 64], dt)
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, NQ], dt)
    kc_s = gl.allocate_shared_memory(dt, [4, 64, 128], k_sl)
    kr_s = gl.allocate_shared_memory(dt, [1, 64, 64], r_sl)
    # [Note] Lab fp8 words: the converted words are stored through int32 views of the bf16 tiles (the same bytes:
    # an NVMMA layout swizzles 16-byte pieces of 128-byte rows, whatever the element)
    kc_w = kc_s._reinterpret(gl.int32, [4, 64, 64], gl.NVMMASharedLayout(128, 32, rank=2))
    kr_w = kr_s._reinterpret(gl.int32, [1, 64, 32], gl.NVMMASharedLayout(128, 32, rank=2))
    qc_s = gl.allocate_shared_memory(dt, [4, NQ, 128], q_sl)
    qr_s = gl.allocate_shared_memory(dt, [1, NQ, 64], qr_sl)
    p_s = gl.allocate_shared_memory(dt, [1, 64, NQ], p_sl)

    # q rows b * ROWS + n, n < ROWS (the rest zero) into shared memory
    lq: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    qn = gl.arange(0, NQ, layout=gl.SliceLayout(1, lq))
    qc = gl.arange(0, 128, layout=gl.SliceLayout(0, lq))
    qok = (qn < ROWS)[:, None]
    qbase = Q + (b * ROWS + qn).to(gl.int64)[:, None] * D_K + qc[None, :]
    q0 = gl.load(qbase, mask=qok, other=0.0)
    q1 = gl.load(qbase + 128, mask=qok, other=0.0)
    q2 = gl.load(qbase + 256, mask=qok, other=0.0)
    q3 = gl.load(qbase + 384, mask=qok, other=0.0)
    lqr: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    qn2 = gl.arange(0, NQ, layout=gl.SliceLayout(1, lqr))
    qc2 = gl.arange(0, 64, layout=gl.SliceLayout(0, lqr))
    qr = gl.load(Q + (b * ROWS + qn2).to(gl.int64)[:, None] * D_K + DV_K + qc2[None, :], mask=(qn2 < ROWS)[:, None],
                 other=0.0)
    if F16:  # [Note] Lab fp16 dots: q c_q in fp16, 1/c_q into the score scale
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
    o0 = gl.zeros([128, NQ], gl.float32, o_layout)
    o1 = gl.zeros([128, NQ], gl.float32, o_layout)
    o2 = gl.zeros([128, NQ], gl.float32, o_layout)
    o3 = gl.zeros([128, NQ], gl.float32, o_layout)
    fence_async_shared()
    gl.thread_barrier()

    pg = _page(BlockTable, bt_row, k_lo, num_pages, n_blocks > 0, PAGE)
    pg_next = _page(BlockTable, bt_row, k_lo + 64, num_pages, n_blocks > 1, PAGE)  # [Note] Lab page prefetch
    x0, x1, x2, x3, xr, row0 = _fetch(Cache, pg, k_lo, seq_len, n_blocks > 0, PAGE)
    keys0 = gl.arange(0, 64, layout=kcol)
    if PER_TOKEN:
        ks = gl.load(KTok + row0 + keys0, mask=k_lo + keys0 < seq_len, other=0.0)
    t0 = warpgroup_mma_init(o0)
    t1 = warpgroup_mma_init(o1)
    t2 = warpgroup_mma_init(o2)
    t3 = warpgroup_mma_init(o3)
    for j in range(n_blocks):
        start = k_lo + j * 64
        # the previous block's P V read the tiles and P: wait before overwriting them
        o0, o1, o2, o3 = warpgroup_mma_wait(0, deps=(t0, t1, t2, t3))
        _stage(kc_w.index(0), x0, 64, 32, F16)
        _stage(kc_w.index(1), x1, 64, 32, F16)
        _stage(kc_w.index(2), x2, 64, 32, F16)
        _stage(kc_w.index(3), x3, 64, 32, F16)
        _stage(kr_w.index(0), xr, 64, 16, F16)
        if PER_TOKEN:
            ks_j = ks
        # the next block's bytes, in flight under this block's work
        nxt = start + 64
        x0, x1, x2, x3, xr, row_n = _fetch(Cache, pg_next, nxt, seq_len, j + 1 < n_blocks, PAGE)
        if PER_TOKEN:
            ks = gl.load(KTok + row_n + keys0, mask=(nxt + keys0 < seq_len) & (j + 1 < n_blocks), other=0.0)
        pg_next = _page(BlockTable, bt_row, nxt + 64, num_pages, j + 2 < n_blocks, PAGE)
        fence_async_shared()
        gl.thread_barrier()
        z = j >> 30  # a 0 the compiler cannot fold ([Note] Seesaw descriptors)
        if S_ACCS == 2:  # two score chains (rope + latent 0, 1; latent 2, 3), summed: [Note] Lab two score chains
            tok = warpgroup_mma(kr_s.index(z), qr_s.index(z).permute((1, 0)),
                                gl.zeros([64, NQ], gl.float32, s_layout), use_acc=False, is_async=True)
            tok2 = warpgroup_mma(kc_s.index(2 + z), qc_s.index(2 + z).permute((1, 0)),
                                 gl.zeros([64, NQ], gl.float32, s_layout), use_acc=False, is_async=True)
            tok = warpgroup_mma(kc_s.index(0 + z), qc_s.index(0 + z).permute((1, 0)), tok, is_async=True)
            tok2 = warpgroup_mma(kc_s.index(3 + z), qc_s.index(3 + z).permute((1, 0)), tok2, is_async=True)
            tok = warpgroup_mma(kc_s.index(1 + z), qc_s.index(1 + z).permute((1, 0)), tok, is_async=True)
            s, s2 = warpgroup_mma_wait(0, deps=(tok, tok2))
            s = s + s2
        else:
            tok = warpgroup_mma(kr_s.index(z), qr_s.index(z).permute((1, 0)),
                                gl.zeros([64, NQ], gl.float32, s_layout), use_acc=False, is_async=True)
            tok = warpgroup_mma(kc_s.index(0 + z), qc_s.index(0 + z).permute((1, 0)), tok, is_async=True)
            tok = warpgroup_mma(kc_s.index(1 + z), qc_s.index(1 + z).permute((1, 0)), tok, is_async=True)
            tok = warpgroup_mma(kc_s.index(2 + z), qc_s.index(2 + z).permute((1, 0)), tok, is_async=True)
            tok = warpgroup_mma(kc_s.index(3 + z), qc_s.index(3 + z).permute((1, 0)), tok, is_async=True)
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
        t0 = warpgroup_mma(kc_s.index(0 + z).permute((1, 0)), p_s.index(z), o0 * a, is_async=True)
        t1 = warpgroup_mma(kc_s.index(1 + z).permute((1, 0)), p_s.index(z), o1 * a, is_async=True)
        t2 = warpgroup_mma(kc_s.index(2 + z).permute((1, 0)), p_s.index(z), o2 * a, is_async=True)
        t3 = warpgroup_mma(kc_s.index(3 + z).permute((1, 0)), p_s.index(z), o3 * a, is_async=True)
    o0, o1, o2, o3 = warpgroup_mma_wait(0, deps=(t0, t1, t2, t3))

    l_safe = gl.where(l_i == 0.0, 1.0, l_i)
    inv = gl.convert_layout(v_mul / (l_safe * c_prev), gl.SliceLayout(0, o_layout))[None, :]
    m_fin = gl.where(m_i == float("-inf"), 0.0, m_i)
    lse2 = gl.where(l_i == 0.0, float("-inf"), m_fin + gl.log2(l_safe))
    on = gl.arange(0, NQ, layout=gl.SliceLayout(0, o_layout))
    om = gl.arange(0, 128, layout=gl.SliceLayout(1, o_layout))
    real = (on < ROWS)[None, :] & (om < 128)[:, None]
    if DIRECT:
        base = Out + (b * ROWS + on).to(gl.int64)[None, :] * DV_K + om[:, None]
        gl.store(base, (o0 * inv).to(gl.bfloat16), mask=real)
        gl.store(base + 128, (o1 * inv).to(gl.bfloat16), mask=real)
        gl.store(base + 256, (o2 * inv).to(gl.bfloat16), mask=real)
        gl.store(base + 384, (o3 * inv).to(gl.bfloat16), mask=real)
        gl.store(Lse + b * ROWS + n, lse2 * 0.6931471805599453, mask=n < ROWS)
    else:
        prow = (b * num_splits + split) * ROWS
        base = PartO + (prow + on).to(gl.int64)[None, :] * DV_K + om[:, None]
        gl.store(base, o0 * inv, mask=real)
        gl.store(base + 128, o1 * inv, mask=real)
        gl.store(base + 256, o2 * inv, mask=real)
        gl.store(base + 384, o3 * inv, mask=real)
        gl.store(PartLse + prow + n, lse2, mask=n < ROWS)


def splits_for(batch, span, sms=132, num_splits=None, per_sm=2):
    """(per, splits): key blocks per split and the split count; by default about one wave of CTAs at per_sm an SM
    (two fit: shared memory and registers)."""
    blocks = max(1, -(-span // BLOCK_N))
    if num_splits is None:
        num_splits = max(1, min(MAX_SPLITS, (per_sm * sms) // max(batch, 1)))
    per = -(-blocks // num_splits)
    return per, -(-blocks // per)


def _args(q, cache, block_table, seqlens_k, scale, k_scale, num_splits, causal, sms=132, per_sm=2, f16=False,
          s_accs=1):
    bsz, hq, sq, d = q.shape
    rows = hq * sq
    assert d == D and rows <= 64 and cache.shape[-1] == D and cache.shape[2] == 1 and cache.shape[1] % 64 == 0
    nq = max(16, -(-rows // 16) * 16)
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
    kw = dict(ROWS=rows, NQ=nq, SQ=sq, PAGE=page, CAUSAL=causal, DIRECT=direct, PER_TOKEN=per_token, F16=f16,
              S_ACCS=s_accs)
    return args, kw, out, lse, part_o, part_lse, splits


def mla_decode_fp8(q, cache, block_table, seqlens_k, scale, k_scale, num_splits=None, causal=True, per_sm=2,
                   f16=False, s_accs=1):
    """out [B, Hq, Sq, 512], lse [B, Hq, Sq]; q contiguous bf16 (Hq x Sq <= 64), cache [num_pages, PAGE, 1, 576]
    float8_e4m3fn contiguous, k_scale a float or float32 [num_pages, PAGE, 1] contiguous."""
    assert q.is_contiguous() and cache.is_contiguous() and q.dtype == torch.bfloat16
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    args, kw, out, lse, part_o, part_lse, splits = _args(q, cache, block_table, seqlens_k, scale, k_scale,
                                                         num_splits, causal, sms, per_sm, f16, s_accs)
    bsz = q.shape[0]
    _mla_decode_fp8[(splits, bsz)](*args, **kw, num_warps=4)
    if splits > 1:
        from lab.gluon_mla_decode import _merge
        rows = kw["ROWS"]
        _merge[(-(-rows // 16), bsz)](part_o, part_lse, out, lse, ROWS=rows, NUM_SPLITS=splits, BLOCK_R=16, DV_=DV,
                                      num_warps=4)
    return out, lse


def compile_for(hq=16, sq=1, page=64, num_splits=1, causal=True, per_token=True, f16=False, s_accs=1):
    """Build the kernel for sm_90 without a GPU (triton's bundled ptxas); returns the CompiledKernel."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    q = torch.empty((2, hq, sq, D), dtype=torch.bfloat16)
    cache = torch.empty((8, page, 1, D), dtype=torch.float8_e4m3fn)
    table = torch.zeros((2, 4), dtype=torch.int32)
    lens = torch.zeros((2, ), dtype=torch.int32)
    ks = torch.ones((8, page, 1), dtype=torch.float32) if per_token else 0.5
    args, kw, *_ = _args(q, cache, table, lens, 0.1, ks, num_splits, causal, f16=f16, s_accs=s_accs)
    names = list(_mla_decode_fp8.arg_names)[:len(args)]
    signature = {n: mangle_type(a) for n, a in zip(names, args)}
    signature.update({n: "constexpr" for n in kw})
    # the launch's specialisation: pointers 16-byte aligned (torch's allocations), as the JIT assumes at run time
    attrs = {(i, ): [["tt.divisibility", 16]] for i, n in enumerate(names) if signature[n].startswith("*")}
    src = GluonASTSource(fn=_mla_decode_fp8, signature=signature, constexprs=kw, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


class Module:
    """The decode contract's two entries over mla_decode_fp8 (for scripts/gpu_mla_dec_s9.py): forward(q, cache,
    None, block_table=, seqlens_k=, scale=, k_scale=) with the split rule, forward_split(..., num_splits=n)."""

    def __init__(self, causal=True, per_sm=2, f16=False, s_accs=1):
        self.causal, self.per_sm, self.f16, self.s_accs = causal, per_sm, f16, s_accs

    def forward(self, q, k, v, *, block_table, seqlens_k, scale, k_scale):
        assert v is None
        return mla_decode_fp8(q, k, block_table, seqlens_k, scale, k_scale, None, self.causal, self.per_sm, self.f16,
                              self.s_accs)

    def forward_split(self, q, k, v, *, num_splits, block_table, seqlens_k, scale, k_scale):
        assert v is None
        return mla_decode_fp8(q, k, block_table, seqlens_k, scale, k_scale, num_splits, self.causal, f16=self.f16,
                              s_accs=self.s_accs)
