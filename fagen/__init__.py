"""fagen: a code generator for specialized attention kernels (spec -> render -> compile -> verify)."""

__version__ = "0.1.0"

from fagen.enums import Backend, Direction, DType, Kind, Mask  # noqa: E402
from fagen.render import generate  # noqa: E402
from fagen.runtime import load  # noqa: E402
from fagen.spec import KernelSpec, SpecError  # noqa: E402
from fagen.api import AttentionError, attention  # noqa: E402

__all__ = ["KernelSpec", "SpecError", "Mask", "DType", "Direction", "Backend", "Kind", "generate", "load",
           "__version__", "attention", "AttentionError"]
