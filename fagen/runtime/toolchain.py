"""The ptxas that builds fagen's kernels, whatever else the process has loaded ([Note] One ptxas).

[Note] One ptxas
Triton finds ptxas through TRITON_PTXAS_PATH at every compile, and torch.compile's Inductor sets that variable, the
first time it compiles a Triton kernel, to the ptxas torch ships (torch/bin/ptxas: CUDA 13.0 in torch 2.11+cu130)
when it is unset. From then on every Triton kernel the process builds, fagen's included, is register-allocated by
that ptxas instead of the one Triton bundles (12.8 in triton 3.6), and Triton's cache key does not notice: it holds
the ptxas version it read first (an lru_cache). fagen's kernels are tuned with Triton's own ptxas; the window row's
Gluon backward (d128 causal + window) builds with a 64-byte stack there and a 104-byte one under CUDA 13.0's ptxas
(the same 168 registers; sm_90, `scripts/gpu_window_gap_s21.py`), and runs 7.8% longer on the H200 in any process
that called torch.compile first (issue 26's window row, docs/mods.md "The window row's backward in the suite
(twenty-first session)").

So fagen builds its kernels with one ptxas: FAGEN_PTXAS_PATH when set (a user's deliberate choice), else the one
Triton bundles. Every @triton.jit / @gluon.jit function of a module fagen imports (fagen/runtime/modules.py) gets a
_do_compile (the step of a launch or warmup that builds a missing specialisation; triton 3.6) that sets
TRITON_PTXAS_PATH for the length of the build and puts the process's value back after; the
ahead-of-time builds (fagen/aot/artifacts.py) run inside the same scope, and their key names that ptxas
(fagen/aot/keys.py, codegen_env). Other libraries' kernels are untouched:
the variable holds fagen's ptxas only while a fagen kernel builds. Builds of several threads at once share the
scope (a count under a lock: the first sets the variable, the last restores it).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading

_ENV = "TRITON_PTXAS_PATH"
_LOCK = threading.Lock()
_DEPTH = [0, None]  # builds inside the scope, the process's value before the first


@functools.cache
def _bundled() -> str | None:
    """Triton's own ptxas (the default its knob falls back to), or None where this Triton has no such knob."""
    try:
        import triton

        tool = type(triton.knobs.nvidia).__dict__["ptxas"]
        path = tool.default_path
    except (AttributeError, KeyError, ImportError):
        return None
    return path if os.path.isfile(path) and os.access(path, os.X_OK) else None


def ptxas_path() -> str | None:
    """The ptxas fagen builds with: FAGEN_PTXAS_PATH, else Triton's bundled one (None: leave Triton's choice)."""
    return os.environ.get("FAGEN_PTXAS_PATH") or _bundled()


@contextlib.contextmanager
def pinned_ptxas():
    """TRITON_PTXAS_PATH = ptxas_path() for the length of the block (nested and concurrent blocks share it)."""
    path = ptxas_path()
    if path is None:
        yield
        return
    with _LOCK:
        if _DEPTH[0] == 0:
            _DEPTH[1] = os.environ.get(_ENV)
        _DEPTH[0] += 1
        os.environ[_ENV] = path
    try:
        yield
    finally:
        with _LOCK:
            _DEPTH[0] -= 1
            if _DEPTH[0] == 0:
                if _DEPTH[1] is None:
                    os.environ.pop(_ENV, None)
                else:
                    os.environ[_ENV] = _DEPTH[1]


def _pinned_build(build, *args, **kwargs):
    with pinned_ptxas():
        return build(*args, **kwargs)


def pin_module(module) -> int:
    """Give every JIT function of `module` the pinned build (an instance attribute over JITFunction._do_compile,
    which run() and warmup() call); returns how many it changed. Interpreted functions and Triton releases
    without a _do_compile are left as they are (their kernels build with Triton's choice of ptxas)."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return 0
    n = 0
    for value in list(vars(module).values()):
        build = getattr(value, "_do_compile", None) if isinstance(value, JITFunction) else None
        if callable(build) and getattr(build, "func", None) is not _pinned_build:
            value._do_compile = functools.partial(_pinned_build, build)
            n += 1
    return n
