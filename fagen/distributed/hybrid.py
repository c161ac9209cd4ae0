"""Hybrid context parallelism (USP, as in yunchang): Ulysses inside groups of `ulysses_degree` ranks, the ring
across `ring_degree` such groups.

Rank g of the group (N = ulysses_degree * ring_degree ranks) is ring rank g // U and Ulysses rank g % U: the U
ranks of a Ulysses group are consecutive (one node's NVLink domain for the all-to-all), and the ring links the ranks
with the same Ulysses rank across groups. The sequence is cut in `layout` over the R ring ranks (or by a
DocumentPlan over them), and each ring shard into U contiguous pieces, one per Ulysses rank. The all-to-all inside
the Ulysses group gathers the ring shard for Hq/U heads; the ring turns over the ring group with those heads; an
all-to-all brings the output back to sequence pieces.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from fagen.distributed.check import HINTS, SHOW, agree_or_raise, require_initialized
from fagen.distributed.common import check_tensors
from fagen.distributed.packing import DocumentPlan
from fagen.distributed.ring import _check_local as _check_ring
from fagen.distributed.ring import ring_attention
from fagen.distributed.shard import ContextParallelError, shard, unshard
from fagen.distributed.ulysses import heads_to_seq, kv_split, seq_to_heads


@dataclass(frozen=True, eq=False)
class HybridGroups:
    """The 2D split of a group: this rank's Ulysses group (U consecutive ranks) and ring group (R ranks, stride U)."""
    ulysses_degree: int
    ring_degree: int
    group: object
    ulysses_group: object
    ring_group: object
    ulysses_rank: int
    ring_rank: int

    # -- dense shards -----------------------------------------------------------------------------------------------
    def shard(self, x: torch.Tensor, *, layout: str = "contiguous", dim: int = 2) -> torch.Tensor:
        """This rank's shard of the full tensor x: ring shard `ring_rank` in layout, then its Ulysses piece."""
        ring_shard = shard(x, self.ring_rank, self.ring_degree, layout=layout, dim=dim)
        return self._piece(ring_shard, dim)

    def unshard(self, shards: list[torch.Tensor], *, layout: str = "contiguous", dim: int = 2) -> torch.Tensor:
        """The full tensor from every rank's shard (shards[g] is group rank g's), the inverse of shard()."""
        u = self.ulysses_degree
        rings = [torch.cat(shards[r * u:(r + 1) * u], dim=dim) for r in range(self.ring_degree)]
        return unshard(rings, layout=layout, dim=dim)

    def gather(self, x: torch.Tensor, *, layout: str = "contiguous", dim: int = 2) -> torch.Tensor:
        """Collective over the group: every rank gets the full tensor back. Not differentiable."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.ulysses_degree * self.ring_degree)]
        dist.all_gather(parts, x, group=self.group)
        return self.unshard(parts, layout=layout, dim=dim)

    # -- packed documents -------------------------------------------------------------------------------------------
    def plan(self, cu_seqlens, *, balance: str = "greedy", mask: str = "causal", min_chunk: int = 256) -> DocumentPlan:
        """The DocumentPlan over the ring ranks (shards padded to a multiple of ulysses_degree)."""
        return DocumentPlan(cu_seqlens, self.ring_degree, balance=balance, mask=mask, min_chunk=min_chunk,
                            pad_multiple=self.ulysses_degree)

    def shard_packed(self, x: torch.Tensor, plan: DocumentPlan) -> torch.Tensor:
        """This rank's rows of the packed tensor x [T, ...]: its Ulysses piece of the plan's ring shard."""
        return self._piece(plan.shard(x, self.ring_rank), 0)

    def gather_packed(self, x: torch.Tensor, plan: DocumentPlan) -> torch.Tensor:
        """Collective over the group: every rank gets the packed tensor back. Not differentiable."""
        x = x.contiguous()
        u = self.ulysses_degree
        parts = [torch.empty_like(x) for _ in range(u * self.ring_degree)]
        dist.all_gather(parts, x, group=self.group)
        return plan.unshard([torch.cat(parts[r * u:(r + 1) * u]) for r in range(self.ring_degree)])

    def _piece(self, ring_shard: torch.Tensor, dim: int) -> torch.Tensor:
        u, length = self.ulysses_degree, ring_shard.shape[dim]
        if length % u:
            raise ContextParallelError(f"shard: a ring shard of {length} positions does not cut into "
                                       f"ulysses_degree={u} equal pieces; pad the sequence")
        return ring_shard.chunk(u, dim=dim)[self.ulysses_rank].contiguous()


def hybrid_groups(*, ulysses_degree: int | None = None, ring_degree: int | None = None, group=None) -> HybridGroups:
    """Collective (every rank of `group` calls it, once): split `group` (default: the whole world) into Ulysses
    groups of ulysses_degree consecutive ranks and ring groups across them. Give either degree or both; their
    product must be the group's size."""
    require_initialized()
    world = dist.get_world_size(group)
    for name, value in (("ulysses_degree", ulysses_degree), ("ring_degree", ring_degree)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ContextParallelError(f"{name}: expected a positive int, got {value!r}")
    if ulysses_degree is None and ring_degree is None:
        raise ContextParallelError("hybrid_groups: give ulysses_degree or ring_degree (or both)")
    u = ulysses_degree or (world // ring_degree if world % ring_degree == 0 else 0)
    r = ring_degree or (world // ulysses_degree if world % ulysses_degree == 0 else 0)
    if u * r != world:
        raise ContextParallelError(f"hybrid_groups: ulysses_degree {ulysses_degree} x ring_degree {ring_degree} must "
                                   f"be the group's {world} ranks")
    whole = group if group is not None else dist.group.WORLD
    ranks = [dist.get_global_rank(whole, g) for g in range(world)]
    me = dist.get_rank(group)
    ulysses = ring = None
    for i in range(r):  # every rank creates every group, in one order (torch.distributed's rule)
        g = dist.new_group(ranks[i * u:(i + 1) * u])
        ulysses = g if i == me // u else ulysses
    for j in range(u):
        g = dist.new_group(ranks[j::u])
        ring = g if j == me % u else ring
    return HybridGroups(u, r, group, ulysses, ring, me % u, me // u)


def hybrid_attention(q, k, v, *, groups: HybridGroups, mask: str = "none", scale: float | None = None,
                     layout: str = "contiguous", plan: DocumentPlan | None = None,
                     check_ranks: bool = True) -> torch.Tensor:
    """Attention over a sequence sharded across groups.group by Ulysses inside groups.ulysses_group and the ring
    across groups.ring_group; differentiable. q [B, Hq, S/N, D], k and v [B, Hkv, S/N, D] are this rank's shards
    (groups.shard), or packed [rows, H, D] shards of a plan over the ring ranks (groups.plan, groups.shard_packed).
    mask "none" or "causal" (the ring's); Hq must divide by ulysses_degree, and Hkv divide by it or it by Hkv
    (K/V heads replicated then). Returns this rank's shard of the output. Raises ContextParallelError on every
    rank of the group, before any data moves, on bad input."""
    require_initialized()
    if not isinstance(groups, HybridGroups):
        raise ContextParallelError(f"groups: expected fagen.distributed.hybrid_groups(...), got "
                                   f"{type(groups).__name__}")
    u, packed = groups.ulysses_degree, plan is not None
    seq = 0 if packed else 2
    error, fields, rep = None, [], 1
    try:
        check_tensors(q, k, v, 3 if packed else 4)
        rep = kv_split(q.shape[1], k.shape[1], u)
        ring_shape = [list(t.shape) for t in (q, k)]  # what the ring gets after the all-to-all
        for s in ring_shape:
            s[seq] *= u
        ring_shape[0][1] //= u
        ring_shape[1][1] = k.shape[1] * rep // u
        meta = [torch.empty(s, dtype=q.dtype, device="meta") for s in ring_shape]
        _, _, fields = _check_ring(meta[0], meta[1], meta[1], groups.ring_group, mask, layout, scale, plan)
        fields.append(("ulysses_degree", u))
    except ContextParallelError as e:
        error, fields = e, []
    agree_or_raise(groups.group, error, fields, check_ranks, show=SHOW, hints=HINTS)
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    q, k, v = (seq_to_heads(t, groups.ulysses_group, seq_dim=seq, head_dim=1) for t in (q, k, v))
    out = ring_attention(q, k, v, group=groups.ring_group, mask=mask, scale=scale, layout=layout, plan=plan,
                         check_ranks=False)
    return heads_to_seq(out, groups.ulysses_group, seq_dim=seq, head_dim=1)


__all__ = ["HybridGroups", "hybrid_groups", "hybrid_attention"]
