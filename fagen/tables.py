"""Per-axis lookup tables: everything a spec enum value means to a target, in one place."""

from __future__ import annotations

from fagen import tuned
from fagen.enums import Backend, DType, Direction, Kind, Mask

# Short names used in readable variant names (``attn_fwd_causal_d128_...``).
MASK_SHORT = {
    Mask.NONE: "full",
    Mask.CAUSAL: "causal",
    Mask.PADDING: "pad",
    Mask.CAUSAL_PADDING: "causalpad",
    Mask.TREE: "tree",
}

# The torch dtype a generated module expects: getattr(torch, name); "torch." + name in source text.
TORCH_DTYPE = {DType.FP16: "float16", DType.BF16: "bfloat16", DType.FP32: "float32"}

# CUDA C++ element type (for the CUDA backend).
CUDA_DTYPE = {DType.FP16: "half", DType.BF16: "__nv_bfloat16", DType.FP32: "float"}

# Extra tl.dot arguments: fp32 specs compute in full fp32 ("ieee"), never tf32.
DOT_KWARGS = {DType.FP16: "", DType.BF16: "", DType.FP32: ', input_precision="ieee"'}


def tma_loads(spec) -> bool:
    """Whether the Triton prefill forward reads K/V through tensor descriptors (TMA on sm_90).

    [Note] TMA choice: `fagen tune` on the H100 (2026-11-22) with and without descriptors, best config each,
    bf16 TF/s: d128 full 547 vs 520, d128 causal 524 vs 475, d64 causal 448 vs 431, tree p16k+128 0.279 vs
    0.304 ms. ptxas (sm_90, d128 m128n128w8s3): 196 registers instead of 247, no spills either way. On sm_80 the
    descriptors lower to ordinary loads. The decode and backward kernels keep pointer loads.
    """
    return spec.backend is Backend.TRITON and spec.kind is Kind.PREFILL


# The template that renders a (backend, kind) pair. Direction is a switch inside it.
TEMPLATE = {
    (Backend.TRITON, Kind.PREFILL): "triton/attention.py.j2",
    (Backend.CUDA, Kind.PREFILL): "cuda/attention.cu.j2",
    (Backend.TRITON, Kind.DECODE): "triton/decode.py.j2",
}

# The Python module that loads and launches a compiled source, for backends whose source is not Python.
LAUNCHER = {Backend.CUDA: "cuda/launcher.py.j2"}

# Decode kernels serve at most this many query tokens per sequence (one step, or a small speculative tree);
# longer queries belong to the prefill kind. The decode template states the same number as MAX_SEQ_Q.
DECODE_MAX_SEQ_Q = 16

# File suffix of a rendered source, per backend.
SOURCE_SUFFIX = {Backend.TRITON: ".py", Backend.CUDA: ".cu"}


def default_config(head_dim: int, dtype: DType, direction: Direction, kind: Kind, mask: Mask | None = None,
                   arch: str = tuned.DEFAULT_ARCH) -> dict:
    """Block sizes, warps and stages used when a spec leaves them unset.

    The tuned table (fagen/tuned.json, written by `fagen tune` on the H100) wins for its (arch, head_dim, mask,
    dtype, direction, kind); otherwise these hand defaults apply. The forward's are the tuned winners of the bf16
    keys, so fp16 and other head dims follow them: d128 m128n128w8s3 (547 TF/s full, 524 causal at s16k with
    TMA), d64 m128n128w4s3 (448 causal). Wider tiles stay within Hopper's 227 KB of shared memory: K/V tiles
    cost block_n * head_dim * bytes * 2 * num_stages.
    """
    found = tuned.lookup(head_dim, mask, dtype, direction, kind, arch=arch)
    if found is not None:
        return found
    wide = head_dim > 128 or dtype is DType.FP32
    if kind is Kind.DECODE:
        # block_m caps the query rows of one tile (gqa * Sq packed; the launcher shrinks it to fit), block_n is
        # keys per step. Memory-bound: stages keep K/V loads in flight. At 4 warps the fp32 accumulator of a
        # 64 x 128 tile is 64 registers a thread; 128 rows spill (sm_90 ptxas), so more rows take more tiles.
        if wide:
            return {"block_m": 32, "block_n": 32, "num_warps": 4, "num_stages": 2}
        return {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 3}
    if direction is Direction.BWD:
        # block_n = keys per dK/dV program, block_m = queries per dQ program; each steps over the other axis in
        # tiles of at most 64 (templates/triton/backward.py.j2, [Note] Backward tiles). The forward of a bwd module
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

CUDA_MMA_TYPE = {DType.FP16: "f16", DType.BF16: "bf16"}


def cuda_head_dim_padded(head_dim: int) -> int:
    """head_dim rounded up to the MMA k-step of 16; the extra columns are zeros in shared memory."""
    return (head_dim + 15) // 16 * 16


def cuda_smem_bytes(head_dim: int, dtype: DType, block_m: int, block_n: int, num_stages: int) -> int:
    """Dynamic shared memory of the CUDA forward: a Q tile and num_stages K and V tiles, rows padded by 8."""
    row = (cuda_head_dim_padded(head_dim) + 8) * DType(dtype).itemsize
    return (block_m + 2 * num_stages * block_n) * row


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


# GPU architectures fagen compiles Triton for, by compute capability.
ARCH_CAPABILITY = {"sm_80": 80, "sm_90": 90}
# The most shared memory one block may opt into, per arch (CUDA programming guide, "compute capabilities":
# A100 163 KB, H100 227 KB). A build or a cuda spec over the limit is rejected.
ARCH_SMEM_LIMIT = {"sm_80": 166912, "sm_86": 101376, "sm_87": 166912, "sm_89": 101376, "sm_90": 232448,
                   "sm_100": 232448, "sm_103": 232448, "sm_120": 101376}
