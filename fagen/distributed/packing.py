"""Packed documents under context parallelism: which rank holds which piece of which document, and what each
(rank, K/V source) block of the ring computes.

A packed sequence of T tokens holds B documents (`cu_seqlens`, FlashAttention's prefix sums); attention runs per
document (mask "none": every token sees its whole document; "causal": token i sees its document's tokens up to i).
`plan_documents(cu_seqlens, world_size, balance=...)` cuts the documents into chunks and gives each chunk to a
rank:
  "contiguous"  rank r holds the r-th of N equal slices of the packed tokens (no balance: the ring's plain cut);
  "zigzag"      every document is cut into 2N near-equal chunks, rank r holds chunks r and 2N-1-r of each;
  "greedy"      longest documents first; a document is zigzag-cut over the k least loaded ranks, with
                k = min(N, length // (2 * min_chunk)) (chunks of at least min_chunk tokens: kernel tiles stay
                full), and a short one (k < 2) goes whole to the least loaded rank. Load = visible pairs.
A rank's shard is its chunks in document order, then zero padding up to `shard_len` (the same on every rank, a
multiple of pad_multiple): the ring's K/V messages have one size.

[Note] One varlen launch per block. The chunks of one document on one rank are stored in document order, and
chunks never overlap, so the keys of source rank s that a query chunk i sees are one contiguous run of s's shard:
all of s's chunks of i's document (mask "none"), or those that start at or before chunk i (causal). Only the
block s == r holds chunk i itself, last in its run: a causal varlen kernel (bottom-right aligned per sequence)
then lets each query see the run's earlier chunks whole and its own chunk up to itself. Every other block is a
mask "none" varlen launch. So a block is one varlen call with one "sequence" per query chunk (its run as the
keys; an empty run for a chunk that sees nothing, and for the padding), gathering the runs' rows when they are not
already one slice. A block no query chunk sees anything of is skipped (no launch). When two query chunks see the
same key rows, those rows are gathered twice; the backward adds their dK/dV back in "layers", each of which
holds a row at most once, so the sums run in a fixed order (deterministic, no atomics on duplicates).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fagen.distributed.shard import ContextParallelError

BALANCES = ("contiguous", "zigzag", "greedy")
PACKED_MASKS = ("none", "causal")


@dataclass(frozen=True)
class Chunk:
    """Tokens start .. start + length - 1 of document `doc` (packed rows row .. row + length - 1), held by `rank`
    at rows offset .. offset + length - 1 of its shard."""
    doc: int
    start: int
    length: int
    row: int
    rank: int
    offset: int


@dataclass(frozen=True)
class Block:
    """What rank r computes against source rank s's K/V shard: one varlen call (see [Note] One varlen launch)."""
    causal: bool                      # the kernel's mask: causal on the diagonal block (s == r), else none
    cu_q: tuple[int, ...]             # the query chunks of r (and the padding), as varlen sequences
    cu_k: tuple[int, ...]             # each query chunk's run of keys, in gathered order
    max_q: int
    max_k: int
    runs: tuple[tuple[int, int], ...]  # (offset in s's shard, length) of each query chunk's run
    pairs: int                        # visible (query, key) pairs


def _cut(length: int, parts: int) -> list[tuple[int, int]]:
    """(start, length) of `parts` near-equal pieces of `length` (the first length % parts one longer)."""
    base, extra = divmod(length, parts)
    out, start = [], 0
    for i in range(parts):
        n = base + (1 if i < extra else 0)
        out.append((start, n))
        start += n
    return out


def _chunk_pairs(start: int, length: int, doc_len: int, mask: str) -> int:
    """Visible pairs of the queries start .. start + length - 1 of a document of doc_len tokens."""
    if mask == "none":
        return length * doc_len
    return length * start + length * (length + 1) // 2


def _read_cu(cu_seqlens) -> tuple[int, ...]:
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point:
            raise ContextParallelError(f"cu_seqlens: expected a 1-D integer tensor, got {cu_seqlens.dtype} of shape "
                                       f"{tuple(cu_seqlens.shape)}")
        cu_seqlens = cu_seqlens.tolist()  # read once on the host: the plan is built on the host
    try:
        cu = tuple(int(x) for x in cu_seqlens)
    except (TypeError, ValueError):
        raise ContextParallelError(f"cu_seqlens: expected prefix sums of ints, got {cu_seqlens!r}") from None
    if len(cu) < 2 or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        raise ContextParallelError(f"cu_seqlens: must start at 0, never decrease and hold at least two entries "
                                   f"(FlashAttention's prefix sums of the document lengths), got {list(cu)[:8]}")
    return cu


class DocumentPlan:
    """Which rank holds which chunk of which document, and every (rank, source) block; built on the host, the same
    on every rank (build it from the same cu_seqlens everywhere). See the module docstring."""

    def __init__(self, cu_seqlens, world_size: int, *, balance: str = "greedy", mask: str = "causal",
                 min_chunk: int = 256, pad_multiple: int = 1):
        if balance not in BALANCES:
            raise ContextParallelError(f"balance: got {balance!r}; must be one of {', '.join(map(repr, BALANCES))}")
        if mask not in PACKED_MASKS:
            raise ContextParallelError(f"mask: got {mask!r}; packed documents take {', '.join(map(repr, PACKED_MASKS))}"
                                       " (per document)")
        for name, value in (("world_size", world_size), ("min_chunk", min_chunk), ("pad_multiple", pad_multiple)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ContextParallelError(f"{name}: expected a positive int, got {value!r}")
        self.cu = _read_cu(cu_seqlens)
        self.world, self.balance, self.mask, self.min_chunk = world_size, balance, mask, min_chunk
        pieces = self._assign()  # (doc, start, length, rank)
        per_rank: list[list[tuple[int, int, int]]] = [[] for _ in range(world_size)]
        for doc, start, length, rank in pieces:
            if length:
                per_rank[rank].append((doc, start, length))
        tokens = max(sum(p[2] for p in chunks) for chunks in per_rank)
        self.shard_len = max(pad_multiple, -(-tokens // pad_multiple) * pad_multiple)
        self.chunks: list[tuple[Chunk, ...]] = []
        for rank, chunks in enumerate(per_rank):
            offset, mine = 0, []
            for doc, start, length in sorted(chunks):
                mine.append(Chunk(doc, start, length, self.cu[doc] + start, rank, offset))
                offset += length
            self.chunks.append(tuple(mine))
        self._blocks: dict[tuple[int, int], Block | None] = {}
        self._device_blocks: dict = {}
        text = repr((self.cu, world_size, balance, mask, min_chunk, self.shard_len))
        self.key = int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")  # one int the ranks compare

    @property
    def doc_lengths(self) -> list[int]:
        return [b - a for a, b in zip(self.cu, self.cu[1:])]

    def _assign(self) -> list[tuple[int, int, int, int]]:
        n, lengths = self.world, self.doc_lengths
        if self.balance == "contiguous":
            per = -(-self.cu[-1] // n) if self.cu[-1] else 1
            out = []
            for doc, length in enumerate(lengths):
                pos = 0
                while pos < length:
                    rank = (self.cu[doc] + pos) // per
                    take = min(length - pos, (rank + 1) * per - self.cu[doc] - pos)
                    out.append((doc, pos, take, rank))
                    pos += take
            return out
        if self.balance == "zigzag":
            return [p for doc, length in enumerate(lengths) for p in self._zigzag(doc, length, list(range(n)))]
        load, tokens, out = [0] * n, [0] * n, []
        for doc in sorted(range(len(lengths)), key=lambda d: (-lengths[d], d)):
            length = lengths[doc]
            k = min(n, length // (2 * self.min_chunk))
            if k < 2:
                rank = min(range(n), key=lambda r: (load[r], tokens[r], r))
                placed = [(doc, 0, length, rank)]
            else:
                placed = self._zigzag(doc, length, sorted(range(n), key=lambda r: (load[r], tokens[r], r))[:k])
            for d, start, size, rank in placed:
                load[rank] += _chunk_pairs(start, size, length, self.mask)
                tokens[rank] += size
            out += placed
        return out

    @staticmethod
    def _zigzag(doc: int, length: int, ranks: list[int]) -> list[tuple[int, int, int, int]]:
        k = len(ranks)
        parts = _cut(length, 2 * k)
        return [(doc, *parts[i], ranks[i]) for i in range(k)] + \
               [(doc, *parts[2 * k - 1 - i], ranks[i]) for i in range(k)]

    # -- the data of a rank -----------------------------------------------------------------------------------------
    def rows(self, rank: int) -> list[int]:
        """The packed rows rank `rank` holds, in shard order (padding excluded)."""
        return [c.row + i for c in self.chunks[rank] for i in range(c.length)]

    def shard(self, x: torch.Tensor, rank: int, *, dim: int = 0) -> torch.Tensor:
        """Rank `rank`'s shard of the packed tensor x ([T, ...] along `dim`): its rows, then zeros to shard_len."""
        if not isinstance(x, torch.Tensor) or x.dim() <= dim or x.shape[dim] != self.cu[-1]:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ContextParallelError(f"shard: expected a tensor with {self.cu[-1]} packed rows (cu_seqlens[-1]) "
                                       f"along dim {dim}, got {got}")
        if not 0 <= rank < self.world:
            raise ContextParallelError(f"shard: need 0 <= rank < {self.world}, got {rank!r}")
        idx = torch.tensor(self.rows(rank), dtype=torch.long, device=x.device)
        part = x.index_select(dim, idx)
        pad = list(part.shape)
        pad[dim] = self.shard_len - part.shape[dim]
        return torch.cat([part, part.new_zeros(pad)], dim=dim).contiguous()

    def unshard(self, shards: list[torch.Tensor], *, dim: int = 0) -> torch.Tensor:
        """The packed tensor from every rank's shard (shards[r] is rank r's), the inverse of shard()."""
        if len(shards) != self.world:
            raise ContextParallelError(f"unshard: expected {self.world} shards, got {len(shards)}")
        whole = torch.cat([s.narrow(dim, 0, self.shard_len) for s in shards], dim=dim)
        return whole.index_select(dim, self.order(whole.device))

    def order(self, device) -> torch.Tensor:
        """int64 [T]: packed row p lies at row order[p] of the ranks' shards concatenated in rank order."""
        key = ("order", str(device))
        if key not in self._device_blocks:
            where = [0] * self.cu[-1]
            for rank, chunks in enumerate(self.chunks):
                for c in chunks:
                    for i in range(c.length):
                        where[c.row + i] = rank * self.shard_len + c.offset + i
            self._device_blocks[key] = torch.tensor(where, dtype=torch.long, device=device)
        return self._device_blocks[key]

    def is_identity(self) -> bool:
        """True when the shards concatenated in rank order are the packed rows (then padding at the end only)."""
        return all(c.rank * self.shard_len + c.offset == c.row for chunks in self.chunks for c in chunks)

    def shard_for_group(self, x: torch.Tensor, *, group=None, dim: int = 0) -> torch.Tensor:
        return self.shard(x, dist.get_rank(group), dim=dim)

    def gather(self, x: torch.Tensor, *, group=None, dim: int = 0) -> torch.Tensor:
        """Collective: every rank passes its shard and gets the packed tensor back. Not differentiable."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x, group=group)
        return self.unshard(parts, dim=dim)

    # -- the blocks -------------------------------------------------------------------------------------------------
    def block(self, rank: int, source: int) -> Block | None:
        """What `rank` computes against `source`'s K/V shard; None when it sees nothing of it (skipped)."""
        key = (rank, source)
        if key not in self._blocks:
            self._blocks[key] = self._build_block(rank, source)
        return self._blocks[key]

    def _build_block(self, rank: int, source: int) -> Block | None:
        by_doc: dict[int, list[Chunk]] = {}
        for c in self.chunks[source]:
            by_doc.setdefault(c.doc, []).append(c)
        lengths = self.doc_lengths
        cu_q, cu_k, runs, pairs = [0], [0], [], 0
        for c in self.chunks[rank]:
            run = [s for s in by_doc.get(c.doc, ()) if self.mask == "none" or s.start <= c.start]
            start = run[0].offset if run else 0
            size = sum(s.length for s in run)
            runs.append((start, size))
            cu_q.append(cu_q[-1] + c.length)
            cu_k.append(cu_k[-1] + size)
            for s in run:
                pairs += c.length * (c.length + 1) // 2 if s is c and self.mask == "causal" else c.length * s.length
        if pairs == 0:
            return None
        if cu_q[-1] < self.shard_len:  # the padding: one sequence that sees nothing
            cu_q.append(self.shard_len)
            cu_k.append(cu_k[-1])
            runs.append((0, 0))
        max_q = max(b - a for a, b in zip(cu_q, cu_q[1:]))
        max_k = max(b - a for a, b in zip(cu_k, cu_k[1:]))
        return Block(causal=self.mask == "causal" and rank == source, cu_q=tuple(cu_q), cu_k=tuple(cu_k),
                     max_q=max_q, max_k=max_k, runs=tuple(runs), pairs=pairs)

    def device_block(self, rank: int, source: int, device) -> dict | None:
        """The block's device tensors: cu_q, cu_k (int32), and how to gather the keys and scatter their gradients:
        "slice" (start, end) when the runs are one slice of the shard in order, else "gather" (int64 rows) and
        "layers" [(shard rows, gathered rows)], each layer holding a shard row at most once."""
        key = (rank, source, str(device))
        if key in self._device_blocks:
            return self._device_blocks[key]
        b = self.block(rank, source)
        if b is None:
            self._device_blocks[key] = None
            return None
        out = {"block": b, "cu_q": torch.tensor(b.cu_q, dtype=torch.int32, device=device),
               "cu_k": torch.tensor(b.cu_k, dtype=torch.int32, device=device)}
        live = [(s, n) for s, n in b.runs if n]
        if all(s == ps + pn for (ps, pn), (s, _) in zip(live, live[1:])):
            out["slice"] = (live[0][0], live[-1][0] + live[-1][1])
        else:
            seen: dict[int, int] = {}
            layers: list[tuple[list[int], list[int]]] = []
            gathered = []
            for s, n in live:
                for row in range(s, s + n):
                    layer = seen.get(row, 0)
                    seen[row] = layer + 1
                    if layer == len(layers):
                        layers.append(([], []))
                    layers[layer][0].append(row)
                    layers[layer][1].append(len(gathered))
                    gathered.append(row)
            out["gather"] = torch.tensor(gathered, dtype=torch.long, device=device)
            out["layers"] = [(torch.tensor(a, dtype=torch.long, device=device),
                              torch.tensor(g, dtype=torch.long, device=device)) for a, g in layers]
        self._device_blocks[key] = out
        return out

    # -- balance ----------------------------------------------------------------------------------------------------
    def pairs(self) -> list[list[int]]:
        """Visible pairs [rank][source]."""
        return [[(b.pairs if (b := self.block(r, s)) else 0) for s in range(self.world)] for r in range(self.world)]

    def tile_pairs(self, tile: int = 128) -> list[list[int]]:
        """Pairs [rank][source] as a kernel with tile x tile blocks computes them: every tile that holds a visible
        pair counts whole (short chunks waste most of their tiles)."""
        out = [[0] * self.world for _ in range(self.world)]
        for r in range(self.world):
            for s in range(self.world):
                b = self.block(r, s)
                if b is None:
                    continue
                for c, (_, lk) in zip(self.chunks[r], b.runs):
                    rows = -(-c.length // tile)
                    if b.causal:  # row tile i sees the run's earlier keys and its own chunk up to its last row
                        prefix = lk - c.length
                        out[r][s] += sum(-(-(prefix + min(c.length, (i + 1) * tile)) // tile) for i in range(rows))
                    else:
                        out[r][s] += rows * -(-lk // tile)
                out[r][s] *= tile * tile
        return out

    def balance_stats(self, tile: int = 128) -> dict:
        """How even the work is, against ideal = total visible pairs / ranks: `ratio` = ideal / the busiest rank's
        pairs; `ring_ratio` the same for a ring that waits for its slowest rank at every step (step i: rank r
        against rank r - i's block); `tile_ratio` = ideal / the busiest rank's pairs counted in whole tile x tile
        kernel blocks (tile_pairs); `tokens` = the busiest rank's tokens / the mean (the padding shard_len adds)."""
        p, n = self.pairs(), self.world
        total = sum(map(sum, p))
        ideal = total / n
        busiest = max(map(sum, p))
        stepped = sum(max(p[r][(r - i) % n] for r in range(n)) for i in range(n))
        tiled = max(map(sum, self.tile_pairs(tile)))
        tokens = [sum(c.length for c in chunks) for chunks in self.chunks]
        return {"total_pairs": total, "ideal": ideal, "busiest": busiest, "ratio": ideal / busiest if busiest else 1.0,
                "ring_ratio": ideal / stepped if stepped else 1.0, "tile_ratio": ideal / tiled if tiled else 1.0,
                "chunks": sum(map(len, self.chunks)), "shard_len": self.shard_len,
                "tokens": max(tokens) / (sum(tokens) / n) if sum(tokens) else 1.0}


def plan_documents(cu_seqlens, world_size: int, *, balance: str = "greedy", mask: str = "causal",
                   min_chunk: int = 256, pad_multiple: int = 1) -> DocumentPlan:
    """The DocumentPlan of packed documents `cu_seqlens` (ints or a 1-D int tensor, read on the host) over
    `world_size` ranks; see the module docstring for `balance`."""
    return DocumentPlan(cu_seqlens, world_size, balance=balance, mask=mask, min_chunk=min_chunk,
                        pad_multiple=pad_multiple)


__all__ = ["BALANCES", "PACKED_MASKS", "Chunk", "Block", "DocumentPlan", "plan_documents"]
