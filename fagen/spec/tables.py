"""Spelling tables: what each spec enum value is called in names, torch, CUDA C++ and templates. What differs
between backends (templates, launcher, suffix, limits) is their descriptors' (fagen/backends/)."""

from __future__ import annotations

from fagen.spec.axes import DType, KVDType, Mask

# Short names used in readable variant names (``attn_fwd_causal_d128_...``).
MASK_SHORT = {
    Mask.NONE: "full",
    Mask.CAUSAL: "causal",
    Mask.PADDING: "pad",
    Mask.CAUSAL_PADDING: "causalpad",
    Mask.TREE: "tree",
}

# The torch dtype a generated module expects: getattr(torch, name); "torch." + name in source text.
TORCH_DTYPE = {DType.FP16: "float16", DType.BF16: "bfloat16", DType.FP32: "float32", DType.FP8_E4M3: "float8_e4m3fn"}

# The torch dtype of an fp8 KV cache (kv_dtype), and its short name in variant names (``..._bf16_kve4m3``).
TORCH_KV_DTYPE = {KVDType.FP8_E4M3: "float8_e4m3fn", KVDType.FP8_E5M2: "float8_e5m2"}
KV_SHORT = {KVDType.FP8_E4M3: "kve4m3", KVDType.FP8_E5M2: "kve5m2"}

# CUDA C++ element type (for the CUDA backend).
CUDA_DTYPE = {DType.FP16: "half", DType.BF16: "__nv_bfloat16", DType.FP32: "float"}

# Extra tl.dot arguments: fp32 specs compute in full fp32 ("ieee"), never tf32.
DOT_KWARGS = {DType.FP16: "", DType.BF16: "", DType.FP32: ', input_precision="ieee"', DType.FP8_E4M3: ""}


# The PTX mma.sync element type (for the CUDA backend).
CUDA_MMA_TYPE = {DType.FP16: "f16", DType.BF16: "bf16"}
