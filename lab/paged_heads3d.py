"""Lab (eleventh session): paged fp8 decode reading HEADS KV heads' rows of each slot at once, the heads as a 3-D dot's
batch dim (docs/serving.md, "fp8 KV decode, eleventh session": the block-diagonal form, PAGED_HEADS, lost 18-63
points because its q operand grows h-fold in shared memory; here each head's q operand stays [R, D]).

One split, no masks but the cache's length, bf16 q, an fp8 (e4m3) cache of vLLM's layout [pages, page, Hkv, D] with
per-KV-head scales; the dots in fp16 (every e4m3 value is an fp16 value; q is rounded to fp16, fine for a lab timing,
the product scales it first). Not the product: scripts/gpu_pagedfp8_s11.py times it beside the product's default.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _heads3d(Q, K, V, Out, Table, Lens, KS, VS, qk_scale, stride_qb, stride_qh, stride_kp, stride_kn, stride_kh,
             stride_vp, stride_vn, stride_vh, stride_ob, stride_oh, stride_t, page_shift, num_pages,
             HEADS: tl.constexpr, G: tl.constexpr, R: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr):
    off_g = tl.program_id(0)
    off_b = tl.program_id(1)
    len_k = tl.load(Lens + off_b)
    hh = tl.arange(0, HEADS)
    rr = tl.arange(0, R)
    dd = tl.arange(0, D)
    head = off_g * HEADS + hh  # the program's KV heads
    qh = head[:, None] * G + rr[None, :]  # [H, R] query heads (rows rr >= G are padding)
    real = (rr[None, :] < G) & (hh[:, None] >= 0)
    q = tl.load(Q + off_b.to(tl.int64) * stride_qb + qh[:, :, None] * stride_qh + dd[None, None, :],
                mask=real[:, :, None], other=0.0).to(tl.float16)
    scale = qk_scale * tl.load(KS + head)  # [H], log2 domain
    m_i = tl.full([HEADS, R], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([HEADS, R], dtype=tl.float32)
    acc = tl.zeros([HEADS, R, D], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    cc = tl.arange(0, HEADS * D)
    k_cols = (cc // D) * stride_kh + cc % D
    v_cols = (cc // D) * stride_vh + cc % D
    k_base = K + (off_g * HEADS).to(tl.int64) * stride_kh
    v_base = V + (off_g * HEADS).to(tl.int64) * stride_vh
    table = Table + off_b.to(tl.int64) * stride_t
    pmask = (1 << page_shift) - 1
    for start in range(0, len_k, BLOCK_N):
        cols = start + offs_n
        ok = cols < len_k
        page = tl.load(table + (cols >> page_shift), mask=ok, other=0)
        page = tl.minimum(tl.maximum(page, 0), num_pages - 1).to(tl.int64)
        k_rows = page * stride_kp + (cols & pmask) * stride_kn
        v_rows = page * stride_vp + (cols & pmask) * stride_vn
        kt = tl.load(k_base + k_rows[:, None] + k_cols[None, :], mask=ok[:, None], other=0.0)  # [N, H * D] fp8
        vt = tl.load(v_base + v_rows[:, None] + v_cols[None, :], mask=ok[:, None], other=0.0)
        k3 = tl.permute(tl.reshape(kt.to(tl.float16), [BLOCK_N, HEADS, D]), [1, 2, 0])  # [H, D, N]
        s = tl.dot(q, k3) * scale[:, None, None]  # [H, R, N]
        s = tl.where(ok[None, None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 2))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, :, None])
        l_i = l_i * alpha + tl.sum(p, 2)
        v3 = tl.permute(tl.reshape(vt.to(tl.float16), [BLOCK_N, HEADS, D]), [1, 0, 2])  # [H, N, D]
        acc = acc * alpha[:, :, None] + tl.dot(p.to(tl.float16), v3)
        m_i = m_new
    out = acc / tl.where(l_i == 0, 1.0, l_i)[:, :, None] * tl.load(VS + head)[:, None, None]
    tl.store(Out + off_b.to(tl.int64) * stride_ob + qh[:, :, None] * stride_oh + dd[None, None, :],
             out.to(Out.dtype.element_ty), mask=real[:, :, None])


def forward(q, k_cache, v_cache, block_table, seqlens_k, k_scale, v_scale, heads=4, block_n=32, num_warps=8,
            num_stages=3):
    """out [B, Hq, 1, D] of one decode step (Sq 1), the heads of each group of `heads` KV heads in one program."""
    b, hq, sq, d = q.shape
    hkv = k_cache.shape[2]
    g = hq // hkv
    assert sq == 1 and hkv % heads == 0 and d & (d - 1) == 0
    out = torch.empty_like(q)
    page = k_cache.shape[1]
    _heads3d[(hkv // heads, b)](
        q, k_cache, v_cache, out, block_table, seqlens_k, k_scale, v_scale, d ** -0.5 * 1.4426950408889634,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1), block_table.stride(0),
        page.bit_length() - 1, k_cache.shape[0],
        HEADS=heads, G=g, R=max(16, triton.next_power_of_2(g)), D=d, BLOCK_N=block_n, num_warps=num_warps,
        num_stages=num_stages)
    return out
