"""Defaults: the launch config a spec gets when it leaves block sizes, warps and stages unset (tuned table
first, then the hand defaults), and the cuda backend's limits."""

from __future__ import annotations

from fagen.spec import tuned
from fagen.spec.axes import DType, Direction, Kind, Layout, Mask

def default_config(head_dim: int, dtype: DType, direction: Direction, kind: Kind, mask: Mask | None = None,
                   arch: str = tuned.DEFAULT_ARCH, layout: Layout = Layout.DENSE, window: bool = False) -> dict:
    """Block sizes, warps and stages used when a spec leaves them unset.

    The tuned table (fagen/spec/tuned.json, written by `fagen tune` on the H100) wins for its (arch, head_dim, mask,
    dtype, direction, kind); otherwise these hand defaults apply. The forward's are the tuned winners of the bf16
    keys, so fp16 and other head dims follow them: d128 m128n128w8s3 (547 TF/s full, 524 causal at s16k with
    TMA), d64 m128n128w4s3 (448 causal). Wider tiles stay within Hopper's 227 KB of shared memory: K/V tiles
    cost block_n * head_dim * bytes * 2 * num_stages. Windowed d64 forwards take their own tile, before the
    table (whose keys have no score switches): see [Note] Windowed d64 tiles.
    """
    wide = head_dim > 128 or dtype is DType.FP32
    if window and head_dim <= 64 and not wide and direction is Direction.FWD and kind is Kind.PREFILL:
        # [Note] Windowed d64 tiles. The window's width is a runtime argument, so the spec only knows that there
        # is one. The d64 models with windowed layers use small windows (gpt-oss: 128 keys, alternate layers),
        # where a 128 x 128 tile loads 2-3 key blocks (256-384 keys) per 128-key window, every one of them with
        # mask arithmetic. H100, gpt-oss layer (d64, causal window 128, sinks, GQA 64/8, s8k, bf16;
        # benchmarks/scores.md): m128n128w4s3 (the plain d64 tile) 68-69 TF/s, 0.88x FlexAttention (78);
        # m64n32w4s3 104-105 TF/s (1.33-1.35x Flex, three runs); m64n16 98, m64n32s4 101, m64n64 90, m128n32 83,
        # m32 blocks 48-67. A wide window pays for the small tile: d64 causal window 4096 at s16k runs 349 TF/s
        # on it against 379 on m128n128w4s3 (0.92x); a caller who knows its window is wide sets the blocks.
        return {"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 3}
    found = tuned.lookup(head_dim, mask, dtype, direction, kind, arch=arch)
    if found is not None:
        return found
    if kind is Kind.DECODE:
        # block_m caps the query rows of one tile (gqa * Sq packed; the launcher shrinks it to fit), block_n is
        # keys per step. Memory-bound: stages keep K/V loads in flight. At 4 warps the fp32 accumulator of a
        # 64 x 128 tile is 64 registers a thread; 128 rows spill (sm_90 ptxas), so more rows take more tiles.
        if wide:
            return {"block_m": 32, "block_n": 32, "num_warps": 4, "num_stages": 2}
        if layout is Layout.PAGED:
            # [Note] Paged decode tiles. Each block's rows are gathered through the block table, a dependent load
            # before K/V: wider blocks amortise it. H100, d128 bf16 32/8 heads, page 16 (c68d572:scripts/paged_sweep.py,
            # 2026-11-23): n128 w4 s2 2904 / 2868 GB/s (KV 8k x b32 / 32k x b8), n64 w4 s3 2799 / 2788,
            # n32 2380 / 2374; dense decode (n64 w4 s3) 2952 / 2920 on the same problems.
            return {"block_m": 64, "block_n": 128, "num_warps": 4, "num_stages": 2}
        return {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 3}
    if direction is Direction.BWD:
        # block_n = keys per dK/dV program, block_m = queries per dQ program; each steps over the other axis in
        # tiles of at most 64 (fagen/templates/triton/backward.py.j2, [Note] Backward tiles). The forward of a bwd module
        # runs with the same values, so d128 takes the forward's best tile. H100 sweep: docs/backward.md.
        if wide:
            return {"block_m": 64, "block_n": 32, "num_warps": 8, "num_stages": 2}
        if head_dim <= 64:
            return {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 3}
        if mask == Mask.TREE:  # measured only for correctness: the masked steps stage tree-mask tiles too
            return {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 2}
        return {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 3}
    if wide:
        return {"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 2}
    if head_dim <= 64 and mask == Mask.TREE:
        # m128n128w4s3 spilled 2380 words on sm_80 and 1138 on sm_90 (ptxas, d64 fp16): the masked steps stage
        # tree-mask tiles too. m128n64w8s2 spills none on either (fagen compile --arch sm_80,sm_90, 2026-11-23).
        return {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 2}
    if head_dim <= 64:
        return {"block_m": 128, "block_n": 128, "num_warps": 4, "num_stages": 3}
    return {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 3}


# -- CUDA backend ------------------------------------------------------------------------------
# [Note] CUDA tiles. The forward kernel gives each warp 16 or 32 query rows (one or two 16-row MMA tiles:
# block_m / num_warps in CUDA_ROWS_PER_WARP), streams K/V through a ring of num_stages shared-memory
# buffers, and pads head_dim to a multiple of 16 plus 8 elements of row padding (ldmatrix bank spread).
CUDA_SUPPORTED = {
    "dtype": ((DType.FP16, DType.BF16), "the cuda backend computes fp16 and bf16 on tensor cores; use "
                                        "backend 'triton' for fp32"),
    "direction": ((Direction.FWD,), "the cuda backend has the forward only; use backend 'triton' for bwd"),
    "block_m": ((64, 128, 256), "the cuda backend supports block_m 64, 128 or 256"),
    "block_n": ((32, 64), "the cuda backend supports block_n 32 or 64"),
    "num_stages": ((2, 3, 4), "the cuda backend pipelines K/V through 2, 3 or 4 shared-memory stages"),
}
CUDA_ROWS_PER_WARP = (16, 32)


def cuda_default_config(head_dim: int, dtype: DType, direction: Direction, kind: Kind) -> dict:
    """Blocks, warps and stages of a cuda spec that leaves them unset.

    head_dim <= 128: 4 warps of 32 query rows (two MMA tiles: each K/V fragment read from shared memory feeds
    four MMAs), 64 keys a step, two stages: two blocks per SM. H100, d128 bf16 s16k: 369 TF/s full, 343 causal
    (SDPA flash 364 / 322 in the same run; docs/cuda.md). Wider heads: 16 rows per warp, so that the fp32
    accumulator of a warp stays within its registers.
    """
    if head_dim > 128:
        return {"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 2}
    return {"block_m": 128, "block_n": 64, "num_warps": 4, "num_stages": 2}




# -- Gluon (Hopper) backend ----------------------------------------------------------------------
# [Note] Gluon tiles. fagen/templates/gluon/attention.py.j2 runs a persistent CTA of two consumer warpgroups
# (block_m / 2 = 64 query rows each: one wgmma M tile) and one producer warp; num_warps counts the consumer warps
# (the producer warp is added). K/V stream through a ring of num_stages slots of block_n keys, loaded by TMA.
# The limits are the measured configs of docs/hopper.md.
GLUON_SUPPORTED = {
    "head_dim": ((64, 128), "the gluon backend supports head_dim 64 or 128 (a TMA box of whole 16-byte rows, one "
                            "wgmma N tile); use backend 'triton' for other head dims"),
    "mask": ((Mask.NONE, Mask.CAUSAL), "the gluon backend supports masks 'none' and 'causal'; use backend "
                                       "'triton' for padding and tree masks"),
    "dtype": ((DType.FP16, DType.BF16, DType.FP8_E4M3), "the gluon backend computes fp16, bf16 and fp8_e4m3 on "
                                                        "tensor cores; use backend 'triton' for fp32"),
    "direction": ((Direction.FWD,), "the gluon backend has the forward only; use backend 'triton' for bwd"),
    "block_m": ((128,), "the gluon backend takes block_m 128: two consumer warpgroups of 64 rows"),
    "block_n": ((64, 128), "the gluon backend supports block_n 64 or 128 (a TMA box side is a power of two)"),
    "num_warps": ((8,), "the gluon backend runs 8 consumer warps (two warpgroups) plus its producer warp"),
    "num_stages": ((2, 3, 4), "the gluon backend rings K/V through 2, 3 or 4 shared-memory slots"),
}
# Score switches of the gluon forward ([Note] Gluon score switches in fagen/templates/gluon/attention.py.j2); ALiBi
# and sinks are backend 'triton' only.
GLUON_SWITCHES = ("window", "softcap")


def gluon_default_config(head_dim: int, dtype: DType = DType.BF16) -> dict:
    """Blocks, warps and stages of a gluon spec that leaves them unset: the measured default (docs/hopper.md).

    d128: 2 K/V slots, all that fits beside Q (two buffers per warpgroup) and O (H100: 630 TF/s full, 568 causal
    at s16k bf16); d64: 3 slots. fp8: half the bytes per slot, so 4 slots at either head dim (d128: 193 KB;
    not yet measured against 2 or 3: docs/hopper.md, "fp8 forward").
    """
    if dtype is DType.FP8_E4M3:
        return {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 4}
    return {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 2 if head_dim >= 128 else 3}

# The gluon forward's register budgets (setmaxnreg): 240 per consumer thread, 24 for the producer (docs/hopper.md,
# "Variants measured"). The variant switches measured beside them (ping-pong, late K/V releases, O via Q, joined
# releases, one Q buffer, a K/V ring deeper than the spec's) were slower or no faster and left the template
# (docs/hopper.md, "What left the product").
GLUON_VARIANT = {"consumer_regs": 240, "loader_regs": 24}
