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
}

# File suffix of a rendered source, per backend.
SOURCE_SUFFIX = {Backend.TRITON: ".py", Backend.CUDA: ".cu"}


def default_config(head_dim: int, dtype: DType, direction: Direction, kind: Kind, mask: Mask | None = None,
                   arch: str = tuned.DEFAULT_ARCH) -> dict:
    """Block sizes, warps and stages used when a spec leaves them unset.

    The tuned table (fagen/tuned.json, written by `fagen tune`) wins for its (arch, head_dim, mask, dtype,
    direction, kind); otherwise these hand defaults apply. They stay within Hopper's 228 KB of shared memory
    for every head dim: the K/V tiles cost ``block_n * head_dim * bytes * 2 * num_stages``.
    """
    found = tuned.lookup(head_dim, mask, dtype, direction, kind, arch=arch)
    if found is not None:
        return found
    wide = head_dim > 128 or dtype is DType.FP32
    if direction is Direction.BWD:
        return {"block_m": 64, "block_n": 64 if not wide else 32, "num_warps": 4 if not wide else 8,
                "num_stages": 2 if wide else 3}
    if wide:
        return {"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 2}
    if head_dim <= 64:
        return {"block_m": 128, "block_n": 64, "num_warps": 4, "num_stages": 3}
    return {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 3}
