"""fagen: a code generator for specialized attention kernels (spec -> render -> compile -> verify).

The public names are imported lazily (PEP 562), so `import fagen` and `fagen generate` do not import torch:

    spec/      KernelSpec, its axes, tables, targets, defaults, tuned table, manifests
    codegen/   render(spec) -> Rendered, through the Jinja templates in fagen/templates/
    runtime/   the content-addressed cache, module import, load, prebuilt cubins, fagen.attention
    aot/       ahead-of-time compile (Triton, nvcc), parallel builds, build directories
    verify/    float64 reference, strategies, properties, the Hypothesis engine, mutants
    bench/     workloads, peers, timing, the runner, reports, the tuner
    cli/       the `fagen` command
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "KernelSpec": "fagen.spec.kernel",
    "SpecError": "fagen.spec.kernel",
    "Mask": "fagen.spec.axes",
    "DType": "fagen.spec.axes",
    "Direction": "fagen.spec.axes",
    "Backend": "fagen.spec.axes",
    "Kind": "fagen.spec.axes",
    "Layout": "fagen.spec.axes",
    "generate": "fagen.codegen.render",
    "render": "fagen.codegen.render",
    "load": "fagen.runtime.loader",
    "attention": "fagen.runtime.api",
    "AttentionError": "fagen.runtime.api",
    "create_block_mask": "fagen.runtime.block_mask",
    "BlockMask": "fagen.runtime.block_mask",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'fagen' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
