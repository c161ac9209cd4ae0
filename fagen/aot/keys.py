"""AOT artifact entries: the content key of a compiled variant (format, toolchain, code-generating environment) and
the entry folders under the cache root, written files first and entry.json last."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import subprocess
from pathlib import Path

from fagen.files import cache_root, write_if_different

# [Note] Artifact keys
# An AOT entry is keyed by everything that shapes its bytes: the canonical spec, its rendered source (which
# covers the templates and the tables they read: see [Note] Cache keys hash the render), the fagen version, FORMAT_VERSION (bump it when what compile writes changes), the toolchain
# (triton version and its ptxas, nvcc for the CUDA backend), the arch, and the environment variables that
# change code generation. Nothing is keyed by name, so a stale binary can never be served.
FORMAT_VERSION = 1

# TRITON_* variables that only move files around or print: they never change the generated code.
_NEUTRAL_ENV = frozenset({
    "TRITON_CACHE_DIR", "TRITON_HOME", "TRITON_DUMP_DIR", "TRITON_OVERRIDE_DIR", "TRITON_INTERPRET",
    "TRITON_CACHE_MANAGER", "TRITON_REMOTE_CACHE_BACKEND", "TRITON_REDIS_HOST", "TRITON_REDIS_PORT",
    "TRITON_REDIS_KEY_FORMAT", "TRITON_ALWAYS_COMPILE", "TRITON_KERNEL_DUMP", "TRITON_STORE_BINARY_ONLY",
    "TRITON_DUMP_PTXAS_LOG", "TRITON_PRINT_AUTOTUNING", "TRITON_CACHE_AUTOTUNING", "TRITON_PROTON_DISABLE",
    "TRITON_ENABLE_NVTX",
})


def codegen_env() -> dict[str, str]:
    """The set environment variables that may change generated code (conservative: every TRITON_* that is not
    known to be neutral, ptxas options, and whatever Triton's C++ side lists as cache-invalidating)."""
    from triton._C.libtriton import get_cache_invalidating_env_vars

    env = {k: v for k, v in os.environ.items()
           if (k.startswith("TRITON_") and k not in _NEUTRAL_ENV) or k in ("PTXAS_OPTIONS", "DISABLE_PTXAS_OPT")}
    env.update(get_cache_invalidating_env_vars())
    from fagen.runtime.toolchain import ptxas_path

    pinned = ptxas_path()  # the ptxas the build runs with ([Note] One ptxas), not the process's TRITON_PTXAS_PATH
    if pinned:
        env["TRITON_PTXAS_PATH"] = pinned
    return dict(sorted(env.items()))


@functools.cache
def toolchain(backend: str, capability: int) -> str:
    """Versions of the tools that turn a source into a binary for this backend and arch."""
    import triton

    if backend == "cuda":
        try:
            out = subprocess.run(["nvcc", "--version"], capture_output=True, text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            out = "nvcc: not found"
        return f"triton {triton.__version__}; {out.strip().splitlines()[-1]}"
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    return f"triton {triton.__version__}; " + make_backend(GPUTarget("cuda", capability, 32)).hash()


def entry_dir(key: str) -> Path:
    return cache_root() / "aot" / key[:2] / key


def read_entry(key: str) -> dict | None:
    """The entry stored under `key` if it is complete and every file still hashes to what was recorded."""
    root = entry_dir(key)
    try:
        meta = json.loads((root / "entry.json").read_text())
        for name, sha in meta["files"].items():
            if hashlib.sha256((root / name).read_bytes()).hexdigest() != sha:
                return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return meta


def write_entry(key: str, files: dict[str, bytes], meta: dict) -> dict:
    """Store files, then entry.json (with their sha256) last: a reader sees a whole entry or none."""
    root = entry_dir(key)
    for name, data in files.items():
        write_if_different(root / name, data)
    meta = {**meta, "key": key, "files": {n: hashlib.sha256(d).hexdigest() for n, d in sorted(files.items())}}
    write_if_different(root / "entry.json", json.dumps(meta, indent=1, sort_keys=True))
    return meta
