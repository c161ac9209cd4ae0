"""Import a rendered source file as a Python module (Triton's @jit reads the source through the module)."""

from __future__ import annotations

import importlib.util
import linecache
import sys
from pathlib import Path
from types import ModuleType

from fagen.runtime.toolchain import pin_module


class ModuleLoadError(ImportError):
    """A source file could not be imported; the message names the file and the cause."""


def import_module(path: Path, module_name: str | None = None, filename: str | None = None) -> ModuleType:
    """Import the source at `path` under `module_name` (default: fagen_generated.<stem>), once per process.

    With `filename`, the module's code records that name instead of the file's absolute path (Triton writes the
    code's file name into PTX line info: a path-independent name makes ahead-of-time builds reproducible across
    cache folders). linecache serves the source under that name, so inspect and Triton can still read it.
    The module's JIT functions build with fagen's ptxas (fagen/runtime/toolchain.py, [Note] One ptxas).
    """
    path = Path(path)
    module_name = module_name or f"fagen_generated.{path.stem.replace('-', '_').replace('.', '_')}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    try:
        if filename is None:
            mod_spec = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(mod_spec)
            sys.modules[module_name] = module  # triton's @jit reads the source through the module
            mod_spec.loader.exec_module(module)
        else:
            source = path.read_text()
            lines = source.splitlines(keepends=True)
            linecache.cache[filename] = (len(source), None, lines, filename)  # mtime None: never invalidated
            module = importlib.util.module_from_spec(importlib.util.spec_from_loader(module_name, loader=None))
            module.__file__ = filename
            sys.modules[module_name] = module
            exec(compile(source, filename, "exec"), module.__dict__)
    except BaseException:
        sys.modules.pop(module_name, None)  # a failed import is tried again next time, not served half-made
        raise
    pin_module(module)  # its kernels build with fagen's ptxas ([Note] One ptxas)
    return module
