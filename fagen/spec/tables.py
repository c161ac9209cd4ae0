"""Spelling tables: what each spec enum value is called in names, torch, CUDA C++ and templates."""

from __future__ import annotations

from fagen.spec.axes import Backend, DType, Kind, KVDType, Layout, Mask

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


def tma_loads(spec) -> bool:
    """Whether the Triton prefill forward reads K/V through tensor descriptors (TMA on sm_90).

    [Note] TMA choice: `fagen tune` on the H100 (2026-11-22) with and without descriptors, best config each,
    bf16 TF/s: d128 full 547 vs 520, d128 causal 524 vs 475, d64 causal 448 vs 431, tree p16k+128 0.279 vs
    0.304 ms. ptxas (sm_90, d128 m128n128w8s3): 196 registers instead of 247, no spills either way. On sm_80 the
    descriptors lower to ordinary loads. The decode and backward kernels keep pointer loads, and so do paged caches
    (each key row is gathered through the block table).
    """
    return spec.backend is Backend.TRITON and spec.kind is Kind.PREFILL and spec.layout is not Layout.PAGED


# The template that renders a (backend, kind) pair. Direction is a switch inside it.
TEMPLATE = {
    (Backend.TRITON, Kind.PREFILL): "triton/attention.py.j2",
    (Backend.CUDA, Kind.PREFILL): "cuda/attention.cu.j2",
    (Backend.TRITON, Kind.DECODE): "triton/decode.py.j2",
    (Backend.GLUON, Kind.PREFILL): "gluon/attention.py.j2",
}

# The Python module that loads and launches a compiled source, for backends whose source is not Python.
LAUNCHER = {Backend.CUDA: "cuda/launcher.py.j2"}

# File suffix of a rendered source, per backend.
SOURCE_SUFFIX = {Backend.TRITON: ".py", Backend.CUDA: ".cu", Backend.GLUON: ".py"}

# The PTX mma.sync element type (for the CUDA backend).
CUDA_MMA_TYPE = {DType.FP16: "f16", DType.BF16: "bf16"}
