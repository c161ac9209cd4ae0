"""Lab (sixteenth session; issue 27): the paged fp8 KV decode in Gluon on lab/pagedfp8_gather_read.py's cp.async
ring. d128, GQA 4 (Hq 32 / Hkv 8 at the bench row), vLLM's [num_pages, PAGE, Hkv, 128] e4m3 caches, per-KV-head
(or no) scales, bf16 queries, one query a sequence.

One program per (split, KV head, sequence), the product's grid (splits, Hkv, B). Its keys [split * chunk, ...) go
BLOCK_N a step: block j + STAGES - 1's K and V rows are gathered through the block table by cp.async (16 bytes a
thread, masked past the split's end: zero-filled, not read) into a STAGES-deep shared ring at step j's start, their
page numbers loaded a step before (carried; clamped into the cache: [Note] Memory safety of the product). Step j
waits for block j (wait_group(STAGES - 2)) and a barrier (every thread's copies landed; every thread done reading
block j - 1's slot, which this step's copies overwrite), then:
  S = Q K^T by mma_v2 (m16n8k16; the GQA group's 4 query rows padded to 16), K^T's bf16 operand converted from the
  ring's fp8 bytes (exactly: every e4m3 value is a bf16 value), scaled by scale * k_scale / ln 2;
  the online softmax in fp32 (log2 domain), keys past the split's end masked to -inf;
  O += P V by mma_v2, P in bf16, V's operand converted from the ring's fp8 (V_CVT 0: loaded straight into the dot
  operand layout; 1: loaded in 16-byte rows, converted, moved into the operand layout by convert_layout).
F16 1: the product's [Note] fp16 dots instead of bf16: K and V converted by the hardware's fp8 -> fp16 cvt (two
values an instruction; the bf16 path's bit trick is ~3.5 instructions a value), q * cq in fp16 (cq a power of two
putting max |q| near 2^14; 1 / cq into k's scale), P * 2^14 in fp16 (1 / 2^14 into v's). K_FRAG 1 (with F16): K's
operand read as 32 contiguous bytes a thread and its d columns permuted (Q's the same way, S unchanged) instead of
2-byte pieces in the operand's layout.
wsplit=1 (_paged_decode_w, fp16 dots, BLOCK_N = 16 x warps): each warp its own 16 keys of a block with its own
running max, sum and O (batched [WARPS, 16, ...] mma_v2), so the loop has no cross-warp reduction and P goes from
the scores' accumulator to the P V operand in registers; the warps' states are merged once at the end.
O * v_scale / l and lse = m + log2 l: one split (DIRECT) writes out (bf16) and lse (natural log) itself; several write
the product's partial layout (fp32 [splits, B, Hq, 1, 128] and log2 lse [splits, B, Hq, 1]) and _merge (a Triton
kernel with the product's _merge_splits arithmetic: split order, log-sum-exp) combines the sequence's used splits.

    PYTHONPATH=$PWD python3 lab/pagedfp8_gluon_decode.py    # builds for sm_90 on the CPU: registers, spills, smem
"""
import math

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

GQA = gl.constexpr(4)
D = gl.constexpr(128)


@gluon.jit
def _page(BlockTable, bt_row, start, r, k_hi, num_pages, PAGE: gl.constexpr):
    """Page numbers of keys start + r (0 past k_hi), clamped into [0, num_pages - 1]."""
    pg = gl.load(BlockTable + bt_row + (start + r) // PAGE, mask=(start + r) < k_hi, other=0)
    return gl.minimum(gl.maximum(pg, 0), num_pages - 1)


@gluon.jit
def _issue(K, V, k_s, v_s, slot, pg, start, r, c, k_hi, stride_p, stride_s, head_off, PAGE: gl.constexpr):
    """cp.async of keys start + r's K and V rows (pages pg) into ring slot `slot`, one group; keys >= k_hi: zeros."""
    ok = ((start + r) < k_hi)[:, None]
    rows = pg.to(gl.int64) * stride_p + ((start + r) % PAGE) * stride_s + head_off
    off = rows[:, None] + c[None, :]
    async_copy.async_copy_global_to_shared(k_s.index(slot), K + off, mask=ok)
    async_copy.async_copy_global_to_shared(v_s.index(slot), V + off, mask=ok)
    async_copy.commit_group()


@gluon.jit
def _bf16(x):
    """fp8 e4m3 as bf16, exactly (the product's _fp8_to: exponent rebias by a bf16 multiply by 2^120)."""
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
        constraints="=r,=r,r", args=[x.to(gl.uint8, bitcast=True)], dtype=gl.bfloat16, is_pure=True, pack=4)


@gluon.jit
def _cvt(x, F16: gl.constexpr):
    """fp8 e4m3 as fp16 (the hardware's cvt, two a instruction) or bf16 (_bf16), exactly."""
    if F16:
        return x.to(gl.float16)
    else:
        return _bf16(x)


@gluon.jit
def _kfrag(ks, BLOCK_N: gl.constexpr, WARPS: gl.constexpr, b_op: gl.constexpr):
    """K^T's fp16 B fragment with its rows (d) permuted: a thread reads its key's 32 contiguous bytes (two 16-byte
    loads) and converts them; byte 32 t + 4 c + 2 h + i becomes row 16 c + 8 h + 2 t + i, which is where the
    m16n8k16 fragment of lane t (mod 4) holds it, so the move into the operand layout is a register renaming."""
    kl: gl.constexpr = gl.BlockedLayout([1, 32], [8, 4], [WARPS, 1], [1, 0])
    x = ks.load(kl).to(gl.float16)
    x = gl.reshape(gl.permute(gl.reshape(x, [BLOCK_N, 4, 8, 2, 2]), [0, 2, 3, 1, 4]), [BLOCK_N, D])
    return gl.convert_layout(gl.permute(x, (1, 0)), b_op)


@gluon.jit(do_not_specialize=["num_pages", "stride_bt", "n_cap", "chunk"])
def _paged_decode(Q, K, V, KScale, VScale, BlockTable, Seqlens, Dst, DstLse, num_pages, stride_bt, n_cap, chunk,
                  qk_scale, k_mul, v_mul, stride_p, stride_s, stride_ds, stride_db, stride_ls, stride_lb,
                  HKV: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                  WARPS: gl.constexpr, DIRECT: gl.constexpr, SCALES: gl.constexpr, V_CVT: gl.constexpr,
                  F16: gl.constexpr, K_FRAG: gl.constexpr):
    """SCALES 1: KScale / VScale are float32 [Hkv] (per KV head); 0: k_mul / v_mul (floats)."""
    gl.static_assert(STAGES >= 2)
    split = gl.program_id(0)
    h = gl.program_id(1)
    b = gl.program_id(2)
    cw: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [WARPS, 1], [1, 0])  # 16 bytes a thread: the copies
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, WARPS], instr_shape=[16, 8])
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    sl: gl.constexpr = gl.SwizzledSharedLayout(16, 1, 8, order=[1, 0])
    k_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, D], sl)
    v_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, D], sl)
    r = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, cw))
    c = gl.arange(0, D, layout=gl.SliceLayout(0, cw))

    n_k = gl.minimum(gl.maximum(gl.load(Seqlens + b), 0), gl.where(num_pages > 0, n_cap, 0))  # [Note] Memory safety
    lo = split * chunk
    k_hi = gl.minimum(lo + chunk, n_k)
    n_blocks = gl.cdiv(k_hi - lo, BLOCK_N)
    if not DIRECT:
        if lo >= k_hi:  # a split with no key writes nothing (_merge reads the used splits only)
            return
    bt_row = b.to(gl.int64) * stride_bt
    head_off = h * D
    for s in gl.static_range(STAGES - 1):
        pg = _page(BlockTable, bt_row, lo + s * BLOCK_N, r, k_hi, num_pages, PAGE)
        _issue(K, V, k_s, v_s, s, pg, lo + s * BLOCK_N, r, c, k_hi, stride_p, stride_s, head_off, PAGE)
    pg_next = _page(BlockTable, bt_row, lo + (STAGES - 1) * BLOCK_N, r, k_hi, num_pages, PAGE)

    # Q: the group's 4 rows, padded to 16 with zeros
    qb: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [WARPS, 1], [1, 0])
    qr = gl.arange(0, 16, layout=gl.SliceLayout(1, qb))
    qc = gl.arange(0, D, layout=gl.SliceLayout(0, qb))
    q_ptrs = Q + (b.to(gl.int64) * (HKV * GQA) + h * GQA + qr)[:, None] * D + qc[None, :]
    q = gl.load(q_ptrs, mask=(qr < GQA)[:, None], other=0.0)
    if SCALES == 1:
        k_mul = gl.load(KScale + h)
        v_mul = gl.load(VScale + h)
    c_p = 1.0
    if F16:  # the product's [Note] fp16 dots: q * cq in fp16 (cq a power of two putting max |q| in [2^14, 2^15)),
        # 1 / cq into k's scale; P * 2^14 in fp16, 1 / 2^14 into v's
        qf = q.to(gl.float32)
        qmax = gl.max(gl.max(gl.abs(qf), 1), 0)
        qbits = qmax.to(gl.int32, bitcast=True) & 0x7F800000
        cq = gl.where((qbits > 0x0C000000) & (qbits < 0x7F800000), 16384.0 / qbits.to(gl.float32, bitcast=True), 1.0)
        q16 = (qf * cq).to(gl.float16)
        if K_FRAG:  # the same column permutation as K's fragment (_kfrag): S is unchanged
            q16 = gl.reshape(gl.permute(gl.reshape(q16, [16, 4, 8, 2, 2]), [0, 2, 3, 1, 4]), [16, D])
        q = gl.convert_layout(q16, a_op)
        k_mul = k_mul / cq
        c_p = 16384.0
    else:
        q = gl.convert_layout(q, a_op)
    qk_scale = qk_scale * k_mul

    kn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
    m_i = gl.full([16], float("-inf"), gl.float32, gl.SliceLayout(1, mma))
    l_i = gl.zeros([16], gl.float32, gl.SliceLayout(1, mma))
    acc = gl.zeros([16, D], gl.float32, mma)
    for j in range(n_blocks):
        async_copy.wait_group(STAGES - 2)
        gl.thread_barrier()
        ahead = lo + (j + STAGES - 1) * BLOCK_N
        _issue(K, V, k_s, v_s, (j + STAGES - 1) % STAGES, pg_next, ahead, r, c, k_hi, stride_p, stride_s,
               head_off, PAGE)
        pg_next = _page(BlockTable, bt_row, ahead + BLOCK_N, r, k_hi, num_pages, PAGE)
        slot = j % STAGES
        if K_FRAG:
            kt = _kfrag(k_s.index(slot), BLOCK_N, WARPS, b_op)
        else:
            kt = _cvt(k_s.index(slot).permute((1, 0)).load(b_op), F16)
        s_ij = mma_v2(q, kt, gl.zeros([16, BLOCK_N], gl.float32, mma)) * qk_scale
        s_ij = gl.where((lo + j * BLOCK_N + kn < k_hi)[None, :], s_ij, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s_ij, 1))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s_ij - m_new[:, None])
        l_i = l_i * alpha + gl.sum(p, 1)
        acc = acc * alpha[:, None]
        if V_CVT == 1:
            vb: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [WARPS, 1], [1, 0])
            v = gl.convert_layout(_cvt(v_s.index(slot).load(vb), F16), b_op)
        else:
            v = _cvt(v_s.index(slot).load(b_op), F16)
        acc = mma_v2(gl.convert_layout((p * c_p).to(v.dtype), a_op), v, acc)
        m_i = m_new
    async_copy.wait_group(0)

    # [Note] Empty rows of the product: no key seen -> l 0, out 0, lse -inf; NaN stays NaN
    seen = l_i != 0
    out = gl.where(seen[:, None], acc * (v_mul / c_p) / gl.where(seen, l_i, 1.0)[:, None], 0.0)
    lse = gl.where(seen, m_i + gl.log2(gl.where(seen, l_i, 1.0)), float("-inf"))
    rows = gl.arange(0, 16, layout=gl.SliceLayout(1, mma))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, mma))
    head = b.to(gl.int64) * stride_db + (h * GQA + rows) * D  # [B, Hq, 1, D] rows of Dst (a split's part)
    lhead = b.to(gl.int64) * stride_lb + h * GQA + rows
    ok = rows < GQA
    if DIRECT:
        gl.store(Dst + head[:, None] + cols[None, :], out.to(gl.bfloat16), mask=ok[:, None])
        gl.store(DstLse + lhead, lse * 0.6931471805599453, mask=ok)
    else:
        gl.store(Dst + split.to(gl.int64) * stride_ds + head[:, None] + cols[None, :], out, mask=ok[:, None])
        gl.store(DstLse + split.to(gl.int64) * stride_ls + lhead, lse, mask=ok)


@gluon.jit(do_not_specialize=["num_pages", "stride_bt", "n_cap", "chunk"])
def _paged_decode_w(Q, K, V, KScale, VScale, BlockTable, Seqlens, Dst, DstLse, num_pages, stride_bt, n_cap, chunk,
                    qk_scale, k_mul, v_mul, stride_p, stride_s, stride_ds, stride_db, stride_ls, stride_lb,
                    HKV: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                    WARPS: gl.constexpr, DIRECT: gl.constexpr, SCALES: gl.constexpr, V_CVT: gl.constexpr,
                    F16: gl.constexpr, K_FRAG: gl.constexpr):
    """WSPLIT: _paged_decode with each warp its own 16 keys of a block and its own online softmax (m, l, O) over
    them: batched [WARPS, ...] mma_v2, no cross-warp reduction in the loop (the scores' row max and sum are within
    a warp; P stays in registers as the P V operand); the warps' states are merged once at the end. fp16 dots."""
    gl.static_assert(STAGES >= 2)
    gl.static_assert(BLOCK_N == 16 * WARPS)
    gl.static_assert(F16 == 1)
    split = gl.program_id(0)
    h = gl.program_id(1)
    b = gl.program_id(2)
    cw: gl.constexpr = gl.BlockedLayout([1, 1, 16], [1, 4, 8], [WARPS, 1, 1], [2, 1, 0])
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1, 1], instr_shape=[1, 16, 8])
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    sl: gl.constexpr = gl.SwizzledSharedLayout(16, 1, 8, order=[2, 1, 0])
    k_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, WARPS, 16, D], sl)
    v_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, WARPS, 16, D], sl)
    l2: gl.constexpr = gl.SliceLayout(2, cw)
    r = gl.arange(0, WARPS, layout=gl.SliceLayout(1, l2))[:, None] * 16 \
        + gl.arange(0, 16, layout=gl.SliceLayout(0, l2))[None, :]  # [WARPS, 16] keys of a block
    c = gl.arange(0, D, layout=gl.SliceLayout(0, gl.SliceLayout(1, cw)))

    n_k = gl.minimum(gl.maximum(gl.load(Seqlens + b), 0), gl.where(num_pages > 0, n_cap, 0))
    lo = split * chunk
    k_hi = gl.minimum(lo + chunk, n_k)
    n_blocks = gl.cdiv(k_hi - lo, BLOCK_N)
    if not DIRECT:
        if lo >= k_hi:
            return
    bt_row = b.to(gl.int64) * stride_bt
    head_off = h * D
    for s in gl.static_range(STAGES - 1):
        pg = _page(BlockTable, bt_row, lo + s * BLOCK_N, r, k_hi, num_pages, PAGE)
        _issue3(K, V, k_s, v_s, s, pg, lo + s * BLOCK_N, r, c, k_hi, stride_p, stride_s, head_off, PAGE)
    pg_next = _page(BlockTable, bt_row, lo + (STAGES - 1) * BLOCK_N, r, k_hi, num_pages, PAGE)

    qb: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 2, 16], [WARPS, 1, 1], [2, 1, 0])  # each warp all of Q
    qw = gl.arange(0, WARPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, qb)))
    qr = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, qb)))
    qc = gl.arange(0, D, layout=gl.SliceLayout(0, gl.SliceLayout(1, qb)))
    qrow = (b.to(gl.int64) * (HKV * GQA) + h * GQA + qr)[None, :, None] + qw[:, None, None] * 0
    q = gl.load(Q + qrow * D + qc[None, None, :], mask=(qr < GQA)[None, :, None], other=0.0)
    if SCALES == 1:
        k_mul = gl.load(KScale + h)
        v_mul = gl.load(VScale + h)
    qf = q.to(gl.float32)  # [Note] fp16 dots of the product
    qmax = gl.max(gl.max(gl.max(gl.abs(qf), 2), 1), 0)
    qbits = qmax.to(gl.int32, bitcast=True) & 0x7F800000
    cq = gl.where((qbits > 0x0C000000) & (qbits < 0x7F800000), 16384.0 / qbits.to(gl.float32, bitcast=True), 1.0)
    q3 = gl.convert_layout((qf * cq).to(gl.float16), a_op)
    qk_scale = qk_scale * k_mul / cq
    c_p: gl.constexpr = 16384.0

    s2: gl.constexpr = gl.SliceLayout(2, mma)
    kw = (gl.arange(0, WARPS, layout=gl.SliceLayout(1, gl.SliceLayout(1, mma)))[:, None] * 16
          + gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, mma)))[None, :])[:, None, :]
    m_i = gl.full([WARPS, 16], float("-inf"), gl.float32, s2)
    l_i = gl.zeros([WARPS, 16], gl.float32, s2)
    acc = gl.zeros([WARPS, 16, D], gl.float32, mma)
    for j in range(n_blocks):
        async_copy.wait_group(STAGES - 2)
        gl.thread_barrier()
        ahead = lo + (j + STAGES - 1) * BLOCK_N
        _issue3(K, V, k_s, v_s, (j + STAGES - 1) % STAGES, pg_next, ahead, r, c, k_hi, stride_p, stride_s,
                head_off, PAGE)
        pg_next = _page(BlockTable, bt_row, ahead + BLOCK_N, r, k_hi, num_pages, PAGE)
        slot = j % STAGES
        kt = k_s.index(slot).permute((0, 2, 1)).load(b_op).to(gl.float16)
        s_ij = mma_v2(q3, kt, gl.zeros([WARPS, 16, 16], gl.float32, mma)) * qk_scale
        s_ij = gl.where(lo + j * BLOCK_N + kw < k_hi, s_ij, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s_ij, 2))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # a warp whose keys so far are all masked
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(s_ij - m_use[:, :, None])
        l_i = l_i * alpha + gl.sum(p, 2)
        v = v_s.index(slot).load(b_op).to(gl.float16)
        acc = mma_v2(gl.convert_layout((p * c_p).to(gl.float16), a_op), v, acc * alpha[:, :, None])
        m_i = m_new
    async_copy.wait_group(0)

    # the warps' states merged: M = max_w m_w, l = sum_w 2^(m_w - M) l_w, O = sum_w 2^(m_w - M) O_w
    m_all = gl.max(m_i, 0)
    m_u = gl.where(m_all == float("-inf"), 0.0, m_all)
    wgt = gl.exp2(m_i - m_u[None, :])
    l_all = gl.sum(l_i * wgt, 0)
    o_all = gl.sum(acc * wgt[:, :, None], 0)
    ol: gl.constexpr = gl.SliceLayout(0, mma)
    seen = gl.convert_layout(l_all, gl.SliceLayout(1, ol)) != 0
    l_o = gl.convert_layout(l_all, gl.SliceLayout(1, ol))
    m_o = gl.convert_layout(m_all, gl.SliceLayout(1, ol))
    out = gl.where(seen[:, None], o_all * (v_mul / c_p) / gl.where(seen, l_o, 1.0)[:, None], 0.0)
    lse = gl.where(seen, m_o + gl.log2(gl.where(seen, l_o, 1.0)), float("-inf"))
    rows = gl.arange(0, 16, layout=gl.SliceLayout(1, ol))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, ol))
    head = b.to(gl.int64) * stride_db + (h * GQA + rows) * D
    lhead = b.to(gl.int64) * stride_lb + h * GQA + rows
    ok = rows < GQA
    if DIRECT:
        gl.store(Dst + head[:, None] + cols[None, :], out.to(gl.bfloat16), mask=ok[:, None])
        gl.store(DstLse + lhead, lse * 0.6931471805599453, mask=ok)
    else:
        gl.store(Dst + split.to(gl.int64) * stride_ds + head[:, None] + cols[None, :], out, mask=ok[:, None])
        gl.store(DstLse + split.to(gl.int64) * stride_ls + lhead, lse, mask=ok)


@gluon.jit
def _issue3(K, V, k_s, v_s, slot, pg, start, r, c, k_hi, stride_p, stride_s, head_off, PAGE: gl.constexpr):
    """_issue for the [WARPS, 16, D] slots of _paged_decode_w (r: [WARPS, 16] keys)."""
    ok = ((start + r) < k_hi)[:, :, None]
    rows = pg.to(gl.int64) * stride_p + ((start + r) % PAGE) * stride_s + head_off
    off = rows[:, :, None] + c[None, None, :]
    async_copy.async_copy_global_to_shared(k_s.index(slot), K + off, mask=ok)
    async_copy.async_copy_global_to_shared(v_s.index(slot), V + off, mask=ok)
    async_copy.commit_group()


@triton.jit
def _merge(Part, PartLse, Out, Lse, Seqlens, num_pages, n_cap, chunk, stride_ps, stride_pb, stride_ls, stride_lb,
           HKV: tl.constexpr, ROWS: tl.constexpr):
    """The product's _merge_splits for one (KV head, sequence): its used splits (those with keys) in split order."""
    h = tl.program_id(0)
    b = tl.program_id(1)
    n_k = tl.minimum(tl.maximum(tl.load(Seqlens + b), 0), tl.where(num_pages > 0, n_cap, 0))
    n_used = (n_k + chunk - 1) // chunk
    rows = tl.arange(0, ROWS)
    row_real = rows < 4
    offs_d = tl.arange(0, 128)
    o_mask = row_real[:, None]
    head = b.to(tl.int64) * stride_pb + (h * 4 + rows) * 128
    lhead = b.to(tl.int64) * stride_lb + h * 4 + rows
    m = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, 128], dtype=tl.float32)
    for s in range(0, n_used):
        lse_s = tl.load(PartLse + lhead + s * stride_ls, mask=row_real, other=float("-inf"), cache_modifier=".cg")
        o_s = tl.load(Part + head[:, None] + offs_d[None, :] + s * stride_ps, mask=o_mask, other=0.0,
                      cache_modifier=".cg")
        m_new = tl.maximum(m, lse_s)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m - m_use)
        beta = tl.math.exp2(lse_s - m_use)
        acc = acc * alpha[:, None] + o_s * beta[:, None]
        l = l * alpha + beta
        m = m_new
    seen = l != 0
    out = tl.where(seen[:, None], acc / tl.where(seen, l, 1.0)[:, None], 0.0)
    lse = tl.where(seen, (m + tl.math.log2(tl.where(seen, l, 1.0))) * 0.6931471805599453, float("-inf"))
    ob = b.to(tl.int64) * (HKV * 4 * 128) + (h * 4 + rows) * 128
    tl.store(Out + ob[:, None] + offs_d[None, :], out.to(Out.dtype.element_ty), mask=o_mask)
    tl.store(Lse + b.to(tl.int64) * (HKV * 4) + h * 4 + rows, lse, mask=row_real)


_WS = {}


def forward(q, k_cache, v_cache, *, block_table, seqlens_k, k_scale=None, v_scale=None, scale=None, num_splits=1,
            block_n=64, stages=3, num_warps=4, v_cvt=0, f16=0, k_frag=0, wsplit=0):
    """(out [B, Hq, 1, 128] bf16, lse [B, Hq, 1] fp32): the product's forward for this lab's shapes. k_scale /
    v_scale: float32 [Hkv] tensors, floats or None; num_splits the split count (chunks of whole BLOCK_N blocks)."""
    bsz, hq, sq, d = q.shape
    pages, page, hkv, d2 = k_cache.shape
    assert sq == 1 and d == d2 == 128 and hq == 4 * hkv and q.dtype == torch.bfloat16 and q.is_contiguous()
    assert k_cache.dtype == torch.float8_e4m3fn and k_cache.stride() == v_cache.stride() and k_cache.is_contiguous()
    assert page & (page - 1) == 0 and block_n % page == 0 or page % block_n == 0
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    width = block_table.shape[1]
    n_cap = width * page
    chunk = -(-(-(-n_cap // num_splits)) // block_n) * block_n
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
        if key not in _WS:
            _WS[key] = (torch.empty(splits, bsz, hq, 1, 128, dtype=torch.float32, device=q.device),
                        torch.empty(splits, bsz, hq, 1, dtype=torch.float32, device=q.device))
        dst, dlse = _WS[key]
    (_paged_decode_w if wsplit else _paged_decode)[(splits, hkv, bsz)](
        q, k_cache, v_cache, ks, vs, block_table, seqlens_k, dst, dlse, pages, block_table.stride(0), n_cap, chunk,
        scale * 1.4426950408889634, km, vm, k_cache.stride(0), k_cache.stride(1),
        dst.stride(0) if not direct else 0, dst.stride(0) if direct else dst.stride(1),
        dlse.stride(0) if not direct else 0, dlse.stride(0) if direct else dlse.stride(1),
        HKV=hkv, PAGE=page, BLOCK_N=block_n, STAGES=stages, WARPS=num_warps, DIRECT=direct, SCALES=int(per_head),
        V_CVT=v_cvt, F16=f16, K_FRAG=k_frag, num_warps=num_warps)
    if not direct:
        _merge[(hkv, bsz)](dst, dlse, out, lse, seqlens_k, pages, n_cap, chunk, dst.stride(0), dst.stride(1),
                           dlse.stride(0), dlse.stride(1), HKV=hkv, ROWS=16, num_warps=4)
    return out, lse


class Module:
    """The lab kernel as a decode module (forward only) for the bench's prepare_fagen (loader.load replaced)."""

    def __init__(self, **kw):
        self.kw = kw

    def forward(self, q, k, v, *, block_table, seqlens_k, k_scale=None, v_scale=None, scale=None, **_):
        return forward(q, k, v, block_table=block_table, seqlens_k=seqlens_k, k_scale=k_scale, v_scale=v_scale,
                       scale=scale, **self.kw)


def build_sm90(block_n=64, stages=3, num_warps=4, direct=True, v_cvt=0, scales=1, f16=0, k_frag=0, wsplit=0):
    """The kernel built for sm_90 on the CPU: (compiled kernel, ptxas resources)."""
    import os
    import sys
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource as ASTSource
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from sm90 import ptxas
    sig = dict(Q="*bf16", K="*fp8e4nv", V="*fp8e4nv", KScale="*fp32", VScale="*fp32", BlockTable="*i32",
               Seqlens="*i32", Dst="*bf16" if direct else "*fp32", DstLse="*fp32", num_pages="i32", stride_bt="i32",
               n_cap="i32", chunk="i32", qk_scale="fp32", k_mul="fp32", v_mul="fp32", stride_p="i32",
               stride_s="i32", stride_ds="i32", stride_db="i32", stride_ls="i32", stride_lb="i32",
               HKV="constexpr", PAGE="constexpr", BLOCK_N="constexpr", STAGES="constexpr", WARPS="constexpr",
               DIRECT="constexpr", SCALES="constexpr", V_CVT="constexpr", F16="constexpr", K_FRAG="constexpr")
    names = list(sig)
    div = [names.index(n) for n in ("Q", "K", "V", "KScale", "VScale", "BlockTable", "Seqlens", "Dst", "DstLse",
                                    "stride_p", "stride_s", "stride_db", "stride_lb")]
    src = ASTSource(fn=_paged_decode_w if wsplit else _paged_decode, signature=sig,
                    constexprs=dict(HKV=8, PAGE=16, BLOCK_N=block_n, STAGES=stages, WARPS=num_warps, DIRECT=direct,
                                    SCALES=scales, V_CVT=v_cvt, F16=f16, K_FRAG=k_frag),
                    attrs={(i,): [["tt.divisibility", 16]] for i in div})
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 128), options=dict(num_warps=num_warps))
    res = next(iter(ptxas(ck.asm["ptx"])[0].values()))
    return ck, res


if __name__ == "__main__":  # the sm_90 builds on the CPU
    import sys
    cfgs = [tuple(int(x) for x in a.split(",")) for a in sys.argv[1:]] or [
        (64, 3, 4, 0), (64, 3, 8, 0), (64, 3, 8, 1), (128, 3, 8, 1)]
    for bn, st, w, vc in cfgs:
        ck, res = build_sm90(bn, st, w, True, vc)
        ptx = ck.asm["ptx"]
        print(dict(block_n=bn, stages=st, warps=w, v_cvt=vc, regs=res.registers,
                   spills=res.spill_stores + res.spill_loads, smem=ck.metadata.shared,
                   cp_async=ptx.count("cp.async.cg") + ptx.count("cp.async.ca"), mma=ptx.count("mma.sync"),
                   ld_u8=ptx.count("ld.shared.u8") + ptx.count("ld.shared.b8"),
                   ld_shared=ptx.count("ld.shared")), flush=True)
