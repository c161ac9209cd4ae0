"""The Gluon backward's fast host path: workspaces kept per stream, every launch through _gluon ([Note] Gluon fast
launches).

Static code: gluon/backward.py.j2 includes everything below the marker line verbatim, after its _run_backward (the
plain host path, kept as the reference and for scripts/gpu_gluon_bwd_host.py) and before _launch_backward, which
calls _bwd_host. The names above the marker are defined by the including module (gluon/attention.py.j2 with
host/launch.py and host/gluon_launch.py, gluon/backward.py.j2); the lines below define them only for linters and
readers.
"""
import os

import torch
import triton
from triton.experimental.gluon import language as gl

from fagen.templates.host.gluon_launch import _GL_DTYPE, _expand, _gluon
from fagen.templates.host.launch import _Tensor, _fast, _launch_entry, _raw_stream

BWD_BLOCK_M = BWD_BLOCK_N = HEAD_DIM = GQA = CAUSAL = BWD_RING_SLOTS = BWD_WARPS = BWD_KV_SPLIT = BWD_GRID_ALL = 0
BWD_COMPUTE_REGS = BWD_PRODUCER_REGS = BWD_WRITER_REGS = BWD_DET_GRID = BWD_WINDOW = BWD_FIXED_FAST = BWD_PREFIX = 0
BWD_FIXED_TMA = BWD_WIN_CHAIN = BWD_WIN_PDL = BWD_TAIL = _BWD_TAIL_SMS = _BWD_SECTIONS = 0
_NUM_SMS, _BWD_KERNELS, _PRE_KW, _CONV_KW = {}, {}, {}, {}
_bwd_preprocess = _dq_convert = _run_backward = _descriptor = _bwd_win_visited = _dq_convert_chain = None
_bwd_tail_plan = _bwd_tail_sum = _bwd_tail_part = None
# -- fagen: included verbatim below this line --


# [Note] Gluon backward host path
# A backward is three launches (preprocess, the main kernel, the dQ conversion) and four workspaces: delta and lse2
# (float32 [B * Hq, sq_pad]), the float32 dQ accumulator [B, Hq, sq_pad, D] and the int32 turn counters of the
# fixed-order dQ ([Note] Fixed-order dQ), both of which must be zero when the main kernel starts. The plain path
# (_run_backward) allocates the four per call (two of them torch.zeros: an allocation and a fill launch each), builds
# seven to nine TensorDescriptors and dispatches every kernel through fn[grid]: about 200 us of host time per call
# on the H100 beyond the Triton backward's. Here:
#   - every launch goes through _gluon ([Note] Gluon fast launches): descriptor requests (tensor, box), whose
#     default NVMMA layouts are the template's (the accumulator's 128-byte swizzle, the rows' none: a test checks);
#   - the workspaces are one float32 buffer per (device, stream), laid out [dQ accumulator | counters | delta |
#     qmul rows | lse2] (mode 2's delta and qmul rows adjacent: [Note] Fixed-point dQ on the fast path), the
#     first two zeroed by one fill launch per call, kept per thread as the decode workspace is ([Note] Decode
#     workspace). Launches on one stream run in order, so a call's fill waits for the previous call's dQ
#     conversion (the last reader of the accumulator); another stream has its own buffer, and so has another
#     thread (whose launches could interleave with this one's on a shared stream). The buffer grows to the
#     largest call seen up to _BWD_WS_KEEP bytes; a larger call allocates its own (its host time is small beside
#     its kernel's). The views of a (shape, mode) are kept with the buffer
#     (a view costs a microsecond or two), so a warm call makes no tensor but the outputs;
#   - while a CUDA graph is being captured the buffer is fresh from the caching allocator (the graph's pool owns
#     it) and zeroed by a captured fill, as the forward's tile counter is ([Note] Tile counter): no graph holds the
#     address of a buffer that a later eager call would reuse or replace.
# The kernels, their arguments and the order of every float32 add are the plain path's: the deterministic mode
# stays bitwise repeatable, and the fast path's gradients are bitwise the plain path's (scripts/gpu_gluon_bwd_host.py
# checks both). _BWD_FAST = False takes the plain path (the script times both).
from threading import local as _thread_local  # noqa: E402

import triton.language as tl  # noqa: E402  (the bound kernel: [Note] The bound kernel)

_BWD_FAST = True
# [Note] Fast launches of a fixed-point render (tenth session). A render with DQ_MODE 2 ([Note] Fixed-point dQ)
# declares QMul=None, KVB=None, GQA=1 on its preprocess and QMul=None on its conversion; a fast launch that left them
# to their defaults had no launch entry (_entry reads every trailing argument from the call's keywords), so every
# call went through fn[grid]. _PRE_KW and _CONV_KW (the including module's) pass them at the plain path's values.
#
# [Note] Fixed-point dQ on the fast path (eleventh session). Mode 2's preprocess and conversion take the qmul rows
# (QMul) and the KV bound (KVB) as tensors. _gluon's key takes keyword values as constexprs (a tensor there would
# be a new key per call), so the fast path passes them positionally, after HEAD_DIM and BLOCK_M (constexprs are
# ordinary positions of the launcher's argument list, which skips them). The qmul rows live in the workspace right
# after delta: a render with the qmul rows by TMA (BWD_FIXED_TMA) takes its delta descriptor over both, as the plain
# path's one [2, B, Hq, sq_pad] buffer ([Note] qmul rows by TMA). _BWD_FAST_FIXED = True (the default since the
# eleventh session) takes every mode-2 call of a render with BWD_FIXED_FAST there (off: only a non-TMA render's
# prefix or window calls, as before).
#
# [Note] Switches on the fast backward path (tenth session). A window render's calls pass the switches' values
# (the window's two extents and the cap's input factor) to _bwd_host, which sent them down the plain path
# (descriptors built per call, two torch.zeros, fn[grid] launches). _BWD_FAST_SWITCHES = True takes the fast path
# for a window render (BWD_WINDOW) with the values appended to the main kernel's arguments, as _run_backward appends
# them; off: the window's backward stays on the Triton kernels (H100, docs/mods.md "The mask rows' backward (tenth
# session)"). A prefix render (BWD_PREFIX, its one value the prefix length) always takes it; so does a window render
# with the qmul rows by TMA (variant bwd_window, the product's) while _BWD_WINDOW_FAST: the eleventh session built it
# a path of its own (host/gluon_bwd_window.py: its workspace, the bound kernel, wrappers of the pre- and postprocess),
# beside this one's mode 2; the twelfth merged the two ([Note] The bound kernel).
_BWD_FAST_SWITCHES = False
# _BWD_FAST_FIXED on since the eleventh session's round B (H100, scripts/gpu_pfxtma_s11.py, module.backward, bf16
# B1 H16 causal d128, mode 2): S2048 0.450 -> 0.204 ms a call (host 0.454 -> 0.224 ms); s16k medians of three rotated
# passes 540 / 535 TF/s plain / fast (within the passes' 4% spread); prefix-LM S8192 1.389-1.432 / 1.409-1.414 ms.
_BWD_FAST_FIXED = True
# [Note] The bound kernel: on for every mode-2 render since the twelfth session's round A (H100,
# scripts/gpu_window_s12.py, window-A.txt; medians of three rotated passes): the d128 causal default at B1 H16 s16k
# 5.155 ms against the torch bound's 5.097 (passes 4.91-6.11 and 4.70-5.42: a tie) with 0.139 against 0.211 ms of
# host a call; the window row 0.536 against 0.594 ms (kernels 0.529 against 0.584: the torch bound's abs and
# reductions 0.063 ms of kernels, the kernel's 0.037); gradients bitwise the torch bound's at S333 (d128 with and
# without the prefix argument, d64, GQA 4/2, the window at left 37 and 130), within rounding at s16k (418 elements of
# dq, at most 2.4e-4 apart: rows whose unit moved)
_BWD_BOUND_KERNEL = True
# the bound kernel's rows a program and warps (H100, K and V of B1 H16 S8192 d128 bf16, 64 MB: 64 / 4 0.036-0.039 ms;
# 32/4 0.038, 64/8 0.039, 128/8 0.040, 32/2 and 16/2 0.041: none moves it, about 1.7 TB/s; eleventh session)
_BWD_BOUND_ROWS, _BWD_BOUND_WARPS = 64, 4
# [Note] Switches on the fast backward path: a window render with the qmul rows by TMA (the product's, variant
# bwd_window) takes it in every mode (the eleventh session's window path, merged into this one in the twelfth)
_BWD_WINDOW_FAST = True
# [Note] Launch memo (eighteenth session). A warm call of modes 0 and 1 rebuilt, for each of its three launches, the
# _gluon_run key (one entry a kernel argument: 21 for the main kernel) and the flat argument list (_expand: each
# descriptor's address, shape and strides looked up in its kept maps), 30-35 us of the window row's ~108 us of
# _launch_backward on the CPU (scripts/window_host_cpu_s18.py). The flat lists are a function of the module (its
# render constants, fixed), the device, the mode, q's and k's shapes and dtype, the scale, qk_scale, the switches'
# values (extra), the addresses of the nine tensors, the launchers (a script or test may swap them) and the
# workspace's views: every input is dense (_dense:
# contiguous, strides from the shapes) and every view an offset of the kept buffer fixed by the shapes and the mode.
# So each kept buffer's views (_bwd_workspace's cache, per (device, stream, thread) and shape) keep a dict of memos:
# per key of the values above, the three launches' (entry, grid, flat list); a call that finds its key replays them
# through _launch_entry (on the current stream, read at each launch): the same bytes to the same C entry points as
# the path that built them. A new buffer (grown) starts with no memos; a buffer of the call's own (under CUDA graph
# capture, or above _BWD_WS_KEEP) has none, so no memo holds a graph pool's address. The fill still runs first,
# every call. Kept only where every launch went through a launch entry and no flat list holds a tensor (a memo holds
# ints and maps, never memory); cleared at _BWD_MEMO_MAX entries (a new address of dq, dk or dv is a miss: the fast
# path plus one _expand a launch). Mode 2 (its bound kernel, a plain triton launch) is not memoised. _BWD_MEMO =
# False (or $FAGEN_BWD_MEMO=0): every call builds them, as before.
_BWD_MEMO = os.environ.get("FAGEN_BWD_MEMO", "1") != "0"
_BWD_MEMO_MAX = 64
# The largest workspace kept per (device, stream, thread), in bytes: 2^28 covers B x Hq x sq_pad <= 131072 rows of D
# 128 (the mods suite's window row, B1 H16 S8192: 68 MB; the standard suite's s16k rows: 137 MB). 2^25 until the
# seventeenth session: the thirteenth measured the window row's 68 MB kept as a tie on the GPU (0.531 ms both) with
# 0.37 against 0.47 ms of host a call; the seventeenth (H100, scripts/gpu_window_host_s17.py --ab, 6 alternating
# passes with the GPU kept busy): the window backward's host time a call 307 us kept against 412 us allocated per
# call (the buffer's eight views made again for each fresh buffer), the bench's timed call 0.530 against 0.529 ms.
# Host time is what the row runs out of when the process is busy (docs/mods.md, "The window row's host path
# (seventeenth session)"); the kept buffer is memory the caching allocator would hold for the call anyway.
_BWD_WS_KEEP = 1 << 28
_BWD_WS = _thread_local()  # per thread: (device, stream) -> [buffer, {(b, hq, sq_pad, dq_mode): views}]
_GL_DTYPE[torch.float32] = gl.float32  # the workspaces' descriptors (requests like the inputs')
_GL_DTYPE[torch.int32] = gl.int32  # the fixed-point dQ's accumulator ([Note] Switches on the fast backward path)
_fast_bwd_preprocess = _gluon(_bwd_preprocess)
_fast_dq_convert = _gluon(_dq_convert)
_fast_dq_convert_chain = _gluon(_dq_convert_chain) if BWD_WIN_PDL else None  # [Note] Window conversion overlap
_fast_bwd_kernels = {mode: (_gluon(kernel), epi_tma) for mode, (kernel, epi_tma) in _BWD_KERNELS.items()}


def _bwd_views(buf, b, hq, hkv, sq_pad, dq_mode):
    """(zeroed part, delta 2-D, lse2 2-D, dQ accumulator, counters, qmul rows 2-D, delta and qmul rows 2-D, KVB)
    over buf's float32 elements ([Note] Gluon backward host path): each part starts on a 16-byte boundary (TMA). In
    modes 1, 2 the counters' place holds KVB [B * Hkv, 2] ([Note] The bound kernel)."""
    rows = b * hq * sq_pad
    acc = rows * HEAD_DIM
    sems = -(-(b * hq * sq_pad // BWD_BLOCK_M if dq_mode == 0 else 2 * b * hkv) // 4) * 4
    zero = buf[:acc + sems]
    dm = buf[acc + sems:acc + sems + 2 * rows].view(2 * b * hq, sq_pad)  # [Note] Fixed-point dQ on the fast path
    lse2 = buf[acc + sems + 2 * rows:acc + sems + 3 * rows].view(b * hq, sq_pad)
    return (zero, dm[:b * hq], lse2, buf[:acc].view(b, hq, sq_pad, HEAD_DIM),
            buf[acc:acc + sems].view(torch.int32), dm[b * hq:], dm, buf[acc:acc + sems])


def _bwd_workspace(b, hq, sq_pad, dq_mode, q, hkv=1, fill_acc=True):
    """The workspace views of one backward on q's device (hkv: K's heads, for mode 2's KVB), the zeroed part zeroed
    on the current stream (fill_acc False: the counters only, [Note] Window chain), and the launch memos of the kept
    buffer's views ([Note] Launch memo; None for a buffer of this call's own)."""
    n = b * hq * sq_pad * (HEAD_DIM + 3) + max(b * hq * sq_pad // BWD_BLOCK_M, 2 * b * hkv) + 8
    if torch.cuda.is_current_stream_capturing() or 4 * n > _BWD_WS_KEEP:
        views = (*_bwd_views(q.new_empty(n, dtype=torch.float32), b, hq, hkv, sq_pad, dq_mode), None)
    else:
        device = q.get_device()
        key, cache = (device, _raw_stream(device)), _BWD_WS.__dict__
        kept = cache.get(key)
        if kept is None or kept[0].numel() < n:
            kept = cache[key] = [q.new_empty(max(n, 1 << 16), dtype=torch.float32), {}]
        shape = (b, hq, hkv, sq_pad, dq_mode)
        views = kept[1].get(shape)
        if views is None:
            if len(kept[1]) >= 256:
                kept[1].clear()
            views = kept[1][shape] = (*_bwd_views(kept[0], b, hq, hkv, sq_pad, dq_mode), {})  # [Note] Launch memo
    (views[0] if fill_acc else views[4]).zero_()
    return views


def _bwd_kv_bound(k, v):
    """KVB [B, Hkv, 2] of the fixed-point dQ's rows ([Note] Fixed-point dQ): max|K| and max_j |V_j|_2 per KV head."""
    return torch.stack([k.abs().amax(dim=(2, 3)).float(), torch.linalg.vector_norm(v, dim=-1).amax(-1).float()], -1)


# [Note] The bound kernel (eleventh session for the window, twelfth for every mode-2 call on the fast path)
# _bwd_kv_bound's five torch launches (abs, two amax, a norm, a stack) as one Triton kernel, _bwd_kv_bound_rows: each
# program reads BLOCK rows of K and V of one (batch, KV head) and atomic-maxes max|K| and max_j |V_j|_2 into KVB (the
# workspace's zeroed counters' place in mode 2). Non-negative floats: max is order-free, so KVB has the same bits in
# any order. A NaN in K or V becomes +inf, whose qmul is NaN, as the torch bound's NaN makes it. The norms are float32
# sums of squares, where vector_norm rounds each norm to V's dtype: the two bounds may differ in the last bits, and
# the unit e = ceil(log2(2 bound)) of a row whose bound sits within that rounding of a power of two may differ (both
# are bounds: the factor 2 holds either rounding). So the fast path's gradients equal the plain path's (torch bound)
# except in such rows, where dq differs within the fixed point's rounding (half a unit, 2^-29 of the row's bound).
# _BWD_BOUND_KERNEL off: the torch bound on the fast path too. The twelfth session also tried the bound and the
# accumulator's fill as one launch (per-part maxima without atomics, the preprocess taking their max; H100, round A
# of scripts/gpu_window_s12.py, the mods bench's window B1 H16 S8192): the fused kernel took 0.056-0.063 ms over
# seven (parts, rows, warps) configurations against 0.057 ms of kernels for this bound (0.037) and the fill (0.020),
# and the preprocess reading 64 partials a KV head took 0.034 ms instead of 0.027: the backward 0.540 against 0.536
# ms (kernels 0.531 against 0.529). Removed: both are at the memory's pace already, one launch or two.
@triton.jit
def _bwd_kv_bound_rows(K, V, KVB, seq_k, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    """KVB[bh] = max(KVB[bh], (max|K|, max_j |V_j|_2)) over rows [BLOCK * program, + BLOCK) of head bh = program 1
    of K, V contiguous [B, Hkv, Sk, HEAD_DIM]; NaN counts as +inf ([Note] The bound kernel)."""
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


def _run_backward_fast(do, q, k, v, out, lse, scale, dq, dk, dv, dq_mode, qk_scale=None, extra=()):
    """_run_backward's launches through the fast path ([Note] Gluon backward host path), on dense, aligned,
    non-empty inputs. qk_scale, extra: as _run_backward's (the score switches' values; [Note] Switches on the fast
    backward path); dq_mode 2 ([Note] Fixed-point dQ on the fast path): the qmul rows and KVB passed positionally."""
    b, hq, sq, _ = q.shape
    hkv, sk = k.shape[1] * BWD_KV_SPLIT, k.shape[2]  # virtual KV heads ([Note] GQA split in the backward)
    sq_pad = -(-sq // BWD_BLOCK_M) * BWD_BLOCK_M
    dev = q.get_device()
    # [Note] Window chain: the first adders' stores cover the accumulator, the fill zeroes the counters only
    stored = BWD_WIN_CHAIN == 2 and dq_mode == 0 and _bwd_win_visited(sq, sk, extra[0], extra[1])
    _, delta, lse2, dq_acc, sem, qmul, dm, kvb, memos = _bwd_workspace(b, hq, sq_pad, dq_mode, q, k.shape[1],
                                                                        not stored)
    memo = None
    if _BWD_MEMO and dq_mode != 2 and memos is not None and not BWD_TAIL:  # [Note] Launch memo (not: Split tail)
        key = (dq_mode, q.shape, k.shape, q.dtype, scale, qk_scale, extra, q.data_ptr(), do.data_ptr(), k.data_ptr(),
               v.data_ptr(), out.data_ptr(), lse.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr(),
               _fast_bwd_preprocess, _fast_bwd_kernels[dq_mode][0], _fast_dq_convert, _fast_dq_convert_chain)
        memo = memos.get(key)
        if memo is not None:
            for entry, grid, flat in memo:
                _launch_entry(entry, grid, dev, flat)
            return
        memo = []
    rows = delta
    if dq_mode == 2:  # an int32 accumulator (zeroed float32 bits are int32 zeros), the rows' qmul in Sem
        dq_acc, sem, rows = dq_acc.view(torch.int32), qmul, dm if BWD_FIXED_TMA else delta
        if _BWD_BOUND_KERNEL:  # [Note] The bound kernel: K's own heads, as the preprocess reads KVB
            _fast_kv_bound[(-(-sk // _BWD_BOUND_ROWS), b * k.shape[1])](k, v, kvb, sk, HEAD_DIM=HEAD_DIM,
                                                                       BLOCK=_BWD_BOUND_ROWS,
                                                                       num_warps=_BWD_BOUND_WARPS)
        else:
            kvb = _bwd_kv_bound(k, v)
        _fast_bwd_preprocess[(sq_pad // BWD_BLOCK_M, b * hq)](out, do, lse, delta, lse2, sq, sq_pad, HEAD_DIM,
                                                              BWD_BLOCK_M, qmul, kvb, GQA, num_warps=4)
    else:
        _bwd_run(memo, _fast_bwd_preprocess, (sq_pad // BWD_BLOCK_M, b * hq), (out, do, lse, delta, lse2, sq, sq_pad),
                 dict(HEAD_DIM=HEAD_DIM, BLOCK_M=BWD_BLOCK_M, **_PRE_KW, num_warps=4))
    num_bh = b * hkv
    num_tiles = -(-sk // BWD_BLOCK_N) * num_bh
    if dev not in _NUM_SMS:
        _NUM_SMS[dev] = torch.cuda.get_device_properties(dev).multi_processor_count
    kernel, epi_tma = _fast_bwd_kernels[dq_mode]
    dk0, dv0 = dk, dv
    if epi_tma:  # dK, dV leave by TMA stores of one warpgroup's 64 rows
        dk, dv = _descriptor(dk, BWD_BLOCK_N // 2), _descriptor(dv, BWD_BLOCK_N // 2)
    consts = dict(HEAD_DIM=HEAD_DIM, BLOCK_M=BWD_BLOCK_M, BLOCK_N=BWD_BLOCK_N, STAGES=BWD_RING_SLOTS,
                  GQA=GQA // BWD_KV_SPLIT, CAUSAL=CAUSAL, DQ_MODE=dq_mode, COMPUTE_REGS=BWD_COMPUTE_REGS,
                  PRODUCER_REGS=BWD_PRODUCER_REGS, WRITER_REGS=BWD_WRITER_REGS, num_warps=BWD_WARPS)
    # [Note] Split tail (gluon/backward.py.j2): the last `split` tiles in BWD_TAIL pieces, a launch of their own
    split = _bwd_tail_plan(num_tiles, _BWD_TAIL_SMS or _NUM_SMS[dev], BWD_TAIL, sq_pad // BWD_BLOCK_M) if (
        BWD_TAIL and dq_mode and BWD_GRID_ALL) else 0
    if split:
        memo = None  # five launches: not memoised
        consts["TAIL"] = 1
    # One program per SM at most: every program is resident, which the fixed-order dQ needs (BWD_DET_GRID: one per
    # tile, [Note] Launch order in gluon/backward.py.j2; BWD_GRID_ALL: modes 1, 2 one per tile, [Note] L2 sections).
    main = (_descriptor(q, BWD_BLOCK_M), _descriptor(do, BWD_BLOCK_M), _descriptor(k, BWD_BLOCK_N),
            _descriptor(v, BWD_BLOCK_N), (lse2, (1, BWD_BLOCK_M)), (rows, (1, BWD_BLOCK_M)),
            (dq_acc, (1, 1, BWD_BLOCK_M, HEAD_DIM // 2)))
    more = (scale * 1.4426950408889634 if qk_scale is None else qk_scale, scale)
    _bwd_run(memo, kernel, ((num_tiles - split) if (BWD_DET_GRID and dq_mode != 1) or (BWD_GRID_ALL and dq_mode)
                            else min(num_tiles, _NUM_SMS[dev]), ),
             (*main, dk, dv, sem, *more, num_tiles - split, num_bh, hkv, sq, sk, sq_pad, *extra), consts)
    if split:
        part = _bwd_tail_part(split * BWD_TAIL, q)
        kernel[(split * BWD_TAIL, )](*main, part, part, sem, *more, split * BWD_TAIL, num_bh, hkv, sq, sk, sq_pad,
                                   *extra, **{**consts, "TAIL": BWD_TAIL, "launch_pdl": True})
        _fast_tail_sum[(split, BWD_BLOCK_N // 32)](part, dk0, dv0, num_tiles - split, num_bh, sk, P=BWD_TAIL,
                                                   SECTIONS=_BWD_SECTIONS, HEAD_DIM=HEAD_DIM, BLOCK_N=BWD_BLOCK_N,
                                                   ROWS=32, num_warps=4)
    if dq_mode == 2:
        _fast_dq_convert[(sq_pad // BWD_BLOCK_M, b * hq)](dq_acc, dq, scale, sq, sq_pad, HEAD_DIM, BWD_BLOCK_M, qmul,
                                                          num_warps=4)
    elif dq_mode == 0 and BWD_WIN_PDL:  # [Note] Window conversion overlap (gluon/backward.py.j2)
        _bwd_run(memo, _fast_dq_convert_chain, (b * hq, sq_pad // BWD_BLOCK_M),
                 (dq_acc, dq, sem, scale, sq, sk, sq_pad, extra[0], extra[1]),
                 dict(HEAD_DIM=HEAD_DIM, BLOCK_M=BWD_BLOCK_M, BLOCK_N=BWD_BLOCK_N, CAUSAL=CAUSAL, num_warps=4,
                      launch_pdl=True))
    else:
        _bwd_run(memo, _fast_dq_convert, (sq_pad // BWD_BLOCK_M, b * hq), (dq_acc, dq, scale, sq, sq_pad),
                 dict(HEAD_DIM=HEAD_DIM, BLOCK_M=BWD_BLOCK_M, **_CONV_KW, num_warps=4))
    if memo is not None and len(memo) == 3 and None not in memo:  # [Note] Launch memo
        if len(memos) >= _BWD_MEMO_MAX:
            memos.clear()
        memos[key] = tuple(memo)


def _bwd_run(memo, launch, grid, args, consts):
    """launch[grid](*args, **consts) of a _gluon launcher; with a memo list ([Note] Launch memo), appends (entry,
    grid, flat arguments) of the launch, or None where it took no launch entry or its flat list holds a tensor."""
    entry = launch[grid](*args, **consts)
    if memo is not None:
        flat = None if entry is None else _expand(args, entry[1])
        memo.append(None if flat is None or any(type(a) is _Tensor for a in flat) else
                    (entry[0], grid if len(grid) == 3 else (*grid, 1, 1), flat))


def _bwd_host(do, q, k, v, out, lse, scale, dq, dk, dv, dq_mode, *more, **options):
    """The backward's host path: the fast one for the modes it knows (0, 1; 2 where BWD_FIXED_FAST: every call with
    _BWD_FAST_FIXED, else a non-TMA render's prefix or window calls) with the plain arguments, a prefix render's or
    a window render's with _BWD_FAST_SWITCHES (one with the qmul rows by TMA: with _BWD_WINDOW_FAST); else, or
    with _BWD_FAST = False, the plain _run_backward (which takes whatever else a render passes it)."""
    if _BWD_FAST and not options and (dq_mode == 0 or dq_mode == 1 or dq_mode == 2 and BWD_FIXED_FAST and (
            _BWD_FAST_FIXED or more and not BWD_FIXED_TMA)):
        if not more:
            return _run_backward_fast(do, q, k, v, out, lse, scale, dq, dk, dv, dq_mode)
        if ((_BWD_FAST_SWITCHES or _BWD_WINDOW_FAST and (BWD_FIXED_TMA or BWD_WIN_CHAIN)) and BWD_WINDOW
                or BWD_PREFIX) and len(more) == 2:
            return _run_backward_fast(do, q, k, v, out, lse, scale, dq, dk, dv, dq_mode, *more)
    return _run_backward(do, q, k, v, out, lse, scale, dq, dk, dv, dq_mode, *more, **options)


_fast_kv_bound = _fast(_bwd_kv_bound_rows)
_fast_tail_sum = _fast(_bwd_tail_sum) if BWD_TAIL else None  # [Note] Split tail
