"""Ahead-of-time compile: a spec's kernels to PTX and cubin for each GPU arch, without a GPU, cached.

Triton specs go through triton.compile with an explicit target; cuda specs through nvcc (fagen.nvcc).
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

from fagen import __version__, cache, nvcc, runtime, tables
from fagen.enums import Backend
from fagen.render import generate, source_digest
from fagen.spec import KernelSpec

ARCHS = tuple(tables.ARCH_CAPABILITY)


class ArchError(ValueError):
    """An --arch value fagen cannot compile for."""


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
    launch: dict  # what fagen.prebuilt needs to launch the cubin: symbol, params, constexprs, shared, ...


@dataclasses.dataclass(frozen=True)
class ArchBuild:
    spec: KernelSpec
    arch: str
    key: str
    kernels: tuple[KernelArtifact, ...]
    seconds: float  # compile time when the entry was built; a cached result reports that original time
    cached: bool


def parse_archs(value: str | Iterable[str]) -> tuple[str, ...]:
    """'sm_80,sm_90' -> ('sm_80', 'sm_90'); unknown names raise ArchError listing the known ones."""
    items = [a.strip() for a in (value.split(",") if isinstance(value, str) else value)]
    if not items or not all(items):
        raise ArchError(f"got {value!r}; give a comma-separated list of {', '.join(ARCHS)}")
    for arch in items:
        if arch not in tables.ARCH_CAPABILITY:
            raise ArchError(f"unknown arch {arch!r}; choose from {', '.join(ARCHS)} (comma-separated)")
    return tuple(dict.fromkeys(items))


def artifact_key(spec: KernelSpec, arch: str) -> str:
    """The content key of one spec's binaries for one arch (see [Note] Artifact keys in fagen/cache.py)."""
    return cache.digest("aot", str(cache.FORMAT_VERSION), __version__, spec.to_json(), source_digest(spec),
                        cache.toolchain(spec.backend.value, tables.ARCH_CAPABILITY[arch]), arch,
                        json.dumps(cache.codegen_env()))


def lookup(spec: KernelSpec, arch: str, key: str | None = None) -> ArchBuild | None:
    """The cached build of (spec, arch), or None."""
    key = key or artifact_key(spec, arch)
    meta = cache.read_entry(key)
    if meta is None:
        return None
    for k in meta["kernels"]:  # the limit is not part of the key: check it on every use
        if k["shared"] > tables.ARCH_SMEM_LIMIT[arch]:
            raise CompileError(spec.name, arch, f"kernel {k['name']}: " + _too_big(spec, arch, k["shared"]))
    return _from_entry(spec, arch, key, meta, cached=True)


def compile_arch(spec: KernelSpec, arch: str) -> ArchBuild:
    """Build one spec for one arch, or take it from the cache. Safe to run from many processes at once."""
    key = artifact_key(spec, arch)
    hit = lookup(spec, arch, key)
    if hit is not None:
        return hit
    # [Note] One builder per key: the lock is flock-based, so a killed builder releases it. A waiter then
    # looks again and takes what the other process finished, or compiles it itself.
    with cache.lock_for(cache.entry_dir(key)):
        hit = lookup(spec, arch, key)
        if hit is not None:
            return hit
        start = time.perf_counter()
        files, kernels = _compile_cuda(spec, arch) if spec.backend is Backend.CUDA else _compile_triton(spec, arch)
        meta = {"spec": spec.to_dict(), "arch": arch, "seconds": round(time.perf_counter() - start, 3),
                "kernels": kernels}
        meta = cache.write_entry(key, files, meta)
    return _from_entry(spec, arch, key, meta, cached=False)


def _compile_triton(spec: KernelSpec, arch: str) -> tuple[dict, list]:
    """Each AOT kernel of the generated module through triton.compile for an explicit GPU target."""
    module = import_for_compile(spec)
    files, kernels = {}, []
    for entry in module.AOT_KERNELS:
        kernel_start = time.perf_counter()
        with _compiled_mode():  # Triton's code generator also reads TRITON_INTERPRET
            ptx, cubin, record = _compile_kernel(spec, arch, entry)
        files[f"{entry['name']}.ptx"], files[f"{entry['name']}.cubin"] = ptx, cubin
        kernels.append({**record, "seconds": round(time.perf_counter() - kernel_start, 3)})
    return files, kernels


def _compile_cuda(spec: KernelSpec, arch: str) -> tuple[dict, list]:
    """The .cu source through nvcc (fagen.nvcc); the launcher module loads the cubin (use_cubin)."""
    try:
        done = nvcc.compile_spec(spec, arch)
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
    root = cache.entry_dir(key)
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


def import_for_compile(spec: KernelSpec) -> ModuleType:
    """The generated module with real @triton.jit functions (never the interpreter's)."""
    path = runtime.write_source(spec)
    with _compiled_mode():
        return runtime._import(path, "fagen_aot." + path.stem.replace("-", "_"))


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
    target = GPUTarget("cuda", tables.ARCH_CAPABILITY[arch], 32)
    backend = make_backend(target)
    options = backend.parse_options({"num_warps": entry["num_warps"], "num_stages": entry["num_stages"]})
    try:
        kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
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
    if shared > tables.ARCH_SMEM_LIMIT[arch]:
        raise fail(_too_big(spec, arch, shared))
    params = [[n, t] for n, t in signature.items() if t != "constexpr"]
    launch = {"symbol": md.name, "params": params, "constexprs": constexprs, "divisible": divisible,
              "num_warps": md.num_warps, "num_stages": md.num_stages, "dynamic_shared": md.shared,
              "global_scratch_size": md.global_scratch_size, "global_scratch_align": md.global_scratch_align,
              "profile_scratch_size": md.profile_scratch_size, "profile_scratch_align": md.profile_scratch_align}
    record = {"name": name, "registers": registers, "spills": stack // 4, "shared": shared, "launch": launch}
    return kernel.asm["ptx"].encode(), cubin, record


def _too_big(spec: KernelSpec, arch: str, need: int) -> str:
    limit = tables.ARCH_SMEM_LIMIT[arch]
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


# -- writing artifacts ----------------------------------------------------------------------------------------
def export(spec: KernelSpec, builds: list[ArchBuild], out_dir: Path) -> list[dict]:
    """Copy a variant's source and binaries into out_dir/<name>/ and write its variant.json.

    Returns one record per arch for manifest.json, with paths relative to out_dir.
    """
    vdir = out_dir / spec.name
    source = vdir / f"{spec.name}{tables.SOURCE_SUFFIX[spec.backend]}"
    cache.write_if_different(source, generate(spec))
    records, archs = [], {}
    for b in builds:
        kernels = []
        for k in b.kernels:
            cubin = k.cubin.read_bytes()
            cache.write_if_different(vdir / b.arch / k.ptx.name, k.ptx.read_bytes())
            cache.write_if_different(vdir / b.arch / k.cubin.name, cubin)
            kernels.append({"name": k.name, "ptx": f"{b.arch}/{k.ptx.name}", "cubin": f"{b.arch}/{k.cubin.name}",
                            "registers": k.registers, "spills": k.spills, "shared": k.shared, "seconds": k.seconds,
                            "cubin_sha256": hashlib.sha256(cubin).hexdigest()})
        archs[b.arch] = {"key": b.key, "seconds": b.seconds,
                         "kernels": [{**rec, "launch": k.launch} for rec, k in zip(kernels, b.kernels)]}
        records.append({
            "name": spec.name, "hash": spec.hash, "spec": spec.to_dict(), "arch": b.arch,
            "source": f"{spec.name}/{source.name}", "key": b.key, "seconds": b.seconds, "cached": b.cached,
            "kernels": [{**{k: v for k, v in rec.items() if k != "cubin_sha256"},
                         "ptx": f"{spec.name}/{rec['ptx']}", "cubin": f"{spec.name}/{rec['cubin']}"}
                        for rec in kernels],
        })
    source_sha = hashlib.sha256(source.read_bytes()).hexdigest()
    old = _read_json(vdir / "variant.json")
    if old.get("hash") == spec.hash and old.get("source_sha256") == source_sha:
        archs = {**old.get("archs", {}), **archs}  # an earlier compile of this same source for other archs
    variant = {"name": spec.name, "hash": spec.hash, "spec": spec.to_dict(), "source": source.name,
               "source_sha256": source_sha, "fagen_version": __version__, "archs": dict(sorted(archs.items()))}
    cache.write_if_different(vdir / "variant.json", json.dumps(variant, indent=1, sort_keys=True) + "\n")
    return records


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
