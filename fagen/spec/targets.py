"""Targets: the GPU archs fagen compiles for, their shared-memory limits, and one shared-memory formula per
backend (checked before any compile, so an oversized variant is rejected in milliseconds, not minutes)."""

from __future__ import annotations

from typing import Iterable

from fagen.spec.axes import Backend, Direction, DType

# GPU architectures fagen compiles Triton for, by compute capability.
ARCH_CAPABILITY = {"sm_80": 80, "sm_90": 90}
# The most shared memory one block may opt into, per arch (CUDA programming guide, "compute capabilities":
# A100 163 KB, H100 227 KB). A build or a cuda spec over the limit is rejected.
ARCH_SMEM_LIMIT = {"sm_80": 166912, "sm_86": 101376, "sm_87": 166912, "sm_89": 101376, "sm_90": 232448,
                   "sm_100": 232448, "sm_103": 232448, "sm_120": 101376}
ARCHS = tuple(ARCH_CAPABILITY)
# The arch whose limits apply where none is named (the interpreter, a spec's own check): the largest, Hopper's.
DEFAULT_SMEM_LIMIT = ARCH_SMEM_LIMIT["sm_90"]


class ArchError(ValueError):
    """An --arch value fagen cannot compile for."""


def parse_archs(value: str | Iterable[str]) -> tuple[str, ...]:
    """'sm_80,sm_90' -> ('sm_80', 'sm_90'); unknown names raise ArchError listing the known ones."""
    items = [a.strip() for a in (value.split(",") if isinstance(value, str) else value)]
    if not items or not all(items):
        raise ArchError(f"got {value!r}; give a comma-separated list of {', '.join(ARCHS)}")
    for arch in items:
        if arch not in ARCH_CAPABILITY:
            raise ArchError(f"unknown arch {arch!r}; choose from {', '.join(ARCHS)} (comma-separated)")
    return tuple(dict.fromkeys(items))


def smem_limit(arch: str | None) -> int:
    """The most shared memory one block may use on `arch` (None: the largest of any GPU fagen targets)."""
    return ARCH_SMEM_LIMIT.get(arch, DEFAULT_SMEM_LIMIT) if arch else DEFAULT_SMEM_LIMIT


# -- shared memory, one formula per backend ------------------------------------------------------------------
def cuda_head_dim_padded(head_dim: int) -> int:
    """head_dim rounded up to the MMA k-step of 16; the extra columns are zeros in shared memory."""
    return (head_dim + 15) // 16 * 16


def cuda_smem_bytes(head_dim: int, dtype: DType, block_m: int, block_n: int, num_stages: int) -> int:
    """Dynamic shared memory of the CUDA forward: a Q tile and num_stages K and V tiles, rows padded by 8."""
    row = (cuda_head_dim_padded(head_dim) + 8) * DType(dtype).itemsize
    return (block_m + 2 * num_stages * block_n) * row



def triton_smem_bytes(spec) -> int:
    """Shared memory a Triton config's tiles need, estimated from the tiles the kernel stages.

    [Note] Shared-memory filter
    Forward: the Q tile stays resident and each pipeline stage holds one K and one V tile:
    (block_m + 2 * num_stages * block_n) * D * bytes. Backward (fagen/templates/triton/backward.py.j2, [Note] Backward
    tiles): the dK/dV kernel keeps block_n rows of K and V resident and stages Q and dO tiles of min(block_m, 64)
    rows; the dQ kernel keeps block_m rows of Q and dO and stages K and V tiles of min(block_n, 64) rows; a bwd
    module's forward runs with the same config, so the largest of the three must fit. Triton's real use differs a
    little (d128 bf16 m128n128s3: estimated 224/160/160 KB, compiled 225/162/161). Decode kernels stage the same
    tiles as the forward. A config over the limit by this estimate is rejected before compiling; one that passes
    it and still does not fit fails in the compiler.
    """
    d = 1 << (spec.head_dim - 1).bit_length()  # the kernel pads D to a power of two
    tiles = spec.block_m + 2 * spec.num_stages * spec.block_n
    if spec.direction is Direction.BWD:
        dkdv = 2 * spec.block_n + 2 * spec.num_stages * min(spec.block_m, 64)
        dq = 2 * spec.block_m + 2 * spec.num_stages * min(spec.block_n, 64)
        tiles = max(tiles, dkdv, dq)
    return tiles * d * spec.dtype.itemsize


def gluon_smem_bytes(head_dim: int, block_m: int, block_n: int, num_stages: int, itemsize: int = 2) -> int:
    """Shared memory of the Gluon (Hopper) forward (fagen/templates/gluon/attention.py.j2, [Note] Roles).

    A program owns block_m query rows, block_m / 2 per consumer warpgroup. Each warpgroup has two Q buffers and
    one O staging buffer; the K/V ring holds num_stages K and V tiles of block_n rows; 2 bytes an element, plus
    1 KB for the mbarriers and triton's scratch. d128 m128 n128 s2: 230,400 bytes (compiled: 229,752). fp8
    (itemsize 1): Q and K/V at 1 byte, O still 2 (bf16/fp16 out)."""
    half = block_m // 2
    return (itemsize * (2 * 2 * half + 2 * num_stages * block_n) + 2 * 2 * half) * head_dim + 1024


def smem_bytes(spec) -> int:
    """The shared memory a spec's kernels need, by its backend's formula."""
    if spec.backend is Backend.CUDA:
        return cuda_smem_bytes(spec.head_dim, spec.dtype, spec.block_m, spec.block_n, spec.num_stages)
    if spec.backend is Backend.GLUON:
        return gluon_smem_bytes(spec.head_dim, spec.block_m, spec.block_n, spec.num_stages, spec.dtype.itemsize)
    return triton_smem_bytes(spec)
