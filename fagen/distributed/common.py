"""What the rings of fagen.distributed share: the kernels per block kind, the ring of ranks and its point-to-point
step, the receive buffers, and the log-sum-exp merge of partial results."""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist

import fagen
from fagen.distributed.packing import DocumentPlan
from fagen.distributed.shard import ContextParallelError

_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
_DTYPE_CODES = list(_DTYPES)
MASKS = ("none", "causal")
_TAG_KV, _TAG_DKV = 17, 18  # gloo matches point-to-point messages by tag; NCCL orders them per peer


@functools.lru_cache(maxsize=None)
def _kernel(head_dim: int, gqa: int, dtype: str, mask: str, layout: str = "dense"):
    """The differentiable fagen module for one block kind (loaded once per process)."""
    return fagen.load(fagen.KernelSpec(head_dim=head_dim, mask=mask, gqa=gqa, dtype=dtype, direction="bwd",
                                       layout=layout))


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


def check_scale(scale, head_dim: int) -> float:
    """The softmax scale: 1/sqrt(head_dim) by default, else a positive finite float."""
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ContextParallelError(f"scale: expected a positive finite float, got {scale!r}")
    return float(scale)


def check_tensors(q, k, v, dims: int) -> None:
    """q, k, v: tensors of `dims` dims ([B, H, S, D] or packed [T, H, D]) of one supported dtype and device, k and v
    of one shape, agreeing with q on head_dim (and batch), q's heads a multiple of k's."""
    what = "[batch, heads, seq shard, head_dim]" if dims == 4 else "[packed rows, heads, head_dim]"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ContextParallelError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != dims:
            raise ContextParallelError(f"{name}: expected {dims} dims {what}, got shape {tuple(t.shape)}")
        if t.dtype not in _DTYPES:
            raise ContextParallelError(f"{name}: dtype {t.dtype} is not supported; use torch.float16, "
                                       "torch.bfloat16 or torch.float32")
        if t.dtype != q.dtype or t.device != q.device:
            raise ContextParallelError(f"q, k and v must share one dtype and device, got {q.dtype} on {q.device} "
                                       f"and {t.dtype} on {t.device} ({name})")
    if k.shape != v.shape:
        raise ContextParallelError(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[-1] != k.shape[-1] or (dims == 4 and q.shape[0] != k.shape[0]):
        raise ContextParallelError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on "
                                   + ("batch and head_dim" if dims == 4 else "head_dim"))
    hq, hkv = q.shape[dims - 3], k.shape[dims - 3]
    if hkv == 0 or hq % hkv:
        raise ContextParallelError(f"heads: q has {hq} and k/v have {hkv}; q's heads must be a multiple of k/v's "
                                   "(gqa = q heads / kv heads)")


def check_plan(plan, world: int, mask: str, q, k) -> None:
    """A DocumentPlan that fits this group, this mask and these packed shards."""
    if not isinstance(plan, DocumentPlan):
        raise ContextParallelError(f"plan: expected a fagen.distributed.DocumentPlan (plan_documents(...)), got "
                                   f"{type(plan).__name__}")
    if plan.world != world:
        raise ContextParallelError(f"plan: built for {plan.world} ranks, but the group has {world}; build it with "
                                   f"world_size={world}")
    if plan.mask != mask:
        raise ContextParallelError(f"plan: built for mask {plan.mask!r} (its balance counts that mask's pairs), "
                                   f"called with {mask!r}; build it with mask={mask!r}")
    if q.shape[0] != plan.shard_len or k.shape[0] != plan.shard_len:
        raise ContextParallelError(f"packed shards: q has {q.shape[0]} rows and k {k.shape[0]}, the plan's shards "
                                   f"have {plan.shard_len}; cut the packed tensors with plan.shard")
