"""Load a rendered variant as a Python module: render once, store in the cache keyed by the render, import, memoise."""

from __future__ import annotations

import threading
from pathlib import Path
from types import ModuleType

from fagen import __version__, backends
from fagen.codegen.render import Rendered, render
from fagen import files
from fagen.runtime.device import gpu_arch
from fagen.runtime.modules import import_module
from fagen.spec.kernel import KernelSpec

_loaded: dict[str, ModuleType] = {}
_lock = threading.Lock()


def write_source(spec: KernelSpec, rendered: Rendered | None = None) -> Path:
    """Store the render of `spec` in the cache under a key of the render itself; returns the source's path.

    A backend with a launcher (cuda) gets it beside the source, with the same stem and a .py suffix. Each file is
    compared with the render on every call and rewritten when it differs, so a truncated or edited cache entry
    is repaired rather than imported; a read-only cache whose files are whole is only read.
    """
    rendered = rendered or render(spec)
    key = files.digest("source", __version__, spec.to_json(), *rendered.files.values())[:20]
    stem = files.cache_root() / "src" / f"{spec.name}-{key}"
    for suffix, text in rendered.files.items():
        files.write_if_different(stem.with_name(stem.name + suffix), text)
    return stem.with_name(stem.name + backends.get(spec.backend).suffix)


def load(spec: KernelSpec, build_dir: str | Path | None = None) -> ModuleType:
    """The generated module for `spec`. Rendered into the cache on first use; later calls are cache hits.

    With build_dir (the output of `fagen build` or `fagen compile`), its kernels launch the prebuilt cubins
    for the current GPU instead of compiling (see fagen/runtime/prebuilt.py). On a GPU, the launch fields the
    spec left unset take that GPU arch's defaults (KernelSpec.for_arch; the interpreter keeps the spec as it is).
    """
    if not isinstance(spec, KernelSpec):
        raise TypeError(f"load() takes a KernelSpec, got {type(spec).__name__}")
    spec = spec.for_arch(gpu_arch())
    if build_dir is not None:
        from fagen.runtime import prebuilt

        return prebuilt.load(spec, Path(build_dir))
    with _lock:
        module = _loaded.get(spec.hash)
        if module is not None:
            return module
        path = write_source(spec).with_suffix(".py")  # a .cu source is imported through its launcher beside it
        module = import_module(path)
        _loaded[spec.hash] = module
        return module


def load_source(source: str, name: str) -> ModuleType:
    """Import source text that is not a plain render (a mutant under test, say), through the cache."""
    path = files.cache_root() / "src" / f"{name}-{files.digest(source)[:20]}.py"
    files.write_if_different(path, source)
    return import_module(path)
