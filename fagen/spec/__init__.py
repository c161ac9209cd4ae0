"""The spec: its axes, the validated KernelSpec, spelling tables, targets, defaults, tuned table and manifests."""

from fagen.spec.axes import Backend, Direction, DType, Kind, Layout, Mask
from fagen.spec.kernel import KernelSpec, SpecError, parse_fields, read_fields

__all__ = ["KernelSpec", "SpecError", "Mask", "DType", "Direction", "Backend", "Kind", "Layout", "parse_fields", "read_fields"]
