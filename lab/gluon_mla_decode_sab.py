"""Lab (not the product): the bf16 MLA absorbed decode for the memory-bound shapes (Hq x Sq of 16 rows: MLA's Hq
16, Sq 1), sm_90, Gluon: the swap-AB schedule of lab/gluon_mla_decode_fp8.py ([Note] Lab fp8 swap-AB) over a bf16
latent cache, whose pages TMA loads straight into the wgmma tiles (nothing to convert).

q [B, Hq, Sq, 576] bf16 contiguous, cache [num_pages, PAGE, 1, 576] bf16 contiguous (PAGE a multiple of 64),
block_table int32 [B, width], seqlens_k int32 [B]; out [B, Hq, Sq, 512], lse [B, Hq, Sq] (natural log).

[Note] Lab swap-AB bf16. One warpgroup a CTA, two slots of one 64-key block each (four [64, 128] latent tiles and
the [64, 64] rope tile, 72 KB, one mbarrier), Q [16, 576] and P^T [64, 16] in shared memory: 164 KB, one CTA an
SM. Per block j: wait slot j % 2; S^T = K Q^T (36 wgmma m64n16k16); softmax down the columns; P^T to shared
memory; O^T += V^T P^T (four [128, 16] accumulators, 32 wgmma) issued asynchronously; at the next step, once
P_j V_j has retired (its slot is free), block j + 1's TMA goes into it: each block is in flight for about a step
(72 KB an SM, against ~22 KB a microsecond of DRAM latency that copy speed needs). Keys past a sequence's end (a page holds
anything past it, NaN included) are masked in S^T and their latent rows zeroed before P V ([Note] Lab tail).
Splits: about one wave of CTAs (one an SM), whole blocks; the lab merge of lab/gluon_mla_decode.py.
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
def _mma(n):
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


@gluon.jit
def _issue(k128, k64, kc_s, kr_s, bar, BlockTable, bt_row, start, num_pages, st, PAGE: gl.constexpr):
    """TMA of the 64 keys from `start` (one page's rows) into slot st: four latent tiles and the rope tile."""
    page = gl.load(BlockTable + bt_row + start // PAGE)
    page = gl.minimum(gl.maximum(page, 0), num_pages - 1)  # as the product's [Note] Gluon decode memory safety
    row = page * PAGE + start % PAGE
    mbarrier.expect(bar.index(st), 4 * k128.block_type.nbytes + k64.block_type.nbytes)
    for c in gl.static_range(4):
        tma.async_copy_global_to_shared(k128, [row, c * 128], bar.index(st), kc_s.index(st * 4 + c))
    tma.async_copy_global_to_shared(k64, [row, DV_K], bar.index(st), kr_s.index(st))


@gluon.jit
def _zero_tail(kc_s, st, valid):
    """Latent rows >= valid of slot st become 0 (generic-proxy writes; the caller fences)."""
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, ld))
    for c in gl.static_range(4):
        t = kc_s.index(st * 4 + c)
        x = t.load(ld)
        t.store(gl.where(r[:, None] < valid, x, gl.zeros_like(x)))


@gluon.jit(do_not_specialize=["stride_bt", "bt_width", "num_pages", "num_splits", "per"])
def _mla_decode_sab(Q, k128, k64, BlockTable, Seqlens, Out, Lse, PartO, PartLse, stride_bt, bt_width, num_pages,
                    qk_scale, num_splits, per, ROWS: gl.constexpr, NQ: gl.constexpr, SQ: gl.constexpr,
                    PAGE: gl.constexpr, CAUSAL: gl.constexpr, DIRECT: gl.constexpr):
    gl.static_assert(PAGE % 64 == 0)
    gl.static_assert(NQ % 16 == 0 and NQ >= ROWS)
    split = gl.program_id(0)
    b = gl.program_id(1)
    s_layout: gl.constexpr = _mma(NQ)
    o_layout: gl.constexpr = _mma(NQ)
    kcol: gl.constexpr = gl.SliceLayout(1, s_layout)
    qcol: gl.constexpr = gl.SliceLayout(0, s_layout)
    q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([NQ, 128], gl.bfloat16)
    qr_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([NQ, 64], gl.bfloat16)
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, NQ], gl.bfloat16)
    kc_s = gl.allocate_shared_memory(gl.bfloat16, [8, 64, 128], k128.layout)  # slot s: tiles 4 s .. 4 s + 3
    kr_s = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 64], k64.layout)
    qc_s = gl.allocate_shared_memory(gl.bfloat16, [4, NQ, 128], q_sl)
    qr_s = gl.allocate_shared_memory(gl.bfloat16, [1, NQ, 64], qr_sl)
    p_s = gl.allocate_shared_memory(gl.bfloat16, [1, 64, NQ], p_sl)
    bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bar.index(0), count=1)
    mbarrier.init(bar.index(1), count=1)

    lq: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    qn = gl.arange(0, NQ, layout=gl.SliceLayout(1, lq))
    qc = gl.arange(0, 128, layout=gl.SliceLayout(0, lq))
    qbase = Q + (b * ROWS + qn).to(gl.int64)[:, None] * D_K + qc[None, :]
    for c in gl.static_range(4):
        qc_s.index(c).store(gl.load(qbase + c * 128, mask=(qn < ROWS)[:, None], other=0.0))
    lqr: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    qn2 = gl.arange(0, NQ, layout=gl.SliceLayout(1, lqr))
    qc2 = gl.arange(0, 64, layout=gl.SliceLayout(0, lqr))
    qr_s.index(0).store(gl.load(Q + (b * ROWS + qn2).to(gl.int64)[:, None] * D_K + DV_K + qc2[None, :],
                                mask=(qn2 < ROWS)[:, None], other=0.0))
    fence_async_shared()
    gl.thread_barrier()

    seq_len = gl.minimum(gl.maximum(gl.load(Seqlens + b), 0), bt_width * PAGE)
    n_all = (seq_len + 63) // 64
    j_lo = gl.minimum(split * per, n_all)
    n_blocks = gl.minimum(n_all - j_lo, per)
    k_lo = j_lo * 64
    bt_row = b.to(gl.int64) * stride_bt
    for i in gl.static_range(2):
        if i < n_blocks:
            _issue(k128, k64, kc_s, kr_s, bar, BlockTable, bt_row, k_lo + i * 64, num_pages, i, PAGE)
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
    t0 = warpgroup_mma_init(o0)
    t1 = warpgroup_mma_init(o1)
    t2 = warpgroup_mma_init(o2)
    t3 = warpgroup_mma_init(o3)
    keys0 = gl.arange(0, 64, layout=kcol)
    for j in range(n_blocks):
        st = j % 2
        start = k_lo + j * 64
        o0, o1, o2, o3 = warpgroup_mma_wait(0, deps=(t0, t1, t2, t3))  # P_{j-1} V_{j-1}: its slot is free
        gl.thread_barrier()
        if j >= 1:  # block j + 1 into block j - 1's slot (blocks 0 and 1 went before the loop)
            if j + 1 < n_blocks:
                _issue(k128, k64, kc_s, kr_s, bar, BlockTable, bt_row, start + 64, num_pages, 1 - st, PAGE)
        mbarrier.wait(bar.index(st), (j // 2) & 1)
        z = j >> 30  # [Note] Seesaw descriptors
        tok = warpgroup_mma(kr_s.index(st + z), qr_s.index(z).permute((1, 0)),
                            gl.zeros([64, NQ], gl.float32, s_layout), use_acc=False, is_async=True)
        for c in gl.static_range(4):
            tok = warpgroup_mma(kc_s.index(st * 4 + c + z), qc_s.index(c + z).permute((1, 0)), tok, is_async=True)
        s = warpgroup_mma_wait(0, deps=(tok, ))
        keys = start + keys0
        s = gl.where(keys[:, None] <= lim[None, :], s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 0))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(s - m_use[None, :])
        l_i = l_i * alpha + gl.sum(p, 0)
        m_i = m_new
        if start + 64 > seq_len:  # [Note] Lab tail
            _zero_tail(kc_s, st, seq_len - start)
        p_s.index(0).store(p.to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()
        a = gl.convert_layout(alpha, gl.SliceLayout(0, o_layout))[None, :]
        t0 = warpgroup_mma(kc_s.index(st * 4 + 0 + z).permute((1, 0)), p_s.index(z), o0 * a, is_async=True)
        t1 = warpgroup_mma(kc_s.index(st * 4 + 1 + z).permute((1, 0)), p_s.index(z), o1 * a, is_async=True)
        t2 = warpgroup_mma(kc_s.index(st * 4 + 2 + z).permute((1, 0)), p_s.index(z), o2 * a, is_async=True)
        t3 = warpgroup_mma(kc_s.index(st * 4 + 3 + z).permute((1, 0)), p_s.index(z), o3 * a, is_async=True)
    o0, o1, o2, o3 = warpgroup_mma_wait(0, deps=(t0, t1, t2, t3))

    l_safe = gl.where(l_i == 0.0, 1.0, l_i)
    inv = gl.convert_layout(1.0 / l_safe, gl.SliceLayout(0, o_layout))[None, :]
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


def splits_for(batch, span, sms=132, num_splits=None):
    """(per, splits): key blocks per split and the split count; by default about one wave of CTAs (one an SM)."""
    blocks = max(1, -(-span // BLOCK_N))
    if num_splits is None:
        num_splits = max(1, min(MAX_SPLITS, sms // max(batch, 1)))
    per = -(-blocks // num_splits)
    return per, -(-blocks // per)


def _args(q, cache, block_table, seqlens_k, scale, num_splits, causal, sms=132):
    bsz, hq, sq, d = q.shape
    rows = hq * sq
    assert d == D and rows <= 16 and cache.shape[-1] == D and cache.shape[2] == 1 and cache.shape[1] % 64 == 0
    page = cache.shape[1]
    per, splits = splits_for(bsz, block_table.shape[1] * page, sms, num_splits)
    direct = splits == 1
    out = torch.empty((bsz, hq, sq, DV), dtype=q.dtype, device=q.device)
    lse = torch.empty((bsz, hq, sq), dtype=torch.float32, device=q.device)
    if direct:
        part_o, part_lse = out, lse
    else:
        part_o = torch.empty((bsz * splits * rows, DV), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((bsz * splits * rows, ), dtype=torch.float32, device=q.device)
    c2 = cache.view(-1, D)

    def desc(cols):
        layout = gl.NVMMASharedLayout.get_default_for([64, cols], gl.bfloat16)
        return TensorDescriptor(c2, list(c2.shape), list(c2.stride()), [64, cols], layout)
    args = (q, desc(128), desc(64), block_table, seqlens_k, out, lse, part_o, part_lse, block_table.stride(0),
            block_table.shape[1], cache.shape[0], scale * 1.4426950408889634, splits, per)
    kw = dict(ROWS=rows, NQ=16, SQ=sq, PAGE=page, CAUSAL=causal, DIRECT=direct)
    return args, kw, out, lse, part_o, part_lse, splits


def mla_decode_sab(q, cache, block_table, seqlens_k, scale, num_splits=None, causal=True):
    """out [B, Hq, Sq, 512], lse [B, Hq, Sq] (Hq x Sq <= 16)."""
    assert q.is_contiguous() and cache.is_contiguous() and q.dtype == cache.dtype == torch.bfloat16
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    args, kw, out, lse, part_o, part_lse, splits = _args(q, cache, block_table, seqlens_k, scale, num_splits, causal,
                                                         sms)
    bsz = q.shape[0]
    _mla_decode_sab[(splits, bsz)](*args, **kw, num_warps=4)
    if splits > 1:
        from lab.gluon_mla_decode import _merge
        rows = kw["ROWS"]
        _merge[(-(-rows // 16), bsz)](part_o, part_lse, out, lse, ROWS=rows, NUM_SPLITS=splits, BLOCK_R=16, DV_=DV,
                                      num_warps=4)
    return out, lse


class Module:
    """forward / forward_split over mla_decode_sab, as scripts/gpu_mla_dec_s9.py calls a decode module."""

    def __init__(self, causal=True):
        self.causal = causal

    def forward(self, q, k, v, *, block_table, seqlens_k, scale):
        assert v is None
        return mla_decode_sab(q, k, block_table, seqlens_k, scale, None, self.causal)

    def forward_split(self, q, k, v, *, num_splits, block_table, seqlens_k, scale):
        assert v is None
        return mla_decode_sab(q, k, block_table, seqlens_k, scale, num_splits, self.causal)


def compile_for(hq=16, sq=1, page=64, num_splits=1, causal=True):
    """Build the kernel for sm_90 without a GPU (triton's bundled ptxas); returns the CompiledKernel."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    q = torch.empty((2, hq, sq, D), dtype=torch.bfloat16)
    cache = torch.empty((8, page, 1, D), dtype=torch.bfloat16)
    table = torch.zeros((2, 4), dtype=torch.int32)
    lens = torch.zeros((2, ), dtype=torch.int32)
    args, kw, *_ = _args(q, cache, table, lens, 0.1, num_splits, causal)
    names = list(_mla_decode_sab.arg_names)[:len(args)]
    signature = {n: mangle_type(a) for n, a in zip(names, args)}
    signature.update({n: "constexpr" for n in kw})
    attrs = {(i, ): [["tt.divisibility", 16]] for i, n in enumerate(names) if signature[n].startswith("*")}
    src = GluonASTSource(fn=_mla_decode_sab, signature=signature, constexprs=kw, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
