"""The axes of a kernel spec: one enum per choice (values are the spellings users type) and the integer ranges."""

from __future__ import annotations

import enum
from typing import Any


class _Axis(str, enum.Enum):
    """An enum whose value is its user-facing spelling."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def choices(cls) -> list[str]:
        return [m.value for m in cls]


class Mask(_Axis):
    NONE = "none"
    CAUSAL = "causal"
    PADDING = "padding"
    CAUSAL_PADDING = "causal+padding"
    TREE = "tree"

    @property
    def causal(self) -> bool:
        return self in (Mask.CAUSAL, Mask.CAUSAL_PADDING)

    @property
    def padded(self) -> bool:
        return self in (Mask.PADDING, Mask.CAUSAL_PADDING)


class DType(_Axis):
    FP16 = "fp16"
    BF16 = "bf16"
    FP32 = "fp32"
    FP8_E4M3 = "fp8_e4m3"  # q, k, v in float8 e4m3 with run-time descales; the sm_90 gluon forward only

    @property
    def itemsize(self) -> int:
        return {DType.FP32: 4, DType.FP8_E4M3: 1}.get(self, 2)

    @classmethod
    def portable(cls) -> tuple[DType, ...]:
        """The dtypes every backend and kind computes in: all but fp8 (README "fp8 forward")."""
        return tuple(d for d in cls if d is not DType.FP8_E4M3)


class Direction(_Axis):
    FWD = "fwd"
    BWD = "bwd"


class Backend(_Axis):
    TRITON = "triton"
    CUDA = "cuda"
    GLUON = "gluon"  # Hopper (sm_90) forward in triton.experimental.gluon: warpgroup MMA, TMA, warp specialization


class Kind(_Axis):
    PREFILL = "prefill"
    DECODE = "decode"


class Layout(_Axis):
    """How q, k and v lie in memory (README "Layouts")."""

    DENSE = "dense"    # q [B, Hq, Sq, D], k/v [B, Hkv, Sk, D]
    VARLEN = "varlen"  # packed sequences: q [total_q, Hq, D], k/v [total_k, Hkv, D] with cu_seqlens prefix sums
    PAGED = "paged"    # k/v in a page cache [num_pages, page_size, Hkv, D] read through a block table


class KVDType(_Axis):
    """A decode kernel's KV cache element type where it differs from the query's (README "An fp8 KV cache"): the
    kernel dequantizes on load (cache value x its scale) and keeps the softmax and accumulation in fp32."""

    FP8_E4M3 = "fp8_e4m3"  # torch.float8_e4m3fn: 3 mantissa bits, finite up to 448 (vLLM's "fp8")
    FP8_E5M2 = "fp8_e5m2"  # torch.float8_e5m2: 2 mantissa bits, up to 57344

    @property
    def itemsize(self) -> int:
        return 1


# -- integer axes --------------------------------------------------------------------------------------------
HEAD_DIMS = range(16, 257, 8)
# A shared latent cache (spec field shared_kv, MLA's absorbed decode: d_qk 576, d_v 512) takes wider rows.
LATENT_HEAD_DIMS = range(16, 577, 8)
LATENT_HEAD_DIMS_V = range(16, 513, 8)
BLOCK_SIZES = (16, 32, 64, 128, 256)
NUM_WARPS = (1, 2, 4, 8, 16)
NUM_STAGES = range(1, 9)
MAX_GQA = 256

# Decode kernels serve at most this many query tokens per sequence (one step, or a small speculative tree);
# longer queries belong to the prefill kind. The decode template renders it as MAX_SEQ_Q.
DECODE_MAX_SEQ_Q = 16
# batch_invariant's default on decode (a module's forward and plan, fagen.attention); the decode template renders it
# as BATCH_INVARIANT. False: the H100 measured the invariant rule above issue 27's 3% bar at some shapes
# (docs/serving.md "Batch-invariant decode", scripts/gpu_invariant.py).
DECODE_BATCH_INVARIANT = False

# Paged KV caches: pages hold a power of two of tokens, from 1 to this many.
MAX_PAGE_SIZE = 256


# The one SpecError (fagen/errors.py, which imports nothing), re-exported here with the axes it validates.
from fagen.errors import SpecError  # noqa: E402,F401
