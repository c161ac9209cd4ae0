"""The spec: its axes, the validated KernelSpec, spelling tables, targets, tuned table and manifests.

KernelSpec and the spec-file readers are imported lazily (PEP 562): fagen/backends/ reads the axes and targets of
this package, and KernelSpec reads the backends, so importing either first must not need the other half-done."""

import importlib

from fagen.spec.axes import Backend, Direction, DType, Kind, Layout, Mask, SpecError

_LAZY = {"KernelSpec", "parse_fields", "read_fields"}

__all__ = ["KernelSpec", "SpecError", "Mask", "DType", "Direction", "Backend", "Kind", "Layout", "parse_fields",
           "read_fields"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module("fagen.spec.kernel"), name)
    raise AttributeError(f"module 'fagen.spec' has no attribute {name!r}")
