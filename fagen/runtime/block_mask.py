"""fagen.create_block_mask: which (query block, key block) tiles a mask_mod hides entirely, shows entirely, or cuts,
evaluated on the device from the same expression tree the attention kernels emit; built once, reused across layers.

[Note] Block classes. For each (b, h, query block, key block) a generated Triton kernel
(templates/triton/block_mask.py.j2) evaluates the mask_mod at every element of the block, as FlexAttention's
create_block_mask does, and stores 0 (empty: no element visible), 1 (partial) or 2 (full: every element inside
the sequences visible; elements past seq_q or seq_k are ignored, the attention kernels mask those themselves).
The classes are exact, not a bound: an attention kernel never loads an empty block and never evaluates the mask
per element on a full one. A mask that reads neither b nor h is evaluated once and broadcast (B and H of 1).
From the classes, on the device and without a host sync: kv_num_blocks / kv_indices (per query block, its
non-empty key blocks in ascending order, the forward's and dq's loop) and q_num_blocks / q_indices (per key
block, its non-empty query blocks, the dk/dv loop). The classes hold for the captured values at build time: a
block mask built before a document-id tensor changed describes the old documents; build a new one.
"""

from __future__ import annotations

import dataclasses

import torch

from fagen.runtime.mods import prepare

DEFAULT_BLOCK = 128  # FlexAttention's default; the attention kernels' blocks must be multiples of it or divide it


@dataclasses.dataclass(frozen=True)
class BlockMask:
    """The block classes of one mask_mod over [B, H, Sq, Sk] (b and h dims of size 1 where the mask ignores them)."""

    mask_mod: str  # the mask's canonical text (checked against the call's mask_mod)
    seq_q: int
    seq_k: int
    block_m: int
    block_n: int
    classes: torch.Tensor  # int8 [B', H', cdiv(Sq, block_m), cdiv(Sk, block_n)]: 0 empty, 1 partial, 2 full
    density: float = 1.0  # the fraction of blocks that are not empty, at the build's blocks (read once, at the build)

    @property
    def shape(self) -> tuple:
        return tuple(self.classes.shape)

    def kv_lists(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(kv_num_blocks int32 [B', H', QB], kv_indices int32 [B', H', QB, KB]): each query block's non-empty key
        blocks, ascending, then the empty ones."""
        return _lists(self.classes)

    def q_lists(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(q_num_blocks int32 [B', H', KB], q_indices int32 [B', H', KB, QB]): the transposed lists (dk, dv)."""
        return _lists(self.classes.transpose(-1, -2))

    def sparsity(self) -> float:
        """The fraction of blocks that are empty (skipped)."""
        return float((self.classes == 0).float().mean())

    def at(self, block_m: int, block_n: int) -> BlockMask:
        """The same classes at a coarser granularity (multiples of this one's): a coarse block is empty when all
        its blocks are, full when all are full, partial otherwise."""
        if block_m == self.block_m and block_n == self.block_n:
            return self
        if block_m % self.block_m or block_n % self.block_n:
            raise ValueError(f"block_mask: built with blocks {self.block_m}x{self.block_n}, which do not divide "
                             f"{block_m}x{block_n}; build it with block_size={_gcd_hint(block_m, block_n)}")
        fm, fn = block_m // self.block_m, block_n // self.block_n
        c = self.classes
        qb, kb = c.shape[-2], c.shape[-1]
        f = torch.nn.functional
        edges = (0, -kb % fn, 0, -qb % fm)  # padded blocks lie past the sequences: neutral (full for min, empty for max)
        lo = -f.max_pool2d(-f.pad(c.float(), edges, value=2.0).flatten(0, 1)[:, None], (fm, fn))
        hi = f.max_pool2d(f.pad(c.float(), edges, value=0.0).flatten(0, 1)[:, None], (fm, fn))
        coarse = torch.where(hi == 0, 0, torch.where(lo == 2, 2, 1)).to(torch.int8)
        return dataclasses.replace(self, block_m=block_m, block_n=block_n,
                                   classes=coarse[:, 0].view(*c.shape[:2], *coarse.shape[-2:]))

    def __repr__(self) -> str:
        return (f"BlockMask({self.mask_mod!r}, shape={self.shape}, blocks={self.block_m}x{self.block_n}, "
                f"sparsity={self.sparsity():.2f})")


def _gcd_hint(m: int, n: int) -> int:
    import math

    return math.gcd(m, n)


def _lists(classes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    nonempty = classes != 0
    num = nonempty.sum(-1, dtype=torch.int32)
    order = torch.argsort((~nonempty).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return num, order.contiguous()


def create_block_mask(mask_mod, B: int | None, H: int | None, Sq: int, Sk: int, *, device=None,
                      block_size: int | tuple[int, int] = DEFAULT_BLOCK) -> BlockMask:
    """The block classes of mask_mod(b, h, q_idx, kv_idx) over B batches, H query heads, Sq queries and Sk keys
    ([Note] Block classes). B or H None: the mask must not read b or h, and the result broadcasts over them.
    Pass the result to fagen.attention(..., mask_mod=mask_mod, block_mask=...) for every layer of that shape."""
    mods = prepare(mask_mod=mask_mod)
    _, text, tensors, scalars = mods.fields
    return from_text(text, tensors, scalars, mods.values, B, H, Sq, Sk, device=device, block_size=block_size)


def from_text(text: str, tensors: tuple, scalars: tuple, values: dict, B: int | None, H: int | None, Sq: int,
              Sk: int, *, device=None, block_size: int | tuple[int, int] = DEFAULT_BLOCK) -> BlockMask:
    """create_block_mask for a mask_mod given as a spec's text, declarations and captured values (fagen verify)."""
    from fagen.codegen.block_mask import block_mask_source, reads
    from fagen.mods.text import ModScalar, ModTensor
    from fagen.runtime.loader import load_source

    tensors = tuple(ModTensor(*t) for t in tensors)
    scalars = tuple(ModScalar(*s) for s in scalars)

    bm, bn = (block_size, block_size) if isinstance(block_size, int) else block_size
    for name, value in (("Sq", Sq), ("Sk", Sk), ("block_size", bm), ("block_size", bn)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name[0] == "b" else 0):
            raise ValueError(f"create_block_mask: {name} must be a non-negative int (block sizes positive), "
                             f"got {value!r}")
    if bm & (bm - 1) or bn & (bn - 1) or min(bm, bn) < 16:
        raise ValueError(f"create_block_mask: block_size must be powers of two >= 16, got {bm}x{bn}")
    used = reads(text, tensors, scalars)
    for name, value in (("B", B), ("H", H)):
        if value is None and name.lower() in used:
            raise ValueError(f"create_block_mask: {name}=None broadcasts, but the mask_mod reads "
                             f"{name.lower()}; pass {name}")
    nb = B if "b" in used else 1
    nh = H if "h" in used else 1
    if device is None:
        device = next((v.device for v in values.values() if isinstance(v, torch.Tensor)), None) or \
            ("cuda" if torch.cuda.is_available() else "cpu")
    qb, kb = -(-Sq // bm), -(-Sk // bn)
    classes = torch.empty((nb, nh, qb, kb), dtype=torch.int8, device=device)
    if classes.numel():
        source = block_mask_source(text, tensors, scalars)
        module = load_source(source, "block_mask")
        from fagen.codegen.mod_args import ModArgs, host_values

        extra = host_values(ModArgs(tensors, scalars), values)
        module._block_classes[(qb, nh, nb)](classes, *classes.stride()[:3], Sq, Sk, kb, *extra,
                                           BLOCK_M=bm, BLOCK_N=bn)
    # one read of the device at the build (never in an attention call): [Note] Forward tiles in runtime/modded.py
    density = float((classes != 0).float().mean()) if classes.numel() else 0.0
    return BlockMask(text, Sq, Sk, bm, bn, classes, density)


# [Note] Partial and full lists. A kernel visits the partial blocks of a row (query block, or key block for dK/dV)
# in one loop that evaluates the mask_mod, then its full blocks in a second loop that does not: each loop is
# compiled for its case (a constexpr), as the plain kernels' masked and unmasked phases are, so a full block runs
# the plain path's ops with no branch and no mask registers in its loop (FlexAttention's KV_IDX / FULL_KV_IDX).
# A row of n blocks holds 4n + 2 int32: the partial blocks ascending (then padding), the full ones ascending (then
# padding), the running count of partial blocks (n + 1 entries: before block j, for j = 0..n) and that of full
# ones. A kernel whose built-in mask limits the row to blocks [a, b) takes entries count[a] .. count[b] of each.
# The forward lists (query rows) hold one int32 more, 4n + 3: entry 4n + 2 of flat row r (r = h' * QB + query block,
# for each b') is the r-th work item of [Note] Work order.
#
# [Note] Work order. A mask_mod's query blocks carry very different work (a document mask: 0 to 27 key blocks at
# 128 x 64 tiles, 7 on average), and the plain kernels' launch order (each head's query blocks in reverse, head after
# head) leaves a heavy block of the last heads for the tail of the grid. So the dense forward walks the (head,
# query block) pairs heaviest first, across heads: the flat rows of each b' sorted by descending work (3 per partial
# block, 2 per full block, 2 for the program itself; ties in ascending order), a list the kernel reads at its start
# (_work_item in templates/triton/mods.j2). A block mask broadcast over h (H' = 1) lists query blocks and the heads
# interleave (program p takes item p // H, head p % H). A greedy schedule of the bench's rows on 132 SMs (costs from
# the block counts) puts the reverse launch order's makespan at 1.05-1.21x the ideal and this order's at 1.01-1.04x.
def _kernel_form(self: BlockMask, device, min_m: int = 16, min_n: int = 16) -> tuple:
    """(classes, lists, transposed lists, block_m, block_n) as the generated kernels take them ([Note] Block
    classes, [Note] Partial and full lists), at blocks of at least min_m x min_n (the largest tiles of the kernels
    that read it: coarsened here when needed), memoised."""
    bm = self
    while bm.block_m < min_m or bm.block_n < min_n:
        bm = bm.at(max(bm.block_m, min_m), max(bm.block_n, min_n))
    key = (bm.block_m, bm.block_n, str(device))
    memo = self.__dict__.setdefault("_forms", {})
    if key not in memo:
        def lists(classes, order=False):  # [Note] Partial and full lists
            parts = []
            for cls in (1, 2):
                _, idx = _lists(torch.where(classes == cls, cls, 0).to(torch.int8))
                parts.append(idx)
            for cls in (1, 2):
                count = torch.cumsum((classes == cls).to(torch.int32), -1, dtype=torch.int32)
                parts.append(torch.nn.functional.pad(count, (1, 0)))
            if order:
                parts.append(work_order(classes))
            return torch.cat(parts, -1).to(device).contiguous()

        memo[key] = (bm.classes.to(device).contiguous(), lists(bm.classes, order=True),
                     lists(bm.classes.transpose(-1, -2)), bm.block_m, bm.block_n)
    return memo[key]


def work_order(classes: torch.Tensor) -> torch.Tensor:
    """int32 [B', H', QB, 1]: flat row r (h' * QB + query block) holds the r-th heaviest flat row of its b'
    ([Note] Work order)."""
    work = (3 * (classes == 1).sum(-1) + 2 * (classes == 2).sum(-1) + 2).flatten(1)  # [B', H' * QB]
    order = torch.argsort(work, dim=-1, descending=True, stable=True).to(torch.int32)
    return order.view(*classes.shape[:3], 1)


BlockMask.kernel_form = _kernel_form
