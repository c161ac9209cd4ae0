"""Lab (not the product): a Gluon MLA absorbed decode for sm_90 (issue 27, the compute-bound shape Hq 128, Sq 2).

q [B, Hq, Sq, 576] bf16, a paged latent cache [num_pages, PAGE, 1, 576] (K is the whole row, V its first 512
columns, read once for both), out [B, Hq, Sq, 512] and lse [B, Hq, Sq] (natural log). Causal as fagen's decode
contract: query i of Sq sees the keys up to seqlens_k - Sq + i.

One CTA = 64 packed query rows (r = h * Sq + i, contiguous in q and out) of one sequence and one split of its keys;
8 warps, one partition, two warpgroups (FlashMLA's first design, read from csrc/sm90/decode, not copied):
  - Q (64 x 576) sits in shared memory for the CTA's life; each key block (BLOCK_N keys, BLOCK_N <= PAGE, one TMA
    load of the latent [BLOCK_N, 512] and one of the rope [BLOCK_N, 64] tile) fills one of STAGES slots.
  - S = Q_c K_c^T + Q_r K_r^T: warps [4, 2], each warpgroup the scores of half the block's keys (no redundant
    score work); the row max and sum reduce across the two warpgroups through shared memory.
  - P (bf16) goes to shared memory; O += P V_c: warps [4, 2] again, each warpgroup 256 of the 512 output columns
    (wgmma n256), V_c being the latent slot S just read.
[Note] Lab schedule. Per key block j (the tensor core runs a warpgroup's wgmma in issue order; P_j and alpha_j,
the softmax of S_j, come from the step before):
    wait P_{j-1} V_{j-1}, issue S_{j+1}        -> O *= alpha_j, P_j to shared memory (2 buffers) under S_{j+1}
    CTA barrier (both warpgroups are past P_{j-1} V_{j-1}: the slot of block j - 1 is free): TMA block
    j - 1 + STAGES into it; issue P_j V_j
    wait S_{j+1} (P_j V_j still runs)          -> softmax_{j+1} under P_j V_j
so the tensor core has S_{j+1} while the warps rescale O and store P, and P_j V_j while they run the next softmax.
A step issues S_{j+1} and waits for it itself, and the only wgmma in flight across the loop's back edge is P_j V_j,
which the next step waits for first: with S_{j+1} issued in one step and awaited (wait_group 1) in the next,
ptxas could not tell that the softmax reads retired registers and serialised every wgmma of the kernel (C7514
"wgmma.mma_async instructions are serialized", a WARPGROUP.DEPBAR after each of the 112 HGMMA; sm_90 ptxas of
triton 3.6). Block j + 1's load is issued STAGES - 2 steps before its S. The last block issues a dummy S on its
own slot whose softmax masks every key (no change to m, l) so that the loop body has no branch around a wgmma.
[Note] Lab two slots. With STAGES 2 (64-key blocks: Q 72 KB + 2 x 72 KB) block j + 1 goes into block j - 1's slot,
free only once both warpgroups have retired P_{j-1} V_{j-1}: a CTA barrier there, the TMA load, and S_{j+1} waits
for it (the load's latency is not hidden); one P buffer (a second does not fit), free behind the same barrier.
Worth it only if the scores' wgmma n32 per warpgroup (against n16 at 32-key blocks, where each warpgroup's
k-steps read Q's 2 KB from shared memory for 8 cycles of math) beats the exposed load.
[Note] Lab tail. Keys past a sequence's length in its last page hold anything (the GPU check fills them with NaN):
S masks them to -inf before the exp2, but P V would compute 0 * NaN, so the block that holds the sequence end
zeroes those latent rows in shared memory before its P V (once per sequence).
Splits (flash decoding): split s of NUM_SPLITS takes key blocks [s * per, (s + 1) * per) of the sequence's
ceil(len / BLOCK_N), per = ceil(blocks / NUM_SPLITS); with one split the kernel writes out/lse itself, otherwise
fp32 partials and log2 lse go to a workspace that _merge combines.
The seesaw variant ("ss": FlashMLA's schedule, two warp-specialised warpgroups) is lab/gluon_mla_decode_ss.py.
"""
import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, \
    warpgroup_mma_init, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

D, DV, DR = 576, gl.constexpr(512), gl.constexpr(64)  # q/k width, latent (V) width, rope width
ROWS_PER_CTA = 64
VARIANTS = {  # name -> (BLOCK_N, STAGES); shared memory: Q 72 KB + STAGES x BLOCK_N x 1152 B + P
    "n64s2": (64, 2),  # 224 KB ([Note] Lab two slots: one P buffer)
    "n32s4": (32, 4),  # 224 KB
    "n32s3": (32, 3),  # 188 KB
    "n16s8": (16, 8),  # 220 KB
    "n16s6": (16, 6),  # 184 KB
}
DEFAULT = "n32s4"


@gluon.constexpr_function
def _mma(n):
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, n, 16])


@gluon.jit
def _issue(kc_desc, kr_desc, kc_s, kr_s, k_bar, page, j, k_lo, BLOCK_N: gl.constexpr, PAGE: gl.constexpr,
           STAGES: gl.constexpr):
    """TMA loads of key block j (of this split; its page number loaded) into slot j % STAGES: the latent and rope
    tiles of BLOCK_N cache rows."""
    start = k_lo + j * BLOCK_N
    row = page * PAGE + start % PAGE
    st = j % STAGES
    mbarrier.expect(k_bar.index(st), kc_desc.block_type.nbytes + kr_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(kc_desc, [row, 0], k_bar.index(st), kc_s.index(st))
    tma.async_copy_global_to_shared(kr_desc, [row, DV], k_bar.index(st), kr_s.index(st))


@gluon.jit
def _scores(qc_s, qr_s, kc_s, kr_s, st, BLOCK_N: gl.constexpr):
    """Issue S = Q_c K_c^T + Q_r K_r^T on slot st (asynchronous; the token of the second)."""
    s_layout: gl.constexpr = _mma(BLOCK_N // 2)
    z = st >> 30  # [Note] Seesaw descriptors: Q's indexed by a value the compiler cannot fold
    tok = warpgroup_mma(qc_s.index(z), kc_s.index(st).permute((1, 0)),
                        gl.zeros([64, BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True)
    return warpgroup_mma(qr_s.index(z), kr_s.index(st).permute((1, 0)), tok, is_async=True)


@gluon.jit
def _zero_tail(kc_s, st, valid, BLOCK_N: gl.constexpr):
    """[Note] Lab tail: latent rows >= valid of slot st become 0 (generic-proxy writes; the caller fences)."""
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])
    x = kc_s.index(st).load(ld)
    r = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld))
    kc_s.index(st).store(gl.where(r[:, None] < valid, x, gl.zeros_like(x)))


@gluon.jit
def _softmax(s_acc, m_i, l_acc, k0, lim, qk_scale, BLOCK_N: gl.constexpr):
    """Online softmax of the scores of keys [k0, k0 + BLOCK_N) in the log2 domain; row r sees keys <= lim[r]
    (masked scores are -inf before the exp2; a row with no key yet keeps a finite stand-in for its max).
    [Note] Lab row sums: l is kept as a [64, BLOCK_N] tile of per-column running sums (l_acc = l_acc * alpha + p,
    elementwise; blocks of up to 32 keys) and summed over its columns once after the loop: a row sum each step would be a reduction across
    the two warpgroups (3 CTA barriers a step in the sm_90 PTX), the max's is the only one left."""
    s_layout: gl.constexpr = _mma(BLOCK_N // 2)
    cols = k0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    s = gl.where(cols[None, :] <= lim[:, None], s_acc * qk_scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(s - m_use[:, None])
    alpha = gl.exp2(m_i - m_use)
    if BLOCK_N <= 32:
        l_acc = l_acc * alpha[:, None] + p
    else:  # the tile would cost registers (sm_90 ptxas at 64-key blocks: 140 spilled words)
        l_acc = l_acc * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_acc


@gluon.jit
def _next_scores(qc_s, qr_s, kc_s, kr_s, k_bar, j, n_blocks, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Issue S_{j+1} once its slot is loaded ([Note] Lab schedule: the last block's is a dummy on its own slot)."""
    nxt = gl.minimum(j + 1, n_blocks - 1)
    mbarrier.wait(k_bar.index(nxt % STAGES), (nxt // STAGES) & 1)
    return _scores(qc_s, qr_s, kc_s, kr_s, nxt % STAGES, BLOCK_N)


@gluon.jit
def _stage_p(kc_s, p_s, p, j, k_lo, seq_len, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, P_BUFS: gl.constexpr):
    """P_j (bf16) into P buffer j % P_BUFS (its last reader, P_{j-2} V_{j-2} or with one buffer P_{j-1} V_{j-1}
    behind the barrier of [Note] Lab two slots, is done), the tail rows of block j's
    latent slot zeroed ([Note] Lab tail), a fence for the async proxy, then a CTA barrier: after it both warpgroups
    have stored P_j and retired P_{j-1} V_{j-1}."""
    end = k_lo + (j + 1) * BLOCK_N
    if end > seq_len:
        _zero_tail(kc_s, j % STAGES, seq_len - (end - BLOCK_N), BLOCK_N)
    p_s.index(j % P_BUFS).store(p.to(p_s.dtype))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit(do_not_specialize=["stride_bt", "num_splits"])
def _mla_decode(qc_desc, qr_desc, kc_desc, kr_desc, BlockTable, Seqlens, Out, Lse, PartO, PartLse, stride_bt,
                qk_scale, num_splits, ROWS: gl.constexpr, SQ: gl.constexpr, BLOCK_N: gl.constexpr,
                STAGES: gl.constexpr, PAGE: gl.constexpr, CAUSAL: gl.constexpr, DIRECT: gl.constexpr,
                P_BUFS: gl.constexpr):
    gl.static_assert(PAGE % BLOCK_N == 0)
    gl.static_assert(STAGES >= 2)  # [Note] Lab schedule, [Note] Lab two slots
    gl.static_assert(P_BUFS == 1 or P_BUFS == 2)
    gl.static_assert(ROWS % 64 == 0)
    tile = gl.program_id(0)
    split = gl.program_id(1)
    b = gl.program_id(2)
    dtype: gl.constexpr = qc_desc.dtype
    s_layout: gl.constexpr = _mma(BLOCK_N // 2)
    o_layout: gl.constexpr = _mma(256)
    srow: gl.constexpr = gl.SliceLayout(1, s_layout)
    orow: gl.constexpr = gl.SliceLayout(1, o_layout)

    qc_s = gl.allocate_shared_memory(dtype, [1, 64, DV], qc_desc.layout)
    qr_s = gl.allocate_shared_memory(dtype, [1, 64, DR], qr_desc.layout)
    kc_s = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, DV], kc_desc.layout)
    kr_s = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, DR], kr_desc.layout)
    p_s = gl.allocate_shared_memory(dtype, [P_BUFS, 64, BLOCK_N], gl.NVMMASharedLayout.get_default_for([64, BLOCK_N], dtype))
    q_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    k_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar.index(0), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_bar.index(i), count=1)
    fence_async_shared()

    seq_len = gl.load(Seqlens + b)
    n_all = (seq_len + BLOCK_N - 1) // BLOCK_N
    per = (n_all + num_splits - 1) // num_splits
    j_lo = gl.minimum(split * per, n_all)
    n_blocks = gl.minimum(n_all - j_lo, per)
    k_lo = j_lo * BLOCK_N
    bt_row = b.to(gl.int64) * stride_bt
    q_row = b * ROWS + tile * 64

    mbarrier.expect(q_bar.index(0), qc_desc.block_type.nbytes + qr_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(qc_desc, [q_row, 0], q_bar.index(0), qc_s.index(0))
    tma.async_copy_global_to_shared(qr_desc, [q_row, DV], q_bar.index(0), qr_s.index(0))
    for i in gl.static_range(STAGES):
        if i < n_blocks:
            page0 = gl.load(BlockTable + bt_row + (k_lo + i * BLOCK_N) // PAGE)
            _issue(kc_desc, kr_desc, kc_s, kr_s, k_bar, page0, i, k_lo, BLOCK_N, PAGE, STAGES)

    rows = tile * 64 + gl.arange(0, 64, layout=srow)
    if CAUSAL:
        lim = seq_len - SQ + rows % SQ  # the last key each row sees
    else:
        lim = gl.full([64], 0, gl.int32, srow) + (seq_len - 1)
    m_i = gl.full([64], float("-inf"), gl.float32, srow)
    if BLOCK_N <= 32:
        l_acc = gl.zeros([64, BLOCK_N], gl.float32, s_layout)  # [Note] Lab row sums
    else:
        l_acc = gl.zeros([64], gl.float32, srow)
    o_acc = gl.zeros([64, DV], gl.float32, o_layout)
    mbarrier.wait(q_bar.index(0), 0)
    if n_blocks > 0:
        mbarrier.wait(k_bar.index(0), 0)
        s_tok = _scores(qc_s, qr_s, kc_s, kr_s, 0, BLOCK_N)
        s_acc = warpgroup_mma_wait(0, deps=(s_tok, ))
        p, alpha, m_i, l_acc = _softmax(s_acc, m_i, l_acc, k_lo, lim, qk_scale, BLOCK_N)
        o_tok = warpgroup_mma_init(o_acc)  # [Note] Lab schedule: the loop carries P_j V_j in flight
        for j in range(n_blocks):
            refill = j - 1 + STAGES  # the block whose TMA load this step issues, into the slot of block j - 1
            page = gl.load(BlockTable + bt_row + (k_lo + gl.minimum(refill, n_blocks - 1) * BLOCK_N) // PAGE)
            o_acc = warpgroup_mma_wait(0, deps=(o_tok, ))  # this warpgroup's P_{j-1} V_{j-1} done
            if STAGES == 2:  # [Note] Lab two slots: block j + 1 goes into block j - 1's slot now, S_{j+1} waits
                gl.thread_barrier()
                if j >= 1:
                    if refill < n_blocks:
                        _issue(kc_desc, kr_desc, kc_s, kr_s, k_bar, page, refill, k_lo, BLOCK_N, PAGE, STAGES)
            s_tok = _next_scores(qc_s, qr_s, kc_s, kr_s, k_bar, j, n_blocks, BLOCK_N, STAGES)
            o_acc = o_acc * gl.convert_layout(alpha, orow)[:, None]
            _stage_p(kc_s, p_s, p, j, k_lo, seq_len, BLOCK_N, STAGES, P_BUFS)  # ends with a CTA barrier
            if STAGES >= 3:
                if j >= 1:
                    if refill < n_blocks:  # both warpgroups are past P_{j-1} V_{j-1}: block j - 1's slot is free
                        _issue(kc_desc, kr_desc, kc_s, kr_s, k_bar, page, refill, k_lo, BLOCK_N, PAGE, STAGES)
            o_tok = warpgroup_mma(p_s.index(j % P_BUFS), kc_s.index(j % STAGES), o_acc, is_async=True)
            s_acc = warpgroup_mma_wait(1, deps=(s_tok, ))  # S_{j+1} done; P_j V_j runs under the softmax
            k_next = gl.where(j + 1 < n_blocks, k_lo + (j + 1) * BLOCK_N, 1 << 30)  # the dummy: every key masked
            p, alpha, m_i, l_acc = _softmax(s_acc, m_i, l_acc, k_next, lim, qk_scale, BLOCK_N)
        o_acc = warpgroup_mma_wait(0, deps=(o_tok, ))

    if BLOCK_N <= 32:
        l_i = gl.sum(l_acc, 1)
    else:
        l_i = l_acc
    l_safe = gl.where(l_i == 0.0, 1.0, l_i)
    out = o_acc / gl.convert_layout(l_safe, orow)[:, None]
    m_fin = gl.where(m_i == float("-inf"), 0.0, m_i)  # a row that saw no key: l = 0, lse = -inf, out = 0
    lse2 = gl.where(l_i == 0.0, float("-inf"), m_fin + gl.log2(l_safe))
    orows = tile * 64 + gl.arange(0, 64, layout=orow)
    ocols = gl.arange(0, DV, layout=gl.SliceLayout(0, o_layout))
    if DIRECT:
        gl.store(Out + (b * ROWS + orows).to(gl.int64)[:, None] * DV + ocols[None, :], out.to(Out.dtype.element_ty))
        gl.store(Lse + b * ROWS + rows, lse2 * 0.6931471805599453)
    else:
        prow = (b * num_splits + split) * ROWS
        gl.store(PartO + (prow + orows).to(gl.int64)[:, None] * DV + ocols[None, :], out)
        gl.store(PartLse + prow + rows, lse2)


@triton.jit
def _merge(PartO, PartLse, Out, Lse, ROWS: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_R: tl.constexpr,
           DV_: tl.constexpr):
    """out = sum_s w_s o_s / sum_s w_s, w_s = 2^(lse2_s - max), lse = (max + log2 sum w) ln 2; empty splits have
    lse2 -inf and o 0."""
    b = tl.program_id(1)
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.arange(0, DV_)
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        m = tl.maximum(m, tl.load(PartLse + (b * NUM_SPLITS + s) * ROWS + r))
    m_use = tl.where(m == float("-inf"), 0.0, m)
    acc = tl.zeros([BLOCK_R, DV_], tl.float32)
    den = tl.zeros([BLOCK_R], tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        prow = (b * NUM_SPLITS + s) * ROWS
        w = tl.exp2(tl.load(PartLse + prow + r) - m_use)
        den += w
        acc += w[:, None] * tl.load(PartO + (prow + r).to(tl.int64)[:, None] * DV_ + c[None, :])
    den_safe = tl.where(den == 0.0, 1.0, den)
    out = acc / den_safe[:, None]
    tl.store(Out + (b * ROWS + r).to(tl.int64)[:, None] * DV_ + c[None, :], out.to(Out.dtype.element_ty))
    tl.store(Lse + b * ROWS + r, tl.where(den == 0.0, float("-inf"), (m_use + tl.log2(den_safe)) * 0.6931471805599453))


def _descs(q, cache, block_n):
    """TMA descriptors: q as [B * Hq * Sq, 576] and the cache as [num_pages * PAGE, 576] rows, each read as a latent
    box [rows, 512] at column 0 and a rope box [rows, 64] at column 512."""
    gdt = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[q.dtype]
    q2 = q.view(-1, D)
    c2 = cache.view(-1, D)

    def desc(t, rows, cols):
        layout = gl.NVMMASharedLayout.get_default_for([rows, cols], gdt)
        return TensorDescriptor(t, list(t.shape), list(t.stride()), [rows, int(cols)], layout)
    return desc(q2, 64, DV), desc(q2, 64, DR), desc(c2, block_n, DV), desc(c2, block_n, DR)


def _args(q, cache, block_table, seqlens_k, scale, variant, num_splits, causal):
    bsz, hq, sq, d = q.shape
    block_n, stages = VARIANTS[variant]
    page = cache.shape[1]
    rows = hq * sq
    direct = num_splits == 1
    out = torch.empty((bsz, hq, sq, DV), dtype=q.dtype, device=q.device)
    lse = torch.empty((bsz, hq, sq), dtype=torch.float32, device=q.device)
    if direct:
        part_o, part_lse = out, lse
    else:
        part_o = torch.empty((bsz * num_splits * rows, DV), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((bsz * num_splits * rows, ), dtype=torch.float32, device=q.device)
    args = (*_descs(q, cache, block_n), block_table, seqlens_k, out, lse, part_o, part_lse, block_table.stride(0),
            scale * 1.4426950408889634, num_splits)
    kw = dict(ROWS=rows, SQ=sq, BLOCK_N=block_n, STAGES=stages, PAGE=page, CAUSAL=causal, DIRECT=direct,
              P_BUFS=2 if stages >= 3 else 1)
    return args, kw, out, lse, part_o, part_lse


def mla_decode(q, cache, block_table, seqlens_k, scale, variant=DEFAULT, num_splits=1, causal=True):
    """out [B, Hq, Sq, 512], lse [B, Hq, Sq] of the absorbed decode; q [B, Hq, Sq, 576] contiguous bf16 with
    Hq * Sq a multiple of 64, cache [num_pages, PAGE, 1, 576] contiguous, block_table int32 [B, max_pages],
    seqlens_k int32 [B]."""
    bsz, hq, sq, d = q.shape
    assert d == D and cache.shape[-1] == D and cache.shape[2] == 1 and (hq * sq) % ROWS_PER_CTA == 0
    assert q.is_contiguous() and cache.is_contiguous() and q.dtype == cache.dtype
    rows = hq * sq
    if variant == "ss":  # [Note] Seesaw pair in lab/gluon_mla_decode_ss.py
        from lab.gluon_mla_decode_ss import _args_ss, _mla_decode_ss
        args, kw, out, lse, part_o, part_lse = _args_ss(q, cache, block_table, seqlens_k, scale, num_splits, causal)
        _mla_decode_ss[(rows // ROWS_PER_CTA, num_splits, bsz)](*args, **kw, num_warps=4)
    else:
        args, kw, out, lse, part_o, part_lse = _args(q, cache, block_table, seqlens_k, scale, variant, num_splits,
                                                     causal)
        _mla_decode[(rows // ROWS_PER_CTA, num_splits, bsz)](*args, **kw, num_warps=8)
    if num_splits > 1:
        _merge[(rows // 16, bsz)](part_o, part_lse, out, lse, ROWS=rows, NUM_SPLITS=num_splits, BLOCK_R=16, DV_=DV,
                                  num_warps=4)
    return out, lse


def compile_for(variant=DEFAULT, hq=128, sq=2, page=64, num_splits=1, causal=True):
    """Build the kernel for sm_90 without a GPU (triton's bundled ptxas); returns the CompiledKernel."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    q = torch.empty((2, hq, sq, D), dtype=torch.bfloat16)
    cache = torch.empty((8, page, 1, D), dtype=torch.bfloat16)
    table = torch.zeros((2, 4), dtype=torch.int32)
    lens = torch.zeros((2, ), dtype=torch.int32)
    if variant == "ss":
        from lab.gluon_mla_decode_ss import _args_ss, _mla_decode_ss
        fn, warps = _mla_decode_ss, 4
        args, kw, *_ = _args_ss(q, cache, table, lens, 0.1, num_splits, causal)
    else:
        fn, warps = _mla_decode, 8
        args, kw, *_ = _args(q, cache, table, lens, 0.1, variant, num_splits, causal)
    names = list(fn.arg_names)[:len(args)]
    signature = {n: mangle_type(a) for n, a in zip(names, args)}
    signature.update({n: "constexpr" for n in kw})
    src = GluonASTSource(fn=fn, signature=signature, constexprs=kw)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
