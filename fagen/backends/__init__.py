"""One descriptor per backend (triton, cuda, gluon): every fact that differs between them ([Note] Backend
descriptors in fagen/backends/base.py). Spec-level and torch-free."""

from __future__ import annotations

from fagen.backends.base import KernelBackend
from fagen.backends.cuda import CudaBackend
from fagen.backends.gluon import GluonBackend
from fagen.backends.triton import TritonBackend
from fagen.spec.axes import Backend

TRITON, CUDA, GLUON = TritonBackend(), CudaBackend(), GluonBackend()
BACKENDS: dict[Backend, KernelBackend] = {b.backend: b for b in (TRITON, CUDA, GLUON)}


def get(backend: Backend | str) -> KernelBackend:
    """The descriptor of a backend (a Backend or its name)."""
    return BACKENDS[Backend(backend)]


def smem_bytes(spec) -> int:
    """The shared memory a block of the spec's kernels needs, by its backend's formula."""
    return BACKENDS[spec.backend].smem_bytes(spec)


__all__ = ["BACKENDS", "CUDA", "GLUON", "TRITON", "KernelBackend", "get", "smem_bytes"]
