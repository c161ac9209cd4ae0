"""The window render's fixed-point backward on a fast host path (eleventh session; [Note] Window fixed-point fast
path below).

Static code: gluon/backward.py.j2 includes everything below the marker line verbatim after host/gluon_bwd_launch.py,
in renders with a window switch and the fixed-point dQ's qmul rows by TMA (variant bwd_window_fixed 1 with
bwd_fixed_tma 1). The names above the marker are defined by the including module; the lines below define them only
for linters and readers.
"""
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from fagen.templates.host.gluon_launch import _gluon
from fagen.templates.host.launch import _fast, _raw_stream

BWD_BLOCK_M = BWD_BLOCK_N = HEAD_DIM = GQA = BWD_KV_SPLIT = BWD_DET_GRID = BWD_GRID_ALL = BWD_RING_SLOTS = 0
BWD_COMPUTE_REGS = BWD_PRODUCER_REGS = BWD_WRITER_REGS = BWD_WARPS = BWD_WINDOW = CAUSAL = _BWD_FAST = 0
_NUM_SMS, _BWD_WS, _fast_bwd_kernels = {}, None, {}
_bwd_preprocess = _dq_convert = _descriptor = _bwd_host = _BWD_WS_KEEP = _run_backward_fast = None
_thread_local = object
# -- fagen: included verbatim below this line --


# [Note] Window fixed-point fast path
# The window render with the fixed-point dQ and its qmul rows by TMA (bwd_window_fixed 1, bwd_fixed_tma 1) went down
# the plain host path (_run_backward): the fast path's workspace had no qmul rows (BWD_FIXED_FAST 0), and the bound
# the unit is taken from (_bwd_kv_bound: k.abs().amax, vector_norm(v).amax, a stack: five torch launches and about
# 37 us of kernels at the bench's window, B1 H16 S8192 d128) ran before the preprocess. At ~0.5 ms a call those
# weigh. Here (_BWD_WINDOW_FAST, off until a GPU round shows the win):
#   - one kept float32 buffer per (device, stream), laid out [dQ accumulator | KVB (2 B Hkv, padded to 4) | delta |
#     qmul | lse2]: the accumulator and KVB zeroed by one fill; delta and qmul adjacent, so the main kernel's row
#     descriptor spans both ([Note] qmul rows by TMA: qmul of (batch, head) at row B Hq + batch Hq + head);
#   - the bound by one kernel, _bwd_kv_bound_rows: each program reads 64 rows of K and V of one (batch, KV head)
#     and atomic-maxes max|K| and max_j |V_j|_2 into KVB (non-negative floats: max is order-free, so the result is
#     the same bits in any order; a NaN in K or V becomes +inf, whose qmul is NaN, as the plain path's NaN bound
#     makes it). The norms are float32 sums of squares, where the plain path's vector_norm rounds each norm to V's
#     dtype: the two bounds may differ in the last bits, so the unit e = ceil(log2(2 bound)) may differ where the
#     bound sits at a power of two (both are bounds: the factor 2 holds either rounding);
#   - every launch by _gluon / _fast: the pre- and postprocess through two wrappers that take QMul and KVB
#     positionally (_bwd_preprocess_w, _dq_convert_w: their bodies the render's _bwd_preprocess and _dq_convert,
#     inlined), since _gluon's key takes keyword values as constexprs; the plain path and the fast path's mode 2
#     launched them through fn[grid] (tens of microseconds of host time each, before the main kernel's launch).
# The kernels, grids and arguments are the plain path's (tests/test_gluon_bwd_window_fast.py, with fakes), so the
# gradients are bitwise repeatable and equal the plain path's wherever the two bounds give the same units.
import triton.language as tl  # noqa: E402

# On since round A of the eleventh session (H100, the bench's sliding window: 0.533 ms a backward against 1.306 on
# the plain host path, the same kernels; gradients bit for bit the plain path's at windows (37, 0) and (130, 0)).
_BWD_WINDOW_FAST = True


@triton.jit
def _bwd_kv_bound_rows(K, V, KVB, seq_k, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    """KVB[bh] = max(KVB[bh], (max|K|, max_j |V_j|_2)) over rows [BLOCK * program, + BLOCK) of head bh = program 1
    of K, V contiguous [B, Hkv, Sk, HEAD_DIM]; NaN counts as +inf ([Note] Window fixed-point fast path)."""
    bh = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, HEAD_DIM)
    offs = bh.to(tl.int64) * seq_k * HEAD_DIM + rows[:, None] * HEAD_DIM + cols[None, :]
    inside = rows[:, None] < seq_k
    k = tl.abs(tl.load(K + offs, mask=inside, other=0.0).to(tl.float32))
    v = tl.load(V + offs, mask=inside, other=0.0).to(tl.float32)
    kn = tl.sum(tl.sum((k != k).to(tl.int32), 1), 0)
    vs = tl.sum(v * v, 1)
    vn = tl.sum((vs != vs).to(tl.int32), 0)
    kmax = tl.where(kn > 0, float("inf"), tl.max(tl.max(k, 1), 0))
    vmax = tl.where(vn > 0, float("inf"), tl.sqrt(tl.max(vs, 0)))
    tl.atomic_max(KVB + bh * 2, kmax)
    tl.atomic_max(KVB + bh * 2 + 1, vmax)


@gluon.jit(do_not_specialize=["seq_q", "sq_pad"])
def _bwd_preprocess_w(O, DO, Lse, Delta, Lse2, seq_q, sq_pad, QMul, KVB, HEAD_DIM: gl.constexpr,
                      BLOCK_M: gl.constexpr, GQA: gl.constexpr):
    """_bwd_preprocess with the qmul rows, QMul and KVB positional ([Note] Window fixed-point fast path)."""
    _bwd_preprocess(O, DO, Lse, Delta, Lse2, seq_q, sq_pad, HEAD_DIM, BLOCK_M, QMul, KVB, GQA)


@gluon.jit(do_not_specialize=["seq_q", "sq_pad"])
def _dq_convert_w(DQacc, DQ, scale, seq_q, sq_pad, QMul, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr):
    """_dq_convert of the int32 accumulator, QMul positional ([Note] Window fixed-point fast path)."""
    _dq_convert(DQacc, DQ, scale, seq_q, sq_pad, HEAD_DIM, BLOCK_M, QMul)


_fast_kv_bound = _fast(_bwd_kv_bound_rows)
# the bound kernel's rows a program and warps (H100, K and V of B1 H16 S8192 d128 bf16, 64 MB: round A 64 / 4 0.036
# ms; round B of scripts/gpu_window_s11.py 64/4 0.039, 32/4 0.038, 64/8 0.039, 128/8 0.040, 32/2 and 16/2 0.041:
# none moves it, about 1.7 TB/s)
_BWD_BOUND_ROWS, _BWD_BOUND_WARPS = 64, 4
_fast_pre_w, _fast_conv_w = _gluon(_bwd_preprocess_w), _gluon(_dq_convert_w)
_BWD_WWS = _thread_local()  # per thread: (device, stream) -> [buffer, {(b, hq, hkv, sq_pad): views}]


def _bwd_window_views(buf, b, hq, hkv, sq_pad):
    """(zeroed part, KVB [B * Hkv * 2], delta and qmul [2 * B * Hq, sq_pad], delta, qmul, lse2 (2-D), int32
    accumulator) over buf ([Note] Window fixed-point fast path); every part on a 16-byte boundary."""
    rows = b * hq * sq_pad
    acc, nk = rows * HEAD_DIM, -(-(2 * b * hkv) // 4) * 4
    dm = buf[acc + nk:acc + nk + 2 * rows].view(2 * b * hq, sq_pad)
    return (buf[:acc + nk], buf[acc:acc + 2 * b * hkv], dm, dm[:b * hq], dm[b * hq:],
            buf[acc + nk + 2 * rows:acc + nk + 3 * rows].view(b * hq, sq_pad),
            buf[:acc].view(torch.int32).view(b, hq, sq_pad, HEAD_DIM))


def _bwd_window_workspace(b, hq, hkv, sq_pad, q):
    """The views of one backward on q's device, the zeroed part zeroed on the current stream (a fresh buffer while
    a CUDA graph captures, or past _BWD_WS_KEEP bytes)."""
    n = b * hq * sq_pad * (HEAD_DIM + 3) + -(-(2 * b * hkv) // 4) * 4
    if torch.cuda.is_current_stream_capturing() or 4 * n > _BWD_WS_KEEP:
        views = _bwd_window_views(q.new_empty(n, dtype=torch.float32), b, hq, hkv, sq_pad)
    else:
        device = q.get_device()
        key, cache = (device, _raw_stream(device)), _BWD_WWS.__dict__
        kept = cache.get(key)
        if kept is None or kept[0].numel() < n:
            kept = cache[key] = [q.new_empty(max(n, 1 << 16), dtype=torch.float32), {}]
        shape = (b, hq, hkv, sq_pad)
        views = kept[1].get(shape)
        if views is None:
            if len(kept[1]) >= 256:
                kept[1].clear()
            views = kept[1][shape] = _bwd_window_views(kept[0], b, hq, hkv, sq_pad)
    views[0].zero_()
    return views


def _run_backward_window(do, q, k, v, out, lse, scale, dq, dk, dv, qk_scale, extra):
    """Mode 2 of a window render with the qmul rows by TMA, on the fast path ([Note] Window fixed-point fast path):
    _run_backward's kernels, grids and arguments."""
    b, hq, sq, _ = q.shape
    hkv, sk = k.shape[1] * BWD_KV_SPLIT, k.shape[2]
    sq_pad = -(-sq // BWD_BLOCK_M) * BWD_BLOCK_M
    dev = q.get_device()
    _, kvb, dm, delta, qmul, lse2, dq_acc = _bwd_window_workspace(b, hq, k.shape[1], sq_pad, q)
    _fast_kv_bound[(-(-sk // _BWD_BOUND_ROWS), b * k.shape[1])](k, v, kvb, sk, HEAD_DIM=HEAD_DIM, BLOCK=_BWD_BOUND_ROWS,
                                                               num_warps=_BWD_BOUND_WARPS)
    _fast_pre_w[(sq_pad // BWD_BLOCK_M, b * hq)](out, do, lse, delta, lse2, sq, sq_pad, qmul, kvb, HEAD_DIM=HEAD_DIM,
                                                 BLOCK_M=BWD_BLOCK_M, GQA=GQA, num_warps=4)
    num_bh = b * hkv
    num_tiles = -(-sk // BWD_BLOCK_N) * num_bh
    if dev not in _NUM_SMS:
        _NUM_SMS[dev] = torch.cuda.get_device_properties(dev).multi_processor_count
    kernel, epi_tma = _fast_bwd_kernels[2]
    if epi_tma:
        dk, dv = _descriptor(dk, BWD_BLOCK_N // 2), _descriptor(dv, BWD_BLOCK_N // 2)
    kernel[(num_tiles if BWD_DET_GRID or BWD_GRID_ALL else min(num_tiles, _NUM_SMS[dev]), )](
        _descriptor(q, BWD_BLOCK_M), _descriptor(do, BWD_BLOCK_M), _descriptor(k, BWD_BLOCK_N),
        _descriptor(v, BWD_BLOCK_N), (lse2, (1, BWD_BLOCK_M)), (dm, (1, BWD_BLOCK_M)),
        (dq_acc, (1, 1, BWD_BLOCK_M, HEAD_DIM // 2)), dk, dv, qmul,
        scale * 1.4426950408889634 if qk_scale is None else qk_scale, scale, num_tiles, num_bh, hkv, sq, sk, sq_pad,
        *extra, HEAD_DIM=HEAD_DIM, BLOCK_M=BWD_BLOCK_M, BLOCK_N=BWD_BLOCK_N, STAGES=BWD_RING_SLOTS,
        GQA=GQA // BWD_KV_SPLIT, CAUSAL=CAUSAL, DQ_MODE=2, COMPUTE_REGS=BWD_COMPUTE_REGS,
        PRODUCER_REGS=BWD_PRODUCER_REGS, WRITER_REGS=BWD_WRITER_REGS, num_warps=BWD_WARPS,
    )
    _fast_conv_w[(sq_pad // BWD_BLOCK_M, b * hq)](dq_acc, dq, scale, sq, sq_pad, qmul, HEAD_DIM=HEAD_DIM,
                                                  BLOCK_M=BWD_BLOCK_M, num_warps=4)


_bwd_host_general = _bwd_host


def _bwd_host(do, q, k, v, out, lse, scale, dq, dk, dv, dq_mode, *more, **options):
    """_BWD_WINDOW_FAST: mode 2 of this render on the window's fast path ([Note] Window fixed-point fast path), mode
    1 (deterministic=False) on the fast path's unordered launches (as _BWD_FAST_SWITCHES takes them); everything
    else as host/gluon_bwd_launch.py's _bwd_host."""
    if _BWD_WINDOW_FAST and _BWD_FAST and len(more) == 2 and not options:
        if dq_mode == 2:
            return _run_backward_window(do, q, k, v, out, lse, scale, dq, dk, dv, *more)
        if dq_mode == 1:
            return _run_backward_fast(do, q, k, v, out, lse, scale, dq, dk, dv, 1, *more)
    return _bwd_host_general(do, q, k, v, out, lse, scale, dq, dk, dv, dq_mode, *more, **options)
