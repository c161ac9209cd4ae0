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

import functools
import math
import struct

import torch
import torch.distributed as dist

import fagen
from fagen.distributed.shard import ContextParallelError, check_layout

_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
_DTYPE_CODES = list(_DTYPES)
MASKS = ("none", "causal")
_TAG_KV, _TAG_DKV = 17, 18  # gloo matches point-to-point messages by tag; NCCL orders them per peer


@functools.lru_cache(maxsize=None)
def _kernel(head_dim: int, gqa: int, dtype: str, mask: str):
    """The differentiable fagen module for one block kind (loaded once per process)."""
    return fagen.load(fagen.KernelSpec(head_dim=head_dim, mask=mask, gqa=gqa, dtype=dtype, direction="bwd"))


class _Ring:
    """The group, this rank's place in it and its neighbours; exchange() posts one step's send and receive."""

    def __init__(self, group, mask: str, layout: str, scale: float):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        whole = group if group is not None else dist.group.WORLD
        self.next = dist.get_global_rank(whole, (self.rank + 1) % self.world)
        self.prev = dist.get_global_rank(whole, (self.rank - 1) % self.world)
        self.mask, self.layout, self.scale = mask, layout, scale

    def exchange(self, send, recv, tag: int):
        """Send the tensors `send` to the next rank and receive the previous rank's into `recv` (one batch);
        returns the works to wait on."""
        ops = [dist.P2POp(dist.isend, t, self.next, self.group, tag) for t in send]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group, tag) for t in recv]
        return dist.batch_isend_irecv(ops)

    def block(self, step: int):
        """What this rank computes at `step` (K/V of rank rank - step): (query part, key part, kernel mask), or None
        for a fully masked block. Parts are "all", "first" (half) or "second" (half); see [Note] Causal blocks."""
        if self.mask == "none":
            return "all", "all", "none"
        if step == 0:
            return "all", "all", "causal"
        source = (self.rank - step) % self.world
        if self.layout == "contiguous":
            return ("all", "all", "none") if source < self.rank else None
        return ("all", "first", "none") if source < self.rank else ("second", "all", "none")


class _Buffers:
    """The K/V receive buffers: step i receives into buffer i % 2, allocated on first use. Never the caller's k and
    v (the backward needs them, and the caller owns them): a ring of N > 2 holds two buffers besides its shard (the
    block in hand and the one arriving), a ring of 2 one."""

    def __init__(self, like: torch.Tensor):
        self.like, self.pairs = like, [None, None]

    def receive(self, step: int):
        if self.pairs[step % 2] is None:
            self.pairs[step % 2] = (torch.empty(self.like.shape, dtype=self.like.dtype, device=self.like.device),
                                    torch.empty(self.like.shape, dtype=self.like.dtype, device=self.like.device))
        return self.pairs[step % 2]


def _part(t: torch.Tensor, which: str) -> torch.Tensor:
    """A view of t's sequence dim (2): all of it, or its first or second half."""
    if which == "all":
        return t
    half = t.shape[2] // 2
    return t[:, :, :half] if which == "first" else t[:, :, half:]


def _merge_into(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Fold one block's (out, lse) into the running fp32 (acc_out, acc_lse), in place, by the log-sum-exp rule:
    lse' = log(e^a + e^b), out' = (e^a out_a + e^b out_b) / e^lse'. Rows no block has seen (lse -inf) stay 0."""
    m = torch.maximum(acc_lse, lse)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # both -inf: any finite shift will do
    wa, wb = torch.exp(acc_lse - m), torch.exp(lse - m)
    total = wa + wb
    acc_lse.copy_(m + torch.log(total))  # log(0) = -inf for a row that sees nothing yet
    total = torch.where(total > 0, total, torch.ones_like(total))
    acc_out.mul_((wa / total).unsqueeze(-1)).add_(out.float() * (wb / total).unsqueeze(-1))


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


def _check_local(q, k, v, mask, layout, scale):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ContextParallelError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ContextParallelError(f"{name}: expected 4 dims [batch, heads, seq shard, head_dim], "
                                       f"got shape {tuple(t.shape)}")
        if t.dtype not in _DTYPES:
            raise ContextParallelError(f"{name}: dtype {t.dtype} is not supported; use torch.float16, "
                                       "torch.bfloat16 or torch.float32")
        if t.dtype != q.dtype or t.device != q.device:
            raise ContextParallelError(f"q, k and v must share one dtype and device, got {q.dtype} on {q.device} "
                                       f"and {t.dtype} on {t.device} ({name})")
    if k.shape != v.shape:
        raise ContextParallelError(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ContextParallelError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on batch and head_dim")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ContextParallelError(f"heads: q has {q.shape[1]} and k/v have {k.shape[1]}; q's heads must be a "
                                   "multiple of k/v's (gqa = q heads / kv heads)")
    if mask not in MASKS:
        raise ContextParallelError(f"mask: got {mask!r}; ring attention supports {', '.join(map(repr, MASKS))}")
    check_layout(layout)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ContextParallelError(f"scale: expected a positive finite float, got {scale!r}")
    if mask == "causal" and q.shape[2] != k.shape[2]:
        raise ContextParallelError(f"causal ring attention needs q and k shards of one length (self-attention cut "
                                   f"the same way), got {q.shape[2]} and {k.shape[2]}")
    return float(scale)


_FIELDS = ("batch", "q heads", "kv heads", "q shard length", "k/v shard length", "head_dim", "dtype", "mask",
           "layout", "scale")


def _check_ranks(ring: _Ring, q, k, mask, layout):
    """Every rank must call with the same problem; one small all_gather compares them, and every rank raises the
    same error (none hangs in the ring)."""
    dtype = _DTYPE_CODES.index(q.dtype)
    scale_bits = struct.unpack("<q", struct.pack("<d", ring.scale))[0]
    mine = [q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3], dtype, MASKS.index(mask),
            ("contiguous", "zigzag").index(layout), scale_bits]
    device = q.device if dist.get_backend(ring.group) != "gloo" else torch.device("cpu")
    mine_t = torch.tensor(mine, dtype=torch.int64, device=device)
    every = [torch.empty_like(mine_t) for _ in range(ring.world)]
    dist.all_gather(every, mine_t, group=ring.group)
    every = [t.tolist() for t in every]
    for i, field in enumerate(_FIELDS):
        values = [row[i] for row in every]
        if len(set(values)) == 1:
            continue
        if field == "dtype":
            values = [str(_DTYPE_CODES[x]) for x in values]
        elif field in ("mask", "layout"):
            values = [(MASKS if field == "mask" else ("contiguous", "zigzag"))[x] for x in values]
        elif field == "scale":
            values = [struct.unpack("<d", struct.pack("<q", x))[0] for x in values]
        per_rank = ", ".join(f"rank {r}: {x}" for r, x in enumerate(values))
        hint = {"q shard length": "cut the sequence into equal shards with fagen.distributed.shard (pad it to a "
                                  "multiple of the number of chunks)",
                "k/v shard length": "cut the sequence into equal shards with fagen.distributed.shard (pad it to a "
                                    "multiple of the number of chunks)",
                "dtype": "cast every rank's q, k and v to one dtype"}.get(field, "pass the same value on every rank")
        raise ContextParallelError(f"{field} differs across the ranks of the group ({per_rank}); {hint}")


def ring_attention(q, k, v, *, group=None, mask: str = "none", scale: float | None = None,
                   layout: str = "contiguous", check_ranks: bool = True) -> torch.Tensor:
    """Attention over a sequence sharded across the ranks of `group` (default: the whole world); differentiable.

    q [B, Hq, Sq_local, D], k and v [B, Hkv, Sk_local, D] are this rank's shards in `layout` ("contiguous" or
    "zigzag", see fagen.distributed.shard); the output is this rank's shard of the full attention output, in the
    same layout. mask is "none" or "causal" (causal needs q and k cut the same way: Sq_local == Sk_local; use
    layout="zigzag" so that every rank does equal work). scale defaults to 1/sqrt(D). Hq must be a multiple of Hkv
    (GQA). Every rank of the group must call it, with equal shard lengths, dtype, mask, layout and scale; a group
    of one rank runs the local kernel. Raises ContextParallelError on bad input.

    check_ranks: compare the ranks' shapes, dtype, mask, layout and scale first (one small all_gather; on NCCL it
    also waits for the GPU). Inconsistent calls would otherwise hang or compute garbage; pass False only in a loop
    whose shapes are known to agree on every rank.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ContextParallelError("torch.distributed is not initialized; call torch.distributed.init_process_group "
                                   "first (launch with torchrun), or use fagen.attention on one device")
    scale = _check_local(q, k, v, mask, layout, scale)
    ring = _Ring(group, mask, layout, scale)
    if layout == "zigzag" and ring.world > 1 and (q.shape[2] % 2 or k.shape[2] % 2):
        raise ContextParallelError(f"zigzag layout: a shard is two equal chunks, so its length must be even; got q "
                                   f"{q.shape[2]} and k {k.shape[2]}; cut the sequence with fagen.distributed.shard")
    if ring.world > 1 and check_ranks:
        _check_ranks(ring, q, k, mask, layout)
    gqa = q.shape[1] // k.shape[1]
    try:
        mods = {m: _kernel(q.shape[-1], gqa, _DTYPES[q.dtype], m) for m in {"none", mask}}
    except fagen.SpecError as e:  # the same on every rank (their shapes were compared above): none hangs
        raise ContextParallelError(f"no fagen kernel for these shards: {e}") from None
    if ring.world == 1:  # one rank holds the whole sequence in order (a one-rank zigzag is chunks 0 and 1)
        return mods[mask].attention(q, k, v, scale=scale)
    return _RingAttention.apply(q, k, v, ring, mods)


__all__ = ["ring_attention", "MASKS"]
