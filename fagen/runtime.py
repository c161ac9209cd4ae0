"""Load a rendered variant as a Python module: render into the cache once, import, memoise."""

from __future__ import annotations

import importlib.util
import sys
import threading
from pathlib import Path
from types import ModuleType

from fagen import __version__, cache, tables
from fagen.render import generate, generate_launcher
from fagen.spec import KernelSpec

_loaded: dict[str, ModuleType] = {}
_lock = threading.Lock()


def write_source(spec: KernelSpec) -> Path:
    """Render `spec` once and store it in the cache under a key of the render itself; returns the source's path.

    A backend with a launcher (cuda) gets it beside the source, with the same stem and a .py suffix.
    """
    files = {tables.SOURCE_SUFFIX[spec.backend]: generate(spec)}
    if spec.backend in tables.LAUNCHER:
        files[".py"] = generate_launcher(spec)
    key = cache.digest("source", __version__, spec.to_json(), *files.values())[:20]
    stem = cache.cache_root() / "src" / f"{spec.name}-{key}"
    for suffix, text in files.items():
        path = stem.with_name(stem.name + suffix)
        if not path.exists():
            cache.write_if_different(path, text)
    return stem.with_name(stem.name + tables.SOURCE_SUFFIX[spec.backend])


def load(spec: KernelSpec, build_dir: str | Path | None = None) -> ModuleType:
    """The generated module for `spec`. Rendered into the cache on first use; later calls are cache hits.

    With build_dir (the output of `fagen build` or `fagen compile`), its kernels launch the prebuilt cubins
    for the current GPU instead of compiling (see fagen/prebuilt.py).
    """
    if not isinstance(spec, KernelSpec):
        raise TypeError(f"load() takes a KernelSpec, got {type(spec).__name__}")
    if build_dir is not None:
        from fagen import prebuilt

        return prebuilt.load(spec, Path(build_dir))
    path = write_source(spec).with_suffix(".py")  # a .cu source is imported through its launcher beside it
    with _lock:
        module = _loaded.get(path.stem)
        if module is not None:
            return module
        module = _import(path)
        _loaded[path.stem] = module
        return module


def load_source(source: str, name: str) -> ModuleType:
    """Import source text that is not a plain render (a mutant under test, say), through the cache."""
    path = cache.cache_root() / "src" / f"{name}-{cache.digest(source)[:20]}.py"
    cache.write_if_different(path, source)
    return _import(path)


def _import(path: Path, module_name: str | None = None) -> ModuleType:
    module_name = module_name or f"fagen_generated.{path.stem.replace('-', '_')}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    mod_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(mod_spec)
    sys.modules[module_name] = module  # triton's @jit reads the source through the module
    mod_spec.loader.exec_module(module)
    return module
