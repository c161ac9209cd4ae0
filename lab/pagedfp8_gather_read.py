"""Lab (fifteenth session; a diagnostic, not attention): the paged fp8 decode's reads alone, in Gluon, with explicit
cp.async gathers into a STAGES-deep shared ring, so that the row's access pattern is timed without the kernel's
dots, softmax and Triton's copy placement.

One program per (KV head, sequence), heads fastest as the product's grid: it reads the sequence's K and V rows of its
head (128 bytes of d128 e4m3 each, at the cache's stride: 1 KB apart on a [num_pages, 16, 8, 128] cache) through the
block table, BLOCK_N keys a step; block j + STAGES - 1's copies are issued at step j's start, their page numbers
loaded a step before (carried), then block j is waited for and summed (int32 words, wrapping) into a register tile.
Each thread copies exactly the 16-byte pieces it reads back (one layout for copy and read), so no barrier is needed
between steps. Out[head, b] = the tile of those sums (K and V); the GPU script checks their sum against torch.

    PYTHONPATH=$PWD python3 lab/pagedfp8_gather_read.py    # builds for sm_90 on the CPU: registers, shared memory
"""
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy


@gluon.constexpr_function
def _words(block_n, num_warps):
    """[BLOCK_N, 32 x H] int32 words (H heads' 128-byte rows), 16 bytes a thread a row piece: 8 threads 128 bytes."""
    return gl.BlockedLayout([1, 4], [4, 8], [num_warps, 1], [1, 0])


@gluon.jit
def _issue(K, V, k_s, v_s, slot, pg, start, r, c, k_hi, stride_p, stride_s, head_off, PAGE: gl.constexpr):
    """cp.async of the rows of keys start + r (pages pg, already clamped) into slot `slot`; keys >= k_hi: zeros."""
    ok = ((start + r) < k_hi)[:, None]
    rows = pg.to(gl.int64) * stride_p + ((start + r) % PAGE) * stride_s + head_off
    off = rows[:, None] + c[None, :]
    async_copy.async_copy_global_to_shared(k_s.index(slot), K + off, mask=ok)
    async_copy.async_copy_global_to_shared(v_s.index(slot), V + off, mask=ok)
    async_copy.commit_group()


@gluon.jit
def _page(BlockTable, bt_row, start, r, k_hi, num_pages, PAGE: gl.constexpr):
    pg = gl.load(BlockTable + bt_row + (start + r) // PAGE, mask=(start + r) < k_hi, other=0)
    return gl.minimum(gl.maximum(pg, 0), num_pages - 1)


@gluon.jit(do_not_specialize=["n_keys", "num_pages", "stride_bt", "chunk"])
def _gather_read(K, V, BlockTable, Out, n_keys, num_pages, stride_bt, stride_p, stride_s, chunk, HKV: gl.constexpr,
                 H: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                 WARPS: gl.constexpr):
    groups: gl.constexpr = HKV // H
    hg = gl.program_id(0) % groups  # H heads from head hg * H (heads fastest, then splits, then sequences)
    split = gl.program_id(0) // groups
    b = gl.program_id(1)
    lw: gl.constexpr = _words(BLOCK_N, WARPS)
    r = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, lw))
    c = gl.arange(0, 32 * H, layout=gl.SliceLayout(0, lw))
    sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    k_s = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, 32 * H], sl)
    v_s = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, 32 * H], sl)
    bt_row = b.to(gl.int64) * stride_bt
    head_off = hg * (32 * H)
    lo = split * chunk
    k_hi = gl.minimum(lo + chunk, n_keys)
    n_blocks = gl.cdiv(k_hi - lo, BLOCK_N)
    for s in gl.static_range(STAGES - 1):
        pg = _page(BlockTable, bt_row, lo + s * BLOCK_N, r, k_hi, num_pages, PAGE)
        _issue(K, V, k_s, v_s, s, pg, lo + s * BLOCK_N, r, c, k_hi, stride_p, stride_s, head_off, PAGE)
    pg_next = _page(BlockTable, bt_row, lo + (STAGES - 1) * BLOCK_N, r, k_hi, num_pages, PAGE)
    acc = gl.zeros([BLOCK_N, 32 * H], gl.int32, lw)
    for j in range(n_blocks):
        ahead = lo + (j + STAGES - 1) * BLOCK_N
        _issue(K, V, k_s, v_s, (j + STAGES - 1) % STAGES, pg_next, ahead, r, c, k_hi, stride_p, stride_s,
               head_off, PAGE)
        pg_next = _page(BlockTable, bt_row, ahead + BLOCK_N, r, k_hi, num_pages, PAGE)
        async_copy.wait_group(STAGES - 1)
        acc += k_s.index(j % STAGES).load(lw) + v_s.index(j % STAGES).load(lw)
    async_copy.wait_group(0)
    tile = (gl.program_id(0) * gl.num_programs(1) + b).to(gl.int64) * (BLOCK_N * 32 * H)
    gl.store(Out + tile + r[:, None] * (32 * H) + c[None, :], acc)  # summed by the caller


def gather_read(k_cache, v_cache, block_table, n_keys, block_n=64, stages=4, num_warps=4, heads=1, splits=1):
    """Out [splits x Hkv / heads, B, BLOCK_N, 32 x heads] int32: each program's K and V words over its keys, by key mod
    BLOCK_N and word (wrapping); sums(out) gives reference()'s [Hkv, B]. A program reads `heads` adjacent KV heads'
    rows (128 x heads contiguous bytes a key) over one of `splits` chunks of whole BLOCK_N blocks."""
    pages, page, hkv, d = k_cache.shape
    assert d == 128 and k_cache.element_size() == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    b = block_table.shape[0]
    chunk = -(-(-(-n_keys // splits)) // block_n) * block_n
    out = torch.empty(splits * hkv // heads, b, block_n, 32 * heads, dtype=torch.int32, device=k_cache.device)
    kw, vw = k_cache.view(torch.int32), v_cache.view(torch.int32)  # [pages, page, hkv, 32]
    _gather_read[(splits * hkv // heads, b)](kw, vw, block_table, out, n_keys, pages, block_table.stride(0),
                                             kw.stride(0), kw.stride(1), chunk, HKV=hkv, H=heads, PAGE=page,
                                             BLOCK_N=block_n, STAGES=stages, WARPS=num_warps, num_warps=num_warps)
    return out


def sums(out, hkv):
    """gather_read's output folded to reference()'s [Hkv, B] (int32, wrapping)."""
    g, b, n, w = out.shape
    heads = w // 32
    x = out.view(g // (hkv // heads), hkv // heads, b, n, heads, 32).long().sum((0, 3, 5))  # [groups, B, heads]
    x = x.permute(0, 2, 1).reshape(hkv, b) & 0xFFFFFFFF
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def reference(k_cache, v_cache, block_table, n_keys):
    """The same sums by torch (int64, wrapped to int32)."""
    hkv = k_cache.shape[2]
    outs = []
    for cache in (k_cache, v_cache):
        g = cache.view(torch.int32)[block_table.long()]  # [B, width, page, hkv, 32]
        g = g.flatten(1, 2)[:, :n_keys]  # [B, n, hkv, 32]
        outs.append(g.long().sum((1, 3)).T)  # [hkv, B]
    s = (outs[0] + outs[1]) & 0xFFFFFFFF
    return torch.where(s >= 2**31, s - 2**32, s).to(torch.int32).view(hkv, -1)


if __name__ == "__main__":  # the sm_90 build on the CPU
    import os
    import sys
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource as ASTSource
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from sm90 import ptxas
    for bn, st, w, h in ((64, 4, 4, 1), (32, 8, 4, 1), (128, 3, 8, 1), (16, 4, 4, 8), (32, 3, 8, 8)):
        sig = dict(K="*i32", V="*i32", BlockTable="*i32", Out="*i32", n_keys="i32", num_pages="i32",
                   stride_bt="i32", stride_p="i32", stride_s="i32", chunk="i32", HKV="constexpr", H="constexpr",
                   PAGE="constexpr", BLOCK_N="constexpr", STAGES="constexpr", WARPS="constexpr")
        src = ASTSource(fn=_gather_read, signature=sig,
                        constexprs=dict(HKV=8, H=h, PAGE=16, BLOCK_N=bn, STAGES=st, WARPS=w),
                        attrs={(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 7, 8)})
        ck = triton.compile(src, target=GPUTarget("cuda", 90, 128), options=dict(num_warps=w))
        res = next(iter(ptxas(ck.asm["ptx"])[0].values()))
        print(dict(block_n=bn, stages=st, warps=w, heads=h, regs=res.registers,
                   spills=res.spill_stores + res.spill_loads, smem=ck.metadata.shared,
                   cp_async=ck.asm["ptx"].count("cp.async.ca") + ck.asm["ptx"].count("cp.async.cg")), flush=True)
