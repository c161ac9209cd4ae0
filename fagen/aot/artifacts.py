"""Ahead-of-time compile: a spec's kernels to PTX and cubin for each GPU arch, without a GPU, cached.

Triton specs go through triton.compile with an explicit target; cuda specs through nvcc (fagen.aot.nvcc).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Iterable

from fagen import __version__, backends
from fagen.aot import nvcc
from fagen.codegen.render import Rendered, render
from fagen.aot import keys
from fagen.files import digest, lock_for
from fagen.runtime.loader import write_source
from fagen.runtime.modules import import_module
from fagen.runtime.toolchain import pinned_ptxas
from fagen.spec import targets
from fagen.spec.kernel import KernelSpec
from fagen.spec.targets import ARCHS, ArchError, parse_archs  # noqa: F401 - re-exported for the CLI


# [Note] Shared-memory precheck. The Triton formula (fagen.backends.triton.smem_bytes) is an estimate within a
# few KB of what the compiler allocates; a variant over the limit by more than this slack is rejected before any
# compile (a 512 KB variant used to take minutes to fail), and one nearer the limit is left to the compiler.
PRECHECK_SLACK = 1.1


class CompileError(RuntimeError):
    """One variant could not be built for one arch; the message says which kernel, why and what to change."""

    def __init__(self, variant: str, arch: str, message: str):
        self.variant, self.arch, self.message = variant, arch, message
        super().__init__(f"{variant} [{arch}]: {message}")


@dataclasses.dataclass(frozen=True)
class KernelArtifact:
    name: str  # the @triton.jit function
    ptx: Path
    cubin: Path
    registers: int  # per thread
    spills: int  # per-thread local memory in 32-bit words (what Triton reports as n_spills); 0: no spilling
    shared: int  # bytes of shared memory per block, dynamic + static
    seconds: float  # triton.compile time of this kernel when it was built
    launch: dict  # what fagen.runtime.prebuilt needs to launch the cubin: symbol, params, constexprs, shared, ...


@dataclasses.dataclass(frozen=True)
class ArchBuild:
    spec: KernelSpec
    arch: str
    key: str
    kernels: tuple[KernelArtifact, ...]
    seconds: float  # compile time when the entry was built; a cached result reports that original time
    cached: bool


def artifact_key(spec: KernelSpec, arch: str, rendered: Rendered | None = None) -> str:
    """The content key of one spec's binaries for one arch (see [Note] Artifact keys in fagen/aot/keys.py)."""
    rendered = rendered or render(spec)
    return digest("aot", str(keys.FORMAT_VERSION), __version__, spec.to_json(), rendered.digest,
                        keys.toolchain(spec.backend.value, targets.ARCH_CAPABILITY[arch]), arch,
                        json.dumps(keys.codegen_env()))


def lookup(spec: KernelSpec, arch: str, key: str | None = None) -> ArchBuild | None:
    """The cached build of (spec, arch), or None."""
    key = key or artifact_key(spec, arch)
    meta = keys.read_entry(key)
    if meta is None:
        return None
    for k in meta["kernels"]:  # the limit is not part of the key: check it on every use
        if k["shared"] > targets.ARCH_SMEM_LIMIT[arch]:
            raise CompileError(spec.name, arch, f"kernel {k['name']}: " + _too_big(spec, arch, k["shared"]))
    return _from_entry(spec, arch, key, meta, cached=True)


def aot_missing(spec: KernelSpec) -> str | None:
    """Why `spec` has no ahead-of-time build (`fagen build` leaves such variants out and counts them), or None."""
    return backends.get(spec.backend).aot_missing(spec)


def compile_arch(spec: KernelSpec, arch: str) -> ArchBuild:
    """Build one spec for one arch, or take it from the cache. Safe to run from many processes at once.

    The spec is rendered once here (the key, the source to compile and nvcc's input are that one render), and a
    variant whose tiles cannot fit the arch's shared memory by the backend's formula is rejected before compiling.
    """
    missing = aot_missing(spec)
    if missing:
        raise CompileError(spec.name, arch, missing)
    rendered = render(spec)
    key = artifact_key(spec, arch, rendered)
    hit = lookup(spec, arch, key)
    if hit is not None:
        return hit
    need = backends.get(spec.backend).smem_bytes(spec)
    if need > targets.ARCH_SMEM_LIMIT[arch] * PRECHECK_SLACK:
        raise CompileError(spec.name, arch, _too_big(spec, arch, need) + " (estimated before compiling)")
    # [Note] One builder per key: the lock is flock-based, so a killed builder releases it. A waiter then
    # looks again and takes what the other process finished, or compiles it itself.
    with lock_for(keys.entry_dir(key)):
        hit = lookup(spec, arch, key)
        if hit is not None:
            return hit
        start = time.perf_counter()
        if backends.get(spec.backend).compiler == "nvcc":
            files, kernels = _compile_cuda(spec, arch, rendered)
        else:
            files, kernels = _compile_triton(spec, arch, rendered)
        meta = {"spec": spec.to_dict(), "arch": arch, "seconds": round(time.perf_counter() - start, 3),
                "kernels": kernels}
        meta = keys.write_entry(key, files, meta)
    return _from_entry(spec, arch, key, meta, cached=False)


def _compile_triton(spec: KernelSpec, arch: str, rendered: Rendered) -> tuple[dict, list]:
    """Each AOT kernel of the generated module through triton.compile for an explicit GPU target."""
    module = import_for_compile(spec, rendered)
    if not hasattr(module, "AOT_KERNELS"):
        raise CompileError(spec.name, arch, "the generated module has no AOT_KERNELS list (docs/build.md)")
    files, kernels = {}, []
    for entry in module.AOT_KERNELS:
        kernel_start = time.perf_counter()
        with _compiled_mode():  # Triton's code generator also reads TRITON_INTERPRET
            ptx, cubin, record = _compile_kernel(spec, arch, entry)
        files[f"{entry['name']}.ptx"], files[f"{entry['name']}.cubin"] = ptx, cubin
        kernels.append({**record, "seconds": round(time.perf_counter() - kernel_start, 3)})
    return files, kernels


def _compile_cuda(spec: KernelSpec, arch: str, rendered: Rendered) -> tuple[dict, list]:
    """The .cu source through nvcc (fagen.aot.nvcc); the launcher module loads the cubin (use_cubin)."""
    try:
        done = nvcc.compile_spec(spec, arch, rendered=rendered)
    except nvcc.NvccError as e:
        raise CompileError(spec.name, arch, str(e)) from None
    files, kernels = {}, []
    for name, res in done.resources.items():
        files[f"{name}.ptx"], files[f"{name}.cubin"] = done.ptx.read_bytes(), done.cubin.read_bytes()
        kernels.append({"name": name, "registers": res.registers, "spills": res.spill_stores // 4,
                        "shared": res.smem, "seconds": round(done.seconds, 3),
                        "launch": {"backend": "cuda", "symbol": name, "shared": res.dynamic_smem}})
    return files, kernels


def compile_spec(spec: KernelSpec, archs: Iterable[str]) -> list[ArchBuild]:
    return [compile_arch(spec, arch) for arch in archs]


def _from_entry(spec: KernelSpec, arch: str, key: str, meta: dict, cached: bool) -> ArchBuild:
    root = keys.entry_dir(key)
    kernels = tuple(KernelArtifact(name=k["name"], ptx=root / f"{k['name']}.ptx", cubin=root / f"{k['name']}.cubin",
                                   registers=k["registers"], spills=k["spills"], shared=k["shared"],
                                   seconds=k["seconds"], launch=k["launch"]) for k in meta["kernels"])
    return ArchBuild(spec=spec, arch=arch, key=key, kernels=kernels, seconds=meta["seconds"], cached=cached)


@contextlib.contextmanager
def _compiled_mode():
    """Import generated modules as compiled Triton even when TRITON_INTERPRET=1 (as in the CPU tests)."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old


def import_for_compile(spec: KernelSpec, rendered: Rendered | None = None) -> ModuleType:
    """The generated module with real @triton.jit functions (never the interpreter's).

    Its code is named `<variant>.py`, not the cache path, so PTX and cubins do not depend on where the cache is.
    """
    path = write_source(spec, rendered)
    with _compiled_mode():
        return import_module(path, "fagen_aot." + path.stem.replace("-", "_"), filename=f"{spec.name}.py")


def _compile_kernel(spec: KernelSpec, arch: str, entry: dict) -> tuple[bytes, bytes, dict]:
    """triton.compile one AOT_KERNELS entry for `arch`: (ptx, cubin, record for the cache entry)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.errors import OutOfResources

    name, fn = entry["name"], entry["fn"]
    fail = lambda msg: CompileError(spec.name, arch, f"kernel {name}: {msg}")  # noqa: E731
    if not isinstance(fn, triton.runtime.JITFunction):
        raise fail(f"AOT_KERNELS 'fn' must be a @triton.jit function, got {type(fn).__name__}")
    signature, constexprs = dict(entry["signature"]), dict(entry["constexprs"])
    if set(signature) != set(fn.arg_names):
        raise fail(f"AOT_KERNELS signature names {sorted(set(signature) ^ set(fn.arg_names))} do not match the "
                   "kernel's arguments")
    wants = {n for n, t in signature.items() if t == "constexpr"}
    if wants != set(constexprs):
        raise fail(f"constexpr arguments {sorted(wants)} need exactly one value each; AOT_KERNELS gives "
                   f"{sorted(constexprs)}")
    divisible = list(entry.get("divisible", ()))
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    target = GPUTarget("cuda", targets.ARCH_CAPABILITY[arch], 32)
    backend = make_backend(target)
    options = backend.parse_options({"num_warps": entry["num_warps"], "num_stages": entry["num_stages"]})
    try:
        with pinned_ptxas():  # [Note] One ptxas
            kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                                    options=options.__dict__)
    except OutOfResources as e:
        if "shared" in str(e.name):
            raise fail(_too_big(spec, arch, e.required)) from None
        raise fail(f"out of {e.name}: needs {e.required}, {arch} allows {e.limit}; use smaller block_m/block_n or "
                   "fewer num_warps/num_stages") from None
    except triton.CompilationError as e:
        raise fail("Triton could not compile it: " + str(e).strip().splitlines()[-1]) from None
    md = kernel.metadata
    if md.num_ctas != 1 or md.launch_cooperative_grid or md.launch_pdl:
        raise fail("it needs clusters, cooperative or PDL launches, which the prebuilt launcher does not do")
    cubin = kernel.asm["cubin"]
    registers, stack, static_shared = _resource_usage(cubin)
    shared = md.shared + static_shared
    if shared > targets.ARCH_SMEM_LIMIT[arch]:
        raise fail(_too_big(spec, arch, shared))
    params = [[n, t] for n, t in signature.items() if t != "constexpr"]
    launch = {"symbol": md.name, "params": params, "constexprs": constexprs, "divisible": divisible,
              "num_warps": md.num_warps, "num_stages": md.num_stages, "dynamic_shared": md.shared,
              "global_scratch_size": md.global_scratch_size, "global_scratch_align": md.global_scratch_align,
              "profile_scratch_size": md.profile_scratch_size, "profile_scratch_align": md.profile_scratch_align}
    record = {"name": name, "registers": registers, "spills": stack // 4, "shared": shared, "launch": launch}
    return kernel.asm["ptx"].encode(), cubin, record


def _too_big(spec: KernelSpec, arch: str, need: int) -> str:
    limit = targets.ARCH_SMEM_LIMIT[arch]
    return (f"needs {need / 1024:g} KB of shared memory per block but {arch} allows {limit / 1024:g} KB; use a "
            f"smaller block_n (now {spec.block_n}) or block_m (now {spec.block_m}), or fewer num_stages "
            f"(now {spec.num_stages})")


_USAGE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def _resource_usage(cubin: bytes) -> tuple[int, int, int]:
    """(registers, stack bytes, static shared bytes) of the cubin's one kernel, read by cuobjdump."""
    from triton import knobs

    with tempfile.TemporaryDirectory(prefix="fagen-cubin-") as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        out = subprocess.run([knobs.nvidia.cuobjdump.path, "--dump-resource-usage", str(path)],
                             capture_output=True, text=True, check=True).stdout
    match = _USAGE.search(out)
    if match is None:
        raise RuntimeError(f"cannot read resource usage from cuobjdump output:\n{out}")
    regs, stack, shared, local = map(int, match.groups())
    return regs, stack + local, shared
