"""Ulysses (DeepSpeed-Ulysses) context parallelism: an all-to-all turns sequence shards into head shards, each rank
runs fagen.attention on its heads over the whole sequence, and an all-to-all turns the output back.

[Note] Heads over ranks. Rank j of N gets query heads j*Hq/N .. (j+1)*Hq/N - 1 (Hq must divide by N). Query head h
reads K/V head h // gqa, so with Hkv divisible by N rank j gets K/V heads j*Hkv/N .. and keeps the GQA ratio.
With fewer K/V heads than ranks (N a multiple of Hkv: GQA 32/8 over 16 ranks, MQA) all of rank j's query heads
read one K/V head, j // (N / Hkv): each K/V head is replicated N / Hkv times before the all-to-all, so every rank
receives exactly the one head it needs (local gqa = Hq / N), and the backward sums the replicas' gradients. When
neither divides the other (Hkv = 3 over N = 2) a rank's query heads would need an uneven share of K/V heads, which
no uniform-GQA kernel takes: refused, naming the fix (a Ulysses degree that fits, in hybrid_attention).

[Note] Data moved. A rank sends (N-1)/N of its q, k, v shards and receives as much, then the same for the output:
per layer about 4 * (N-1)/N * S/N * H * D elements each way (GQA: q and out at Hq, k and v at Hkv, or N when
replicated), in 4 all-to-alls whose sizes do not grow with N per rank. The ring instead moves the whole K/V shard
N - 1 times (2 * (N-1) * S/N * Hkv * D), overlapped with compute. docs/distributed.md compares them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import fagen
from fagen.distributed.check import HINTS, SHOW, agree_or_raise, float_bits, require_initialized
from fagen.distributed.common import _DTYPE_CODES, check_plan, check_scale, check_tensors
from fagen.distributed.shard import LAYOUTS, ContextParallelError, check_layout
from fagen.runtime.resolve import AttentionError, spec_for
from fagen.spec.axes import Layout, Mask
from fagen.spec.kernel import SCORE_SWITCHES

_SCORE_ARGS = ("window", "softcap", "alibi_slopes", "sinks")  # in SCORE_SWITCHES' order


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """out[j] = rank j's x[me], x and out [N, ...] contiguous."""
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def _seq_to_heads(x: torch.Tensor, group, seq_dim: int, head_dim: int) -> torch.Tensor:
    """[.., H, .., S_loc, ..] sequence shard -> [.., H/N, .., N*S_loc, ..]: this rank's heads, the shards of every
    rank concatenated in rank order."""
    n = dist.get_world_size(group)
    y = x.movedim((head_dim, seq_dim), (0, 1))  # [H, S_loc, rest]
    h, s, rest = y.shape[0], y.shape[1], y.shape[2:]
    y = _all_to_all(y.reshape(n, h // n, s, *rest).contiguous(), group)  # [N (source rank), H/N, S_loc, rest]
    y = y.transpose(0, 1).reshape(h // n, n * s, *rest)
    return y.movedim((0, 1), (head_dim, seq_dim)).contiguous()


def _heads_to_seq(x: torch.Tensor, group, seq_dim: int, head_dim: int) -> torch.Tensor:
    """The inverse of _seq_to_heads: [.., H/N, .., S, ..] -> [.., H, .., S/N, ..]."""
    n = dist.get_world_size(group)
    y = x.movedim((head_dim, seq_dim), (0, 1))  # [H/N, S, rest]
    h, s, rest = y.shape[0], y.shape[1], y.shape[2:]
    y = y.reshape(h, n, s // n, *rest).transpose(0, 1).contiguous()  # [N (destination rank), H/N, S/N, rest]
    y = _all_to_all(y, group).reshape(n * h, s // n, *rest)
    return y.movedim((0, 1), (head_dim, seq_dim)).contiguous()


def _exchange(there, back, name: str) -> type:
    """The autograd Function of the all-to-all `there` (x, group, seq_dim, head_dim), whose backward is `back`."""

    class Exchange(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group, seq_dim, head_dim):
            ctx.args = (group, seq_dim, head_dim)
            return there(x, group, seq_dim, head_dim)

        @staticmethod
        def backward(ctx, grad):
            return back(grad.contiguous(), *ctx.args), None, None, None

    Exchange.__name__ = Exchange.__qualname__ = name
    return Exchange


_SeqToHeads = _exchange(_seq_to_heads, _heads_to_seq, "_SeqToHeads")
_HeadsToSeq = _exchange(_heads_to_seq, _seq_to_heads, "_HeadsToSeq")


def seq_to_heads(x, group, *, seq_dim: int, head_dim: int) -> torch.Tensor:
    """Differentiable all-to-all: sequence shard -> this rank's heads over the shards of the whole group."""
    return _SeqToHeads.apply(x, group, seq_dim, head_dim)


def heads_to_seq(x, group, *, seq_dim: int, head_dim: int) -> torch.Tensor:
    """Differentiable all-to-all: this rank's heads over the whole sequence -> every head of its sequence shard."""
    return _HeadsToSeq.apply(x, group, seq_dim, head_dim)


def kv_split(hq: int, hkv: int, n: int) -> int:
    """How many times each K/V head is replicated before the all-to-all over n ranks (1: none); raises when the
    heads cannot be split ([Note] Heads over ranks)."""
    if hq % n:
        raise ContextParallelError(f"heads: q's {hq} heads do not split over {n} ranks; use a Ulysses degree that "
                                   f"divides {hq} (hybrid_attention, the ring takes the rest) or ring_attention")
    if hkv % n == 0:
        return 1
    if n % hkv == 0:
        return n // hkv
    raise ContextParallelError(f"heads: k/v's {hkv} heads and {n} ranks: neither divides the other, so a rank's query "
                               f"heads would need an uneven share of K/V heads; use a Ulysses degree that divides "
                               f"{hkv} or is a multiple of it (hybrid_attention), or ring_attention")


def _zigzag_order(x: torch.Tensor, n: int, seq_dim: int, inverse: bool) -> torch.Tensor:
    """Shards of a zigzag cut, concatenated in rank order ([c0, c2n-1, c1, c2n-2, ...]) <-> sequence order."""
    chunks = x.chunk(2 * n, dim=seq_dim)
    held = [i for r in range(n) for i in (r, 2 * n - 1 - r)]  # held[p]: the chunk at place p in rank order
    if inverse:  # sequence order -> rank order
        return torch.cat([chunks[i] for i in held], dim=seq_dim)
    where = {c: p for p, c in enumerate(held)}
    return torch.cat([chunks[where[i]] for i in range(2 * n)], dim=seq_dim)


def _to_packed(x: torch.Tensor, plan) -> torch.Tensor:
    """The ranks' packed shards concatenated in rank order -> the packed rows (padding dropped)."""
    if plan.is_identity():
        return x[:plan.cu[-1]]
    return x.index_select(0, plan.order(x.device))


def _from_packed(x: torch.Tensor, plan) -> torch.Tensor:
    """The packed rows -> the ranks' shards concatenated in rank order (padding rows zero)."""
    total = plan.world * plan.shard_len
    if plan.is_identity():
        return torch.cat([x, x.new_zeros((total - x.shape[0], *x.shape[1:]))])
    inv = torch.full((total,), x.shape[0], dtype=torch.long, device=x.device)  # padding: the zero row appended
    inv[plan.order(x.device)] = torch.arange(x.shape[0], device=x.device)
    return torch.cat([x, x.new_zeros((1, *x.shape[1:]))]).index_select(0, inv)


def _check_local(q, k, v, group, mask, scale, layout, plan, scores):
    packed = plan is not None
    check_tensors(q, k, v, 3 if packed else 4)
    n = dist.get_world_size(group)
    scale = check_scale(scale, q.shape[-1])
    head, seq = (1, 0) if packed else (1, 2)
    hq, hkv = q.shape[head], k.shape[head]
    rep = kv_split(hq, hkv, n)
    if packed:
        if mask not in ("none", "causal"):
            raise ContextParallelError(f"mask: got {mask!r}; packed documents take 'none' or 'causal' (per "
                                       "document)")
        check_plan(plan, n, mask, q, k)
        if layout != "contiguous":
            raise ContextParallelError(f"layout: got {layout!r} with a plan; the plan says where every packed row "
                                       "lies: leave layout at its default")
    else:
        check_layout(layout)
        if layout == "zigzag" and n > 1 and (q.shape[seq] % 2 or k.shape[seq] % 2):
            raise ContextParallelError(f"zigzag layout: a shard is two equal chunks, so its length must be even; got "
                                       f"q {q.shape[seq]} and k {k.shape[seq]}; cut the sequence with "
                                       "fagen.distributed.shard")
    switches = tuple(name for name, arg in zip(SCORE_SWITCHES, _SCORE_ARGS) if scores.get(arg) is not None)
    for name in ("alibi_slopes", "sinks"):
        t = scores.get(name)
        if t is not None and (not isinstance(t, torch.Tensor) or t.shape != (hq,)):
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ContextParallelError(f"{name}: expected a float32 tensor [{hq}] (one per query head), got {got}")
    local = [list(q.shape), list(k.shape)]
    local[0][head], local[1][head] = hq // n, max(1, hkv * rep // n)
    try:  # the kernel that will run, refused here rather than after the all-to-all
        spec_for(*(torch.empty(s, dtype=q.dtype, device="meta") for s in (local[0], local[1], local[1])), mask=mask,
                 switches=switches, layout=Layout.VARLEN if packed else Layout.DENSE)
    except AttentionError as e:
        raise ContextParallelError(f"no fagen kernel for the local problem: {e}") from None
    fields = [("call", 1 if packed else 0), ("batch", 0 if packed else q.shape[0]), ("q heads", hq),
              ("kv heads", hkv), ("q shard length", q.shape[seq]), ("k/v shard length", k.shape[seq]),
              ("head_dim", q.shape[-1]), ("dtype", _DTYPE_CODES.index(q.dtype)),
              ("mask", Mask.choices().index(str(mask))), ("layout", LAYOUTS.index(layout)),
              ("plan", plan.key if packed else 0), ("scale", float_bits(scale)),
              ("score switches", sum(1 << SCORE_SWITCHES.index(s) for s in switches))]
    return scale, rep, fields


_SHOW = dict(SHOW, mask=lambda x: Mask.choices()[x],
             **{"score switches": lambda x: "+".join(s for i, s in enumerate(SCORE_SWITCHES) if x >> i & 1) or "none"})


def ulysses_attention(q, k, v, *, group=None, mask: str = "none", scale: float | None = None,
                      layout: str = "contiguous", plan=None, seqlens_q=None, seqlens_k=None, tree_mask=None,
                      window=None, softcap: float | None = None, alibi_slopes=None, sinks=None,
                      check_ranks: bool = True) -> torch.Tensor:
    """Attention over a sequence sharded across the ranks of `group` (default: the whole world), by all-to-all over
    heads; differentiable. See the module docstring and docs/distributed.md.

    q [B, Hq, Sq_local, D], k and v [B, Hkv, Sk_local, D] are this rank's shards in `layout` (as for
    ring_attention); the output is this rank's shard of the output, in the same layout. Each rank runs
    fagen.attention on Hq/N heads over the whole sequence, so every mask ("none", "causal", "padding",
    "causal+padding", "tree") and score switch of fagen.attention works, with its arguments for the whole
    sequence (seqlens_q, seqlens_k, tree_mask, window, softcap; alibi_slopes and sinks [Hq] for all heads: each
    rank takes its heads', and sinks.grad gets this rank's heads' share: sum it over the group).
    plan: packed documents (a DocumentPlan over this group, any balance; mask "none" or "causal"): q is
    [shard_len, Hq, D], k and v [shard_len, Hkv, D] (plan.shard).
    Hq must divide by N; Hkv must divide by N or N by Hkv (then K/V heads are replicated; [Note] Heads over ranks).
    Raises ContextParallelError on every rank, before any data moves, on bad input (check_ranks as in
    ring_attention).
    """
    require_initialized()
    n = dist.get_world_size(group)
    scores = {name: value for name, value in zip(_SCORE_ARGS, (window, softcap, alibi_slopes, sinks))
              if value is not None}
    error = None
    try:
        scale, rep, fields = _check_local(q, k, v, group, mask, scale, layout, plan, scores)
    except ContextParallelError as e:
        error, fields = e, []
    agree_or_raise(group, error, fields, check_ranks, show=_SHOW, hints=HINTS)
    rank = dist.get_rank(group)
    hq = q.shape[1]
    for name in ("alibi_slopes", "sinks"):  # this rank's heads
        if name in scores:
            scores[name] = scores[name][rank * hq // n:(rank + 1) * hq // n]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    seq = 0 if plan is not None else 2
    q, k, v = (seq_to_heads(t, group, seq_dim=seq, head_dim=1) for t in (q, k, v))
    if plan is not None:
        q, k, v = (_to_packed(t, plan) for t in (q, k, v))
        cu = torch.tensor(plan.cu, dtype=torch.int32, device=q.device)
        longest = max(plan.doc_lengths)
        out = fagen.attention(q, k, v, mask=mask, scale=scale, cu_seqlens_q=cu, cu_seqlens_k=cu,
                              max_seqlen_q=longest, max_seqlen_k=longest, **scores)
        out = _from_packed(out, plan)
    else:
        if layout == "zigzag" and n > 1:
            q, k, v = (_zigzag_order(t, n, 2, inverse=False) for t in (q, k, v))
        out = fagen.attention(q, k, v, mask=mask, scale=scale, seqlens_q=seqlens_q, seqlens_k=seqlens_k,
                              tree_mask=tree_mask, **scores)
        if layout == "zigzag" and n > 1:
            out = _zigzag_order(out, n, 2, inverse=True)
    return heads_to_seq(out, group, seq_dim=seq, head_dim=1)


__all__ = ["ulysses_attention", "seq_to_heads", "heads_to_seq", "kv_split"]
