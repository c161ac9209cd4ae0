"""Lab (not the product): variants of the ninth session's fp8 latent swap-AB decode (lab/gluon_mla_decode_fp8.py,
[Note] Lab fp8 swap-AB) for the eleventh session's profile of its step (issue 27 part 2: an fp8 latent cache read
at >= 90% of copy; that kernel reads it at 46-70%, the product's Triton decode at 31-51%).

The same kernel and contract (q [B, Hq, Sq, 576] bf16, Hq x Sq <= 64; cache [num_pages, PAGE, 1, 576]
float8_e4m3fn; one scale a token, float32 [num_pages, PAGE, 1], or one a tensor; block_table, seqlens_k int32;
causal as fagen's decode), with switches:
  - L_PART ([Note] Lab partial row sums): the softmax's row sums l kept as a [64 keys, NQ] tile in each thread's
    registers (8 more a thread) and reduced across the four warps once after the key loop, instead of a cross-warp
    column sum (shared memory and a CTA barrier) every block; exact up to the order of the float32 sums.
  - ABLATE ([Note] Lab ablations; timing only, never served): 1 stores the raw fp8 words into the tiles instead of
    converting them (the result is wrong: what the conversion costs the step), 2 replaces the running max's
    cross-warp column max by a fixed shift of 0 (exact while every score stays below ~120 in log2 units: the
    random inputs of the timing; what the max's reduction costs the step).
"""
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, \
    warpgroup_mma_init, warpgroup_mma_wait

from lab.gluon_mla_decode_fp8 import D, DV, DV_K, D_K, _fetch, _mma, _page, _pow2_scale, _stage, splits_for  # noqa: F401

@gluon.jit(do_not_specialize=["stride_bt", "bt_width", "num_pages", "num_splits", "per"])
def _mla_decode_f8x(Q, Cache, KTok, BlockTable, Seqlens, Out, Lse, PartO, PartLse, stride_bt, bt_width, num_pages,
                    qk_scale, v_mul, num_splits, per, ROWS: gl.constexpr, NQ: gl.constexpr, SQ: gl.constexpr,
                    PAGE: gl.constexpr, CAUSAL: gl.constexpr, DIRECT: gl.constexpr, PER_TOKEN: gl.constexpr,
                    F16: gl.constexpr, L_PART: gl.constexpr, ABLATE: gl.constexpr):
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
    l_p = gl.zeros([64, NQ], gl.float32, s_layout)  # [Note] Lab partial row sums (L_PART)
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
        if ABLATE == 1:  # timing only: the raw words stored, no conversion ([Note] Lab ablations)
            kc_w.index(0).slice(0, 32, 1).store(x0)
            kc_w.index(1).slice(0, 32, 1).store(x1)
            kc_w.index(2).slice(0, 32, 1).store(x2)
            kc_w.index(3).slice(0, 32, 1).store(x3)
            kr_w.index(0).slice(0, 16, 1).store(xr)
        else:
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
        if ABLATE == 2:  # timing only: no cross-warp max
            m_new = gl.maximum(m_i, 0.0)  # a fixed shift: exact while the scores stay below ~120
        else:
            m_new = gl.maximum(m_i, gl.max(s, 0))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(s - m_use[None, :])
        if L_PART:  # the row sums kept per key row and thread, reduced across the warps once at the end
            l_p = l_p * alpha[None, :] + p
        else:
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

    if L_PART:
        l_i = gl.sum(l_p, 0)
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


def _args(q, cache, block_table, seqlens_k, scale, k_scale, num_splits, causal, sms=132, per_sm=2, f16=False,
          l_part=False, ablate=0):
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
              L_PART=l_part, ABLATE=ablate)
    return args, kw, out, lse, part_o, part_lse, splits


def mla_decode_f8x(q, cache, block_table, seqlens_k, scale, k_scale, num_splits=None, causal=True, per_sm=2,
                   f16=False, l_part=False, ablate=0):
    """out [B, Hq, Sq, 512], lse [B, Hq, Sq]; as lab.gluon_mla_decode_fp8.mla_decode_fp8."""
    assert q.is_contiguous() and cache.is_contiguous() and q.dtype == torch.bfloat16
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    args, kw, out, lse, part_o, part_lse, splits = _args(q, cache, block_table, seqlens_k, scale, k_scale,
                                                         num_splits, causal, sms, per_sm, f16, l_part, ablate)
    bsz = q.shape[0]
    _mla_decode_f8x[(splits, bsz)](*args, **kw, num_warps=4)
    if splits > 1:
        from lab.gluon_mla_decode import _merge
        rows = kw["ROWS"]
        _merge[(-(-rows // 16), bsz)](part_o, part_lse, out, lse, ROWS=rows, NUM_SPLITS=splits, BLOCK_R=16, DV_=DV,
                                      num_warps=4)
    return out, lse


def compile_for(hq=16, sq=1, page=64, num_splits=1, causal=True, per_token=True, f16=False, l_part=False, ablate=0):
    """Build the kernel for sm_90 without a GPU (triton's bundled ptxas); returns the CompiledKernel."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    q = torch.empty((2, hq, sq, D), dtype=torch.bfloat16)
    cache = torch.empty((8, page, 1, D), dtype=torch.float8_e4m3fn)
    table = torch.zeros((2, 4), dtype=torch.int32)
    lens = torch.zeros((2, ), dtype=torch.int32)
    ks = torch.ones((8, page, 1), dtype=torch.float32) if per_token else 0.5
    args, kw, *_ = _args(q, cache, table, lens, 0.1, ks, num_splits, causal, f16=f16, l_part=l_part, ablate=ablate)
    names = list(_mla_decode_f8x.arg_names)[:len(args)]
    signature = {n: mangle_type(a) for n, a in zip(names, args)}
    signature.update({n: "constexpr" for n in kw})
    attrs = {(i, ): [["tt.divisibility", 16]] for i, n in enumerate(names) if signature[n].startswith("*")}
    src = GluonASTSource(fn=_mla_decode_f8x, signature=signature, constexprs=kw, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


class Module:
    """The decode contract's two entries over mla_decode_f8x (scripts/gpu_fp8lat_s11.py)."""

    def __init__(self, causal=True, per_sm=2, f16=False, l_part=False, ablate=0):
        self.causal, self.per_sm, self.kw = causal, per_sm, dict(f16=f16, l_part=l_part, ablate=ablate)

    def forward(self, q, k, v, *, block_table, seqlens_k, scale, k_scale):
        assert v is None
        return mla_decode_f8x(q, k, block_table, seqlens_k, scale, k_scale, None, self.causal, self.per_sm,
                              **self.kw)

    def forward_split(self, q, k, v, *, num_splits, block_table, seqlens_k, scale, k_scale):
        assert v is None
        return mla_decode_f8x(q, k, block_table, seqlens_k, scale, k_scale, num_splits, self.causal, **self.kw)
