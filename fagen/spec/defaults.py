"""Defaults: the launch config a spec gets when it leaves block sizes, warps and stages unset, per target arch
(tuned table first, then the hand defaults of the arch's family, shrunk until they fit), and the backends' limits."""

from __future__ import annotations

from typing import Callable

from fagen.spec import targets, tuned
from fagen.spec.axes import DType, Direction, Kind, Layout, Mask

LAUNCH_FIELDS = ("block_m", "block_n", "num_warps", "num_stages")


def default_config(head_dim: int, dtype: DType, direction: Direction, kind: Kind, mask: Mask | None = None,
                   arch: str = tuned.DEFAULT_ARCH, layout: Layout = Layout.DENSE, window: bool = False,
                   given: dict | None = None) -> dict:
    """Block sizes, warps and stages used on `arch` when a spec leaves them unset.

    [Note] Tiles per arch
    The tuned table (fagen/spec/tuned.json, written by `fagen tune`) wins for its (arch, head_dim, mask, dtype,
    direction, kind); otherwise the hand defaults of the arch's family (targets.TILE_FAMILY) apply, shrunk by
    `fit` until the shared-memory estimate fits the arch (stages to 2, then block_n to 32, then block_m to 64);
    the fields in `given` (what the spec sets) stay as given.
    sm_90's are the H100's tuned winners; sm_80's were chosen with ptxas so that no catalog kernel spills on
    sm_80 and every one fits its 163 KB (tests/test_arch_defaults.py compiles them).
    """
    config = _tuned_or_hand(head_dim, dtype, direction, kind, mask, arch, layout, window)
    return fit(config, lambda c: targets.triton_tile_bytes(head_dim, dtype, direction, c["block_m"], c["block_n"],
                                                            c["num_stages"]), targets.smem_limit(arch), given)


def fit(config: dict, need: Callable[[dict], int], limit: int, given: dict | None = None,
        floors: tuple = (("num_stages", 2), ("block_n", 32), ("block_m", 64), ("num_stages", 1))) -> dict:
    """`config` updated with `given`, its other stages and blocks lowered in the order of `floors` until
    need(config) <= limit (or nothing is left to lower: the spec's own check then names the field)."""
    config = {**config, **(given or {})}
    for field, floor in floors:
        while need(config) > limit and field not in (given or {}) and config[field] > floor:
            config[field] = config[field] - 1 if field == "num_stages" else config[field] // 2
    return config


def _tuned_or_hand(head_dim: int, dtype: DType, direction: Direction, kind: Kind, mask: Mask | None, arch: str,
                   layout: Layout, window: bool) -> dict:
    """The tuned entry of `arch`, else its family's hand default (sm_90's: the bf16 winners of the H100 table, so
    fp16 and other head dims follow them: d128 m128n128w8s3, 547 TF/s full and 524 causal at s16k with TMA; d64
    m128n128w4s3, 448 causal). Windowed d64 forwards take their own tile, before the table (whose keys have no
    score switches): see [Note] Windowed d64 tiles.
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
    if kind is not Kind.DECODE and not wide and targets.TILE_FAMILY.get(arch) == "sm_80":
        return _sm80_config(head_dim, direction, mask, layout)
    if kind is Kind.DECODE:
        # block_m caps the query rows of one tile (gqa * Sq packed; the launcher shrinks it to fit), block_n is
        # keys per step. Memory-bound: stages keep K/V loads in flight. At 4 warps the fp32 accumulator of a
        # 64 x 128 tile is 64 registers a thread; 128 rows spill (sm_90 ptxas), so more rows take more tiles.
        if wide:
            return {"block_m": 32, "block_n": 32, "num_warps": 4, "num_stages": 2}
        if layout is Layout.PAGED:
            # [Note] Paged decode tiles. Each block's rows are gathered through the block table, a dependent load
            # before K/V: wider blocks amortise it. H100, d128 bf16 32/8 heads, page 16 (scripts/paged_sweep.py,
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
        if mask == Mask.TREE:  # measured only for correctness; m128n64w8s2 spilled 216 words (sm_90), this none
            return {"block_m": 64, "block_n": 32, "num_warps": 8, "num_stages": 2}
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


def _sm80_config(head_dim: int, direction: Direction, mask: Mask | None, layout: Layout) -> dict:
    """sm_80's prefill tiles for head_dim <= 128 in fp16/bf16 (mma.sync; 163 KB of shared memory a block).

    No A100 timing chose them: they are the largest tiles of the sm_90 rules' shape that fit and spill nothing
    in any catalog variant (ptxas of triton 3.6, 2026-11-26; `fagen build fagen/spec/catalog.toml`). The sm_90
    tiles spill on sm_80 (d64 causal m128n128w4s3: 78 words) or do not fit (d128 m128n128w8s3: 224 KB). Spills of
    the candidates, bf16: forward d64 causal m128n64w4s3 2 words, m128n64w8s3 0; d128 m128n64w8s3 0, tree 222
    (m64n64w8s2 2, m64n32w8s2 0), paged 6 (m128n64w8s2 0); backward d64 m64n64w4s3 16 (gqa 4, mask none),
    m64n64w8s3 0; d128 m64n64w4s3 16, m64n64w8s3 0; tree d64 m128n64w8s2 140, m64n32w4s2 0; tree d128
    m128n64w8s2 1404, m64n32w8s2 0. Decode kernels keep the sm_90 tiles (they fit: 112 KB dense, 144 KB paged).
    """
    tree = mask == Mask.TREE
    if direction is Direction.BWD:
        if tree:
            return {"block_m": 64, "block_n": 32, "num_warps": 4 if head_dim <= 64 else 8, "num_stages": 2}
        return {"block_m": 64, "block_n": 64, "num_warps": 8, "num_stages": 3}
    if tree:
        return ({"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 2} if head_dim <= 64
                else {"block_m": 64, "block_n": 32, "num_warps": 8, "num_stages": 2})
    return {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 2 if layout is Layout.PAGED else 3}


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


def cuda_default_config(head_dim: int, dtype: DType, direction: Direction, kind: Kind,
                        arch: str = tuned.DEFAULT_ARCH, given: dict | None = None) -> dict:
    """Blocks, warps and stages of a cuda spec that leaves them unset, shrunk by `fit` to the arch's shared memory.

    head_dim <= 128: 4 warps of 32 query rows (two MMA tiles: each K/V fragment read from shared memory feeds
    four MMAs), 64 keys a step, two stages: two blocks per SM. H100, d128 bf16 s16k: 369 TF/s full, 343 causal
    (SDPA flash 364 / 322 in the same run; docs/cuda.md). Wider heads: 16 rows per warp, so that the fp32
    accumulator of a warp stays within its registers. With nvcc 13 the d128 tile spills 2-6 words on sm_80 and
    sm_90 (causal, padding and tree masks); 16 rows per warp spills none but ran 279 / 275 TF/s (docs/cuda.md).
    """
    config = ({"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 2} if head_dim > 128
              else {"block_m": 128, "block_n": 64, "num_warps": 4, "num_stages": 2})
    need = lambda c: targets.cuda_smem_bytes(head_dim, dtype, c["block_m"], c["block_n"], c["num_stages"])  # noqa: E731
    config = fit(config, need, targets.smem_limit(arch), given, floors=(("block_n", 32), ("block_m", 64)))
    return config




# -- Gluon (Hopper) backend ----------------------------------------------------------------------
# [Note] Gluon tiles. fagen/templates/gluon/attention.py.j2 runs a persistent CTA of two consumer warpgroups
# (block_m / 2 = 64 query rows each: one wgmma M tile) and one producer warp; num_warps counts the consumer warps
# (the producer warp is added). K/V stream through a ring of num_stages slots of block_n keys, loaded by TMA.
# The checks come from scripts/hopper_render.py's HopperConfig, which measured the variants (docs/hopper.md).
GLUON_SUPPORTED = {
    "head_dim": ((64, 128), "the gluon backend supports head_dim 64 or 128 (a TMA box of whole 16-byte rows, one "
                            "wgmma N tile); use backend 'triton' for other head dims"),
    "mask": ((Mask.NONE, Mask.CAUSAL), "the gluon backend supports masks 'none' and 'causal'; use backend "
                                       "'triton' for padding and tree masks"),
    "dtype": ((DType.FP16, DType.BF16), "the gluon backend computes fp16 and bf16 on tensor cores; use backend "
                                        "'triton' for fp32"),
    "direction": ((Direction.FWD, Direction.BWD), "the gluon backend has a forward and a backward"),
    "block_m": ((128,), "the gluon backend takes block_m 128: two consumer warpgroups of 64 rows"),
    "block_n": ((64, 128), "the gluon backend supports block_n 64 or 128 (a TMA box side is a power of two)"),
    "num_warps": ((8,), "the gluon backend runs 8 consumer warps (two warpgroups) plus its producer warp"),
    "num_stages": ((2, 3, 4), "the gluon backend rings K/V through 2, 3 or 4 shared-memory slots"),
}
# Score switches of the gluon forward ([Note] Gluon score switches in fagen/templates/gluon/attention.py.j2); ALiBi,
# sinks and every switch of the gluon backward are backend 'triton' only.
GLUON_SWITCHES = ("window", "softcap")
# The gluon backward (fagen/templates/gluon/backward.py.j2): head_dim 128 only (its tiles and registers are laid
# out for it; docs/hopper.md, phase 3).
GLUON_BWD_HEAD_DIMS = (128,)


def gluon_default_config(head_dim: int) -> dict:
    """Blocks, warps and stages of a gluon spec that leaves them unset: the measured default (docs/hopper.md).

    d128: 2 K/V slots, all that fits beside Q (two buffers per warpgroup) and O (H100: 630 TF/s full, 568 causal
    at s16k bf16); d64: 3 slots.
    """
    return {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 2 if head_dim >= 128 else 3}

# The gluon kernel's variant switches, fixed at their measured defaults (docs/hopper.md, "Variants measured"): two Q
# buffers per warpgroup, no ping-pong token, K released after S and V after its P V, 240 registers per consumer
# thread and 24 for the producer; O staged in its own buffer (o_via_q 0), separate K and V `empty` barriers
# (kv_join 0), the ring depth of the spec (kv_stages 0 = spec.num_stages). Not spec fields:
# scripts/hopper_render.py overrides them to measure variants (o_via_q/kv_join: [Note] O via Q, [Note] Joined
# release in fagen/templates/gluon/attention.py.j2).
GLUON_VARIANT = {"q_stages": 2, "pingpong": 0, "v_late": 0, "k_late": 0, "consumer_regs": 240, "loader_regs": 24,
                 "o_via_q": 0, "kv_join": 0, "kv_stages": 0}
