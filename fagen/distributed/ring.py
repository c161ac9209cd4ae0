"""Ring attention (context parallelism) on fagen kernels over torch.distributed.

Every rank of the group holds a shard of the sequence of q, k and v (fagen.distributed.shard says how). The K/V
shards travel around the ring rank -> rank + 1 with torch.distributed point-to-point operations
(batch_isend_irecv); while the next block is in flight, the rank runs a fagen kernel on the block in hand and
merges the partial (out, lse) into its running result by the log-sum-exp rule. The backward runs the same ring:
dQ stays home, and each K/V block carries its dK/dV accumulator (fp32) with it, which one last hop brings home.

[Note] Causal blocks. With q and k cut the same way, the block of rank r's queries against rank s's keys is
  contiguous layout: s == r the diagonal (a causal kernel on Sq == Sk, where bottom-right = top-left alignment),
                     s < r fully visible (mask none), s > r fully masked (skipped, no launch);
  zigzag layout (rank r holds chunks r and 2N-1-r of 2N): s == r causal on the local shard (its two chunks are in
                     sequence order, so the local causal mask is the global one); s < r every query sees the first
                     chunk of the block (chunk s) and none of the second (2N-1-s > 2N-1-r): all q against half
                     the keys; s > r only the second query chunk (2N-1-r) sees anything, and it sees all of the
                     block: half the queries against all the keys. Every rank does the same work at every step.

[Note] Backward with the global statistics. The kernels' backward recomputes P = exp(S - lse) and uses
delta = rowsum(dO * O); given the merged (global) lse and out of a row, the P of a block is exactly that block's
slice of the global softmax and delta is the global correction term, so the per-block gradients sum to the
gradient of the whole row. tests/test_distributed.py checks this against a float64 reference.

[Note] Determinism. The blocks a rank sees arrive in a fixed order (step 0 is its own, step i rank r - i's), the
merges and gradient sums run in that order, and the kernels are deterministic: for a fixed world size, equal
inputs give bitwise-equal outputs and gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import fagen
from fagen.distributed.check import HINTS, SHOW, agree_or_raise, float_bits, require_initialized
from fagen.distributed.common import (_DTYPE_CODES, _DTYPES, _TAG_DKV, _TAG_KV, MASKS, _Buffers, _kernel, _merge_into,
                                      _Ring, check_plan, check_scale, check_tensors)
from fagen.distributed.packed import packed_ring
from fagen.distributed.shard import LAYOUTS, ContextParallelError, check_layout

def _part(t: torch.Tensor, which: str) -> torch.Tensor:
    """A view of t's sequence dim (2): all of it, or its first or second half."""
    if which == "all":
        return t
    half = t.shape[2] // 2
    return t[:, :, :half] if which == "first" else t[:, :, half:]


def _ring_forward(ring: _Ring, mods, q, k, v):
    """(out like q, lse float32) of this rank's queries against the whole sequence's keys."""
    kv, bufs = (k.contiguous(), v.contiguous()), _Buffers(k)
    acc_out = acc_lse = None
    for step in range(ring.world):
        works = []
        if step < ring.world - 1:  # the next block travels while this one is computed
            works = ring.exchange(kv, bufs.receive(step), _TAG_KV)
        todo = ring.block(step)
        if todo is not None:
            rows, cols, mask = todo
            out, lse = mods[mask].forward(_part(q, rows), _part(kv[0], cols), _part(kv[1], cols), scale=ring.scale)
            if acc_out is None:  # step 0 always covers all rows
                acc_out, acc_lse = out.float(), lse.clone()
            else:
                _merge_into(_part(acc_out, rows), _part(acc_lse, rows), out, lse)
        for work in works:
            work.wait()
        kv = bufs.receive(step) if works else kv
    return acc_out.to(q.dtype), acc_lse


def _ring_backward(ring: _Ring, mods, do, q, k, v, out, lse):
    """(dq, dk, dv) of this rank's shards: dQ accumulates here, dK/dV travel with their K/V block and come home."""
    kv, bufs = (k.contiguous(), v.contiguous()), _Buffers(k)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dkv = [torch.zeros((2, *k.shape), dtype=torch.float32, device=q.device),  # [dK, dV] of the block in hand
           torch.empty((2, *k.shape), dtype=torch.float32, device=q.device)]
    dkv_works = []
    for step in range(ring.world):
        works = []
        if step < ring.world - 1:
            works = ring.exchange(kv, bufs.receive(step), _TAG_KV)
        todo = ring.block(step)
        if todo is not None:  # the kernels run while the block's dK/dV accumulator is still arriving
            rows, cols, mask = todo
            gq, gk, gv = mods[mask].backward(_part(do, rows), _part(q, rows), _part(kv[0], cols), _part(kv[1], cols),
                                             _part(out, rows), _part(lse, rows), scale=ring.scale)
            _part(dq, rows).add_(gq)
        for work in dkv_works:  # the accumulator of the block in hand has arrived (step 0: zeros, ours)
            work.wait()
        acc = dkv[step % 2]
        if todo is not None:
            _part(acc[0], cols).add_(gk)
            _part(acc[1], cols).add_(gv)
        dkv_works = ring.exchange([acc], [dkv[(step + 1) % 2]], _TAG_DKV)  # on to the next rank; the last hop: home
        for work in works:
            work.wait()
        kv = bufs.receive(step) if works else kv
    for work in dkv_works:
        work.wait()
    home = dkv[ring.world % 2]
    return dq.to(q.dtype), home[0].to(k.dtype), home[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring, mods):
        out, lse = _ring_forward(ring, mods, q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.mods = ring, mods
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(ctx.ring, ctx.mods, do.to(q.dtype).contiguous(), q, k, v, out, lse)
        return dq, dk, dv, None, None


def _check_local(q, k, v, group, mask, layout, scale, plan):
    """This rank's input checked, without communication: (ring, kernels, the fields every rank must agree on)."""
    packed = plan is not None
    check_tensors(q, k, v, 3 if packed else 4)
    if mask not in MASKS:
        raise ContextParallelError(f"mask: got {mask!r}; ring attention supports {', '.join(map(repr, MASKS))}")
    scale = check_scale(scale, q.shape[-1])
    world = dist.get_world_size(group)
    if packed:
        check_plan(plan, world, mask, q, k)
        if layout != "contiguous":
            raise ContextParallelError(f"layout: got {layout!r} with a plan; the plan says where every packed row "
                                       "lies: leave layout at its default")
        length_q, length_k = q.shape[0], k.shape[0]
    else:
        check_layout(layout)
        length_q, length_k = q.shape[2], k.shape[2]
        if mask == "causal" and length_q != length_k:
            raise ContextParallelError(f"causal ring attention needs q and k shards of one length (self-attention "
                                       f"cut the same way), got {length_q} and {length_k}")
        if layout == "zigzag" and world > 1 and (length_q % 2 or length_k % 2):
            raise ContextParallelError(f"zigzag layout: a shard is two equal chunks, so its length must be even; "
                                       f"got q {length_q} and k {length_k}; cut the sequence with "
                                       "fagen.distributed.shard")
    gqa = q.shape[1] // k.shape[1]
    try:
        mods = {m: _kernel(q.shape[-1], gqa, _DTYPES[q.dtype], m, "varlen" if packed else "dense")
                for m in {"none", mask}}
    except fagen.SpecError as e:
        raise ContextParallelError(f"no fagen kernel for these shards: {e}") from None
    fields = [("call", 1 if packed else 0), ("batch", 0 if packed else q.shape[0]), ("q heads", q.shape[1]),
              ("kv heads", k.shape[1]), ("q shard length", length_q), ("k/v shard length", length_k),
              ("head_dim", q.shape[-1]), ("dtype", _DTYPE_CODES.index(q.dtype)), ("mask", MASKS.index(mask)),
              ("layout", LAYOUTS.index(layout)), ("plan", plan.key if packed else 0), ("scale", float_bits(scale))]
    return _Ring(group, mask, layout, scale), mods, fields


def ring_attention(q, k, v, *, group=None, mask: str = "none", scale: float | None = None,
                   layout: str = "contiguous", plan=None, check_ranks: bool = True) -> torch.Tensor:
    """Attention over a sequence sharded across the ranks of `group` (default: the whole world); differentiable.

    q [B, Hq, Sq_local, D], k and v [B, Hkv, Sk_local, D] are this rank's shards in `layout` ("contiguous" or
    "zigzag", see fagen.distributed.shard); the output is this rank's shard of the full attention output, in the
    same layout. mask is "none" or "causal" (causal needs q and k cut the same way: Sq_local == Sk_local; use
    layout="zigzag" so that every rank does equal work). scale defaults to 1/sqrt(D). Hq must be a multiple of Hkv
    (GQA). Every rank of the group must call it, with equal shard lengths, dtype, mask, layout and scale; a group
    of one rank runs the local kernel. Raises ContextParallelError on bad input, on every rank.

    plan: packed documents (a fagen.distributed.DocumentPlan over this group's ranks, built with this mask): q is
    [shard_len, Hq, D], k and v [shard_len, Hkv, D], this rank's shard (plan.shard); attention runs per document,
    and blocks a rank sees nothing of are skipped.

    check_ranks: compare the ranks' inputs first (one small all_gather; on NCCL it also waits for the GPU): a rank
    whose input is refused, or inputs that differ across ranks, make every rank raise before any data moves.
    Pass False only in a loop whose inputs are known to be valid and to agree on every rank.
    """
    require_initialized()
    world = dist.get_world_size(group)
    error = None
    try:
        ring, mods, fields = _check_local(q, k, v, group, mask, layout, scale, plan)
    except ContextParallelError as e:
        error, fields = e, []
    agree_or_raise(group, error, fields, check_ranks, show=SHOW, hints=HINTS)
    if plan is not None:
        return packed_ring(q, k, v, ring, plan, mods)
    if world == 1:  # one rank holds the whole sequence in order (a one-rank zigzag is chunks 0 and 1)
        return mods[mask].attention(q, k, v, scale=ring.scale)
    return _RingAttention.apply(q, k, v, ring, mods)


__all__ = ["ring_attention", "MASKS"]
