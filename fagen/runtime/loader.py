"""Load a rendered variant as a Python module: render once, store in the cache keyed by the render, import, memoise."""

from __future__ import annotations

import functools
import hashlib
import json
import threading
from pathlib import Path
from types import ModuleType

from fagen import __version__, backends
from fagen.codegen import render as codegen
from fagen.codegen.render import Rendered, render
from fagen import files
from fagen.runtime.device import gpu_arch
from fagen.runtime.modules import import_module
from fagen.spec.kernel import KernelSpec

_loaded: dict[tuple[str, str], ModuleType] = {}  # (spec hash, render.render_state(spec)) -> module: see load()
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
    The module is memoised in-process by the spec and the Gluon variant its render reads (render.render_state), as
    the render memo and the render index are: a variant set at run time gets its own module.
    """
    if not isinstance(spec, KernelSpec):
        raise TypeError(f"load() takes a KernelSpec, got {type(spec).__name__}")
    spec = spec.for_arch(gpu_arch())
    if build_dir is not None:
        from fagen.runtime import prebuilt

        return prebuilt.load(spec, Path(build_dir))
    key = (spec.hash, codegen.render_state(spec))  # a module rendered under another Gluon variant is not this one's
    with _lock:
        module = _loaded.get(key)
        if module is not None:
            return module
        path = source_path(spec).with_suffix(".py")  # a .cu source is imported through its launcher beside it
        module = import_module(path)
        _loaded[key] = module
        return module


# [Note] Render index. A process that loads a spec an earlier process rendered need not render it again (the Jinja
# environment, its template compiles and the render cost about 0.1-0.3 s, more than the rest of a warm first call):
# load() looks the source up in an index entry under <cache>/src/index/, keyed by the canonical spec, the fagen
# version, the templates folder, a stamp (name, mtime, size) of every .py/.j2 file of the fagen package (once a
# process) and of the templates folder (at every lookup, as render() stamps it), and the Gluon variant the render
# reads (render.render_state: scripts set GluonBackend.variant at run time): everything a render reads. The entry
# names the spec's source files and their sha256; a hit reads and hashes them (a truncated or edited file is a miss:
# rendered and rewritten, as write_source repairs it), so a hit serves exactly the bytes the render would give.
# render.cache_clear() (tests that change tables under a render) turns the index off for the rest of the process.
# Writing an entry is best effort: a read-only cache still loads.
def source_path(spec: KernelSpec) -> Path:
    """write_source(spec)'s path, without rendering when the render index holds it ([Note] Render index)."""
    index = _index_entry(spec) if codegen.INDEX_TRUSTED else None
    if index is not None:
        try:
            entry = json.loads(index.read_text())
            name, stem = entry["stem"], files.cache_root() / "src" / entry["stem"]
            if stem.name == name and name.startswith(spec.name + "-") and entry["files"] and all(
                    _sha256(stem.with_name(name + suffix).read_bytes()) == sha
                    for suffix, sha in entry["files"].items()):
                return stem.with_name(name + entry["source"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass
    rendered = render(spec)
    path = write_source(spec, rendered)
    if index is not None:
        entry = {"stem": path.name.removesuffix(path.suffix), "source": path.suffix,
                 "files": {suffix: _sha256(text.encode()) for suffix, text in rendered.files.items()}}
        try:
            files.write_if_different(index, json.dumps(entry, sort_keys=True))
        except OSError:
            pass
    return path


def _index_entry(spec: KernelSpec) -> Path:
    root = codegen.template_dir()
    key = files.digest("index", __version__, spec.to_json(), str(root), repr(_package_stamp()),
                       repr(codegen._stamp(root)),  # the templates again: an edit within this process counts
                       codegen.render_state(spec))  # the variant the render reads (render.render_state)
    return files.cache_root() / "src" / "index" / key[:2] / f"{key[:32]}.json"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@functools.cache
def _package_stamp() -> tuple:
    """(name, mtime, size) of every .py and .j2 file of the fagen package (its templates included), once a process."""
    package = Path(__file__).resolve().parent.parent
    return tuple(sorted((str(p.relative_to(package)), st.st_mtime_ns, st.st_size) for p in package.rglob("*")
                        if p.suffix in (".py", ".j2") for st in (p.stat(),)))


def load_source(source: str, name: str) -> ModuleType:
    """Import source text that is not a plain render (a mutant under test, say), through the cache."""
    path = files.cache_root() / "src" / f"{name}-{files.digest(source)[:20]}.py"
    files.write_if_different(path, source)
    return import_module(path)
