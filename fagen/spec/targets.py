"""Targets: the GPU archs fagen compiles for, their shared-memory limits, and whose default tiles each takes. Each
backend's shared-memory formula is its descriptor's (fagen/backends/)."""

from __future__ import annotations

from typing import Iterable


# GPU architectures fagen compiles Triton for, by compute capability.
ARCH_CAPABILITY = {"sm_80": 80, "sm_90": 90}
# The most shared memory one block may opt into, per arch (CUDA programming guide, "compute capabilities":
# A100 163 KB, H100 227 KB). A build or a cuda spec over the limit is rejected.
ARCH_SMEM_LIMIT = {"sm_80": 166912, "sm_86": 101376, "sm_87": 166912, "sm_89": 101376, "sm_90": 232448,
                   "sm_100": 232448, "sm_103": 232448, "sm_120": 101376}
ARCHS = tuple(ARCH_CAPABILITY)
# The arch whose limits apply where none is named (the interpreter, a spec's own check): the largest, Hopper's.
DEFAULT_SMEM_LIMIT = ARCH_SMEM_LIMIT["sm_90"]
# Whose hand-default tiles an arch takes (fagen/backends/triton.py, [Note] Tiles per arch): sm_80's fit its 163 KB
# and do not spill with mma.sync; sm_90's are the H100's tuned winners. An arch with less shared memory than its
# family's (sm_86, sm_89, sm_120: 99 KB) gets them shrunk until they fit.
TILE_FAMILY = {"sm_80": "sm_80", "sm_86": "sm_80", "sm_87": "sm_80", "sm_89": "sm_80", "sm_90": "sm_90",
               "sm_100": "sm_90", "sm_103": "sm_90", "sm_120": "sm_80"}


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


def arch_of(capability: tuple[int, int]) -> str:
    """The arch whose tiles a GPU of this compute capability takes: its own name where fagen knows it (9.0 ->
    'sm_90'), else the nearest known arch below it, else sm_80 (a GPU older than any fagen targets)."""
    number = 10 * capability[0] + capability[1]
    known = sorted((int(a[3:]), a) for a in ARCH_SMEM_LIMIT)
    return max(((n, a) for n, a in known if n <= number), default=known[0])[1]
