"""The ring over packed documents: each rank holds a DocumentPlan's shard [shard_len, H, D] of a varlen sequence.

The ring turns as in fagen.distributed.ring (K/V travel rank -> rank + 1, the block in hand is computed while the
next one arrives, partial (out, lse) merge by the log-sum-exp rule, dK/dV travel with their block and one last hop
brings them home); what differs is the block: one varlen kernel call whose sequences are this rank's query chunks
and, as keys, the run of the source's shard each chunk sees ([Note] One varlen launch per block, in
fagen.distributed.packing). A block the plan marks empty is not launched. The backward calls the varlen kernels'
backward with the merged out and lse, as the dense ring does ([Note] Backward with the global statistics).
"""

from __future__ import annotations

import torch

from fagen.distributed.common import _TAG_DKV, _TAG_KV, _Buffers, _merge_into, _Ring


def _keys(blk: dict, kv):
    """The block's keys and values in gathered order: a slice of the shard, or its rows gathered."""
    if "slice" in blk:
        a, b = blk["slice"]
        return kv[0][a:b], kv[1][a:b]
    return kv[0].index_select(0, blk["gather"]), kv[1].index_select(0, blk["gather"])


def _add_keys(acc: torch.Tensor, blk: dict, grad: torch.Tensor) -> None:
    """acc (fp32, like the shard) += the gathered rows' gradient `grad`, row by row, in a fixed order."""
    if "slice" in blk:
        a, b = blk["slice"]
        acc[a:b].add_(grad)
        return
    for rows, gathered in blk["layers"]:  # a layer holds a shard row at most once: no two adds race
        acc.index_add_(0, rows, grad.index_select(0, gathered).float())


def _call(blk: dict, fn, *args, scale):
    b = blk["block"]
    return fn(*args, scale=scale, cu_seqlens_q=blk["cu_q"], cu_seqlens_k=blk["cu_k"], max_seqlen_q=b.max_q,
              max_seqlen_k=b.max_k)


def _turn(ring: _Ring, plan, mods, kv, bufs, step: int, device):
    """Step `step` of the ring, forward or backward: (the works of sending the K/V in hand on while the next arrive
    (none at the last step), the block the plan gives this rank against the shard in hand (None: empty), the varlen
    module that computes it)."""
    works = ring.exchange(kv, bufs.receive(step), _TAG_KV) if step < ring.world - 1 else []
    blk = plan.device_block(ring.rank, (ring.rank - step) % ring.world, device)
    return works, blk, None if blk is None else mods["causal" if blk["block"].causal else "none"]


def _packed_forward(ring: _Ring, plan, mods, q, k, v):
    """(out like q, lse float32 [Hq, shard_len]) of this rank's query rows against every document key they see."""
    kv, bufs = (k.contiguous(), v.contiguous()), _Buffers(k)
    acc_out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    acc_lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    for step in range(ring.world):
        works, blk, mod = _turn(ring, plan, mods, kv, bufs, step, q.device)
        if blk is not None:
            out, lse = _call(blk, mod.forward, q, *_keys(blk, kv), scale=ring.scale)
            _merge_into(acc_out, acc_lse.t(), out, lse.t())
        for work in works:
            work.wait()
        kv = bufs.receive(step) if works else kv
    return acc_out.to(q.dtype), acc_lse


def _packed_backward(ring: _Ring, plan, mods, do, q, k, v, out, lse):
    """(dq, dk, dv) of this rank's shards; dK/dV travel with their block and come home, as in the dense ring."""
    kv, bufs = (k.contiguous(), v.contiguous()), _Buffers(k)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dkv = [torch.zeros((2, *k.shape), dtype=torch.float32, device=q.device),
           torch.empty((2, *k.shape), dtype=torch.float32, device=q.device)]
    dkv_works = []
    for step in range(ring.world):
        works, blk, mod = _turn(ring, plan, mods, kv, bufs, step, q.device)
        if blk is not None:
            gq, gk, gv = _call(blk, mod.backward, do, q, *_keys(blk, kv), out, lse, scale=ring.scale)[:3]
            dq.add_(gq)
        for work in dkv_works:
            work.wait()
        acc = dkv[step % 2]
        if blk is not None:
            _add_keys(acc[0], blk, gk)
            _add_keys(acc[1], blk, gv)
        if ring.world > 1:
            dkv_works = ring.exchange([acc], [dkv[(step + 1) % 2]], _TAG_DKV)
        for work in works:
            work.wait()
        kv = bufs.receive(step) if works else kv
    for work in dkv_works:
        work.wait()
    home = dkv[ring.world % 2] if ring.world > 1 else dkv[0]  # a ring of one keeps its block at home
    return dq.to(q.dtype), home[0].to(k.dtype), home[1].to(v.dtype)


class _PackedRingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring, plan, mods):
        out, lse = _packed_forward(ring, plan, mods, q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.plan, ctx.mods = ring, plan, mods
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _packed_backward(ctx.ring, ctx.plan, ctx.mods, do.to(q.dtype).contiguous(), q, k, v, out, lse)
        return dq, dk, dv, None, None, None


def packed_ring(q, k, v, ring: _Ring, plan, mods) -> torch.Tensor:
    """The packed ring on checked inputs (fagen.distributed.ring_attention with plan= checks them)."""
    return _PackedRingAttention.apply(q, k, v, ring, plan, mods)


__all__ = ["packed_ring"]
