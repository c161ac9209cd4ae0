"""Per-axis lookup tables: everything a spec enum value means to a target, in one place."""

from __future__ import annotations

from fagen.enums import Backend, DType, Direction, Kind, Mask

# Short names used in readable variant names (``attn_fwd_causal_d128_...``).
MASK_SHORT = {
    Mask.NONE: "full",
    Mask.CAUSAL: "causal",
    Mask.PADDING: "pad",
    Mask.CAUSAL_PADDING: "causalpad",
    Mask.TREE: "tree",
}

# Element type of q/k/v/out inside Triton.
TRITON_DTYPE = {DType.FP16: "tl.float16", DType.BF16: "tl.bfloat16", DType.FP32: "tl.float32"}

# The torch dtype a generated module expects: getattr(torch, name); "torch." + name in source text.
TORCH_DTYPE = {DType.FP16: "float16", DType.BF16: "bfloat16", DType.FP32: "float32"}

# CUDA C++ element type (for the CUDA backend).
CUDA_DTYPE = {DType.FP16: "half", DType.BF16: "__nv_bfloat16", DType.FP32: "float"}

# Extra tl.dot arguments: fp32 specs compute in full fp32 ("ieee"), never tf32.
DOT_KWARGS = {DType.FP16: "", DType.BF16: "", DType.FP32: ', input_precision="ieee"'}

# The template that renders a (backend, kind) pair. Direction is a switch inside it.
TEMPLATE = {
    (Backend.TRITON, Kind.PREFILL): "triton/attention.py.j2",
    (Backend.TRITON, Kind.DECODE): "triton/decode.py.j2",
}

# Decode kernels serve at most this many query tokens per sequence (one step, or a small speculative tree);
# longer queries belong to the prefill kind. The decode template states the same number as MAX_SEQ_Q.
DECODE_MAX_SEQ_Q = 16

# File suffix of a rendered source, per backend.
SOURCE_SUFFIX = {Backend.TRITON: ".py", Backend.CUDA: ".cu"}


def default_config(head_dim: int, dtype: DType, direction: Direction, kind: Kind) -> dict:
    """Block sizes, warps and stages used when a spec leaves them unset.

    Tiles stay within Hopper's 228 KB of shared memory for every head dim: the
    K/V tiles cost ``block_n * head_dim * bytes * 2 * num_stages``.
    """
    wide = head_dim > 128 or dtype is DType.FP32
    if kind is Kind.DECODE:
        # block_m caps the query rows of one tile (gqa * Sq packed; the launcher shrinks it to fit), block_n is
        # keys per step. Memory-bound: stages keep K/V loads in flight. At 4 warps the fp32 accumulator of a
        # 64 x 128 tile is 64 registers a thread; 128 rows spill (sm_90 ptxas), so more rows take more tiles.
        if wide:
            return {"block_m": 32, "block_n": 32, "num_warps": 4, "num_stages": 2}
        return {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 3}
    if direction is Direction.BWD:
        return {"block_m": 64, "block_n": 64 if not wide else 32, "num_warps": 4 if not wide else 8,
                "num_stages": 2 if wide else 3}
    if wide:
        return {"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 2}
    if head_dim <= 64:
        return {"block_m": 128, "block_n": 64, "num_warps": 4, "num_stages": 3}
    return {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 3}
