"""Sequence layouts of context parallelism: cut a full tensor into per-rank shards and put it back together.

Two layouts, for q, k and v alike, along the sequence dimension (dim 2 of [B, H, S, D] by default):
  "contiguous"  rank r of N holds the r-th of N equal chunks;
  "zigzag"      the sequence is cut into 2N equal chunks and rank r holds chunks r and 2N-1-r, concatenated,
                so that under a causal mask every rank has the same amount of work.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

LAYOUTS = ("contiguous", "zigzag")


class ContextParallelError(ValueError):
    """Bad input to fagen.distributed; the message says what is wrong and how to fix it."""


def check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise ContextParallelError(f"layout: got {layout!r}; must be one of {', '.join(map(repr, LAYOUTS))}")
    return layout


def chunk_ids(rank: int, world_size: int, layout: str) -> list[int]:
    """The indices of the equal chunks of the full sequence that `rank` holds, in the order it holds them.

    contiguous: [rank] out of world_size chunks; zigzag: [rank, 2 * world_size - 1 - rank] out of 2 * world_size.
    """
    check_layout(layout)
    if layout == "contiguous":
        return [rank]
    return [rank, 2 * world_size - 1 - rank]


def _chunks_per_rank(layout: str) -> int:
    return 1 if layout == "contiguous" else 2


def shard(x: torch.Tensor, rank: int, world_size: int, *, layout: str = "contiguous", dim: int = 2) -> torch.Tensor:
    """Rank `rank`'s shard of the full tensor `x` (a new contiguous tensor), cut along `dim` in `layout`."""
    check_layout(layout)
    if not isinstance(x, torch.Tensor):
        raise ContextParallelError(f"shard: expected a torch.Tensor, got {type(x).__name__}")
    if not isinstance(world_size, int) or world_size < 1 or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ContextParallelError(f"shard: need 0 <= rank < world_size, got rank {rank!r}, world_size {world_size!r}")
    n_chunks = world_size * _chunks_per_rank(layout)
    length = x.shape[dim]
    if length % n_chunks:
        raise ContextParallelError(
            f"shard: the sequence (dim {dim}) has {length} positions, which the {layout} layout over {world_size} "
            f"ranks cannot cut into {n_chunks} equal chunks; pad it to a multiple of {n_chunks}")
    pieces = x.chunk(n_chunks, dim=dim)
    return torch.cat([pieces[i] for i in chunk_ids(rank, world_size, layout)], dim=dim).contiguous()


def unshard(shards: list[torch.Tensor], *, layout: str = "contiguous", dim: int = 2) -> torch.Tensor:
    """The full tensor from every rank's shard (shards[r] is rank r's), the inverse of shard()."""
    check_layout(layout)
    world_size = len(shards)
    if world_size == 0:
        raise ContextParallelError("unshard: got no shards")
    per = _chunks_per_rank(layout)
    lengths = {s.shape[dim] for s in shards}
    if len(lengths) != 1 or next(iter(lengths)) % per:
        raise ContextParallelError(
            f"unshard: every shard needs one length along dim {dim}"
            + (" that is even (two zigzag chunks)" if per == 2 else "") + f"; got {[s.shape[dim] for s in shards]}")
    chunks: list[torch.Tensor | None] = [None] * (world_size * per)
    for rank, s in enumerate(shards):
        for piece, idx in zip(s.chunk(per, dim=dim), chunk_ids(rank, world_size, layout)):
            chunks[idx] = piece
    return torch.cat(chunks, dim=dim)


def gather(x: torch.Tensor, *, group=None, layout: str = "contiguous", dim: int = 2) -> torch.Tensor:
    """Collective: every rank passes its shard and gets the full tensor back (all_gather, then unshard).

    Not differentiable; use it to collect results or to compare against a single-device run.
    """
    check_layout(layout)
    world_size = dist.get_world_size(group)
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(parts, x, group=group)
    return unshard(parts, layout=layout, dim=dim)


def shard_for_group(x: torch.Tensor, *, group=None, layout: str = "contiguous", dim: int = 2) -> torch.Tensor:
    """This rank's shard of the full tensor `x` (which every rank holds), for the ranks of `group`."""
    return shard(x, dist.get_rank(group), dist.get_world_size(group), layout=layout, dim=dim)


__all__ = ["LAYOUTS", "ContextParallelError", "chunk_ids", "shard", "unshard", "gather", "shard_for_group"]
