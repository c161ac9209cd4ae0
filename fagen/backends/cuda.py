"""The CUDA backend: a hand-written-style .cu forward (mma.sync, ldmatrix, cp.async) compiled by nvcc.

[Note] CUDA tiles. The forward kernel gives each warp 16 or 32 query rows (one or two 16-row MMA tiles:
block_m / num_warps in ROWS_PER_WARP), streams K/V through a ring of num_stages shared-memory buffers, and pads
head_dim to a multiple of 16 plus 8 elements of row padding (ldmatrix bank spread).
"""

from __future__ import annotations

from fagen.backends.base import KernelBackend, fit, max_smem_limit
from fagen.spec import targets
from fagen.spec.axes import Backend, Direction, DType, Kind, SpecError

ROWS_PER_WARP = (16, 32)


def head_dim_padded(head_dim: int) -> int:
    """head_dim rounded up to the MMA k-step of 16; the extra columns are zeros in shared memory."""
    return (head_dim + 15) // 16 * 16


def smem_bytes(head_dim: int, dtype: DType, block_m: int, block_n: int, num_stages: int) -> int:
    """Dynamic shared memory of the CUDA forward: a Q tile and num_stages K and V tiles, rows padded by 8."""
    row = (head_dim_padded(head_dim) + 8) * DType(dtype).itemsize
    return (block_m + 2 * num_stages * block_n) * row


class CudaBackend(KernelBackend):
    backend = Backend.CUDA
    templates = {Kind.PREFILL: "cuda/attention.cu.j2"}
    launcher = "cuda/launcher.py.j2"
    suffix = ".cu"
    name_suffix = "_cuda"
    compiler = "nvcc"
    supported = {
        "dtype": ((DType.FP16, DType.BF16), "the cuda backend computes fp16 and bf16 on tensor cores; use "
                                            "backend 'triton' for fp32"),
        "direction": ((Direction.FWD,), "the cuda backend has the forward only; use backend 'triton' for bwd"),
        "block_m": ((64, 128, 256), "the cuda backend supports block_m 64, 128 or 256"),
        "block_n": ((32, 64), "the cuda backend supports block_n 32 or 64"),
        "num_stages": ((2, 3, 4), "the cuda backend pipelines K/V through 2, 3 or 4 shared-memory stages"),
    }
    switches = ("window", "softcap")
    switches_why = "the cuda backend has the window and softcap switches only; use backend 'triton'"
    smem_limit = max_smem_limit()
    smem_why = ("block_m {spec.block_m}, block_n {spec.block_n}, head_dim {spec.head_dim}; no GPU gives a block "
                "more than {limit}: use fewer stages or a smaller block_n/block_m")

    def default_config(self, spec, arch: str, given: dict) -> dict:
        """head_dim <= 128: 4 warps of 32 query rows (two MMA tiles: each K/V fragment read from shared memory
        feeds four MMAs), 64 keys a step, two stages: two blocks per SM. H100, d128 bf16 s16k: 369 TF/s full, 343
        causal (SDPA flash 364 / 322 in the same run; docs/cuda.md). Wider heads: 16 rows per warp, so that the
        fp32 accumulator of a warp stays within its registers. With nvcc 13 the d128 tile spills 2-6 words on
        sm_80 and sm_90 (causal, padding and tree masks); 16 rows per warp spills none but ran 279 / 275 TF/s
        (docs/cuda.md). Shrunk by `fit` to the arch's shared memory.
        """
        config = ({"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 2} if spec.head_dim > 128
                  else {"block_m": 128, "block_n": 64, "num_warps": 4, "num_stages": 2})
        def need(c: dict) -> int:
            return smem_bytes(spec.head_dim, spec.dtype, c["block_m"], c["block_n"], c["num_stages"])
        return fit(config, need, targets.smem_limit(arch), given, floors=(("block_n", 32), ("block_m", 64)))

    def smem_bytes(self, spec) -> int:
        return smem_bytes(spec.head_dim, spec.dtype, spec.block_m, spec.block_n, spec.num_stages)

    def check_more(self, spec) -> None:
        rows = spec.block_m // spec.num_warps
        if spec.block_m % spec.num_warps or rows not in ROWS_PER_WARP:
            ok = ", ".join(str(spec.block_m // r) for r in ROWS_PER_WARP)
            raise SpecError("num_warps", spec.num_warps,
                            f"the cuda backend gives each warp 16 or 32 query rows: with block_m {spec.block_m} "
                            f"use num_warps {ok}")
