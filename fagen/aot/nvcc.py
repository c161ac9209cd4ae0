"""Compile CUDA sources with nvcc to cubin and PTX for one arch, report resources, cache by content."""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import subprocess
import tempfile
import time
from pathlib import Path

from fagen import backends, files
from fagen.runtime.driver import NVCC_FLAGS, find_nvcc, nvcc_command
from fagen.spec import targets

FLAGS = NVCC_FLAGS  # -O3, C++17, no fast-math, -Xptxas -v (the resource report): fagen/runtime/driver.py
WERROR = ("-Werror", "all-warnings")  # the generated sources compile with zero warnings; tests hold them to it
MIN_ARCH = 80  # mma.sync m16n8k16 with bf16, ldmatrix and cp.async need sm_80 or newer
FORMAT = "1"  # bump when the artifact layout in the cache changes
_ARCH = re.compile(r"sm_(\d+)a?")


class NvccError(RuntimeError):
    """nvcc is missing, rejected the arch, or failed to compile; the message carries its log."""


@dataclasses.dataclass(frozen=True)
class Resources:
    """What ptxas reports for one kernel on one arch. Shared memory: static from ptxas, dynamic from the spec."""

    registers: int
    spill_stores: int  # bytes
    spill_loads: int  # bytes
    stack: int  # bytes of stack frame
    static_smem: int  # bytes
    dynamic_smem: int = 0  # bytes requested at launch (filled in by compile_spec)

    @property
    def smem(self) -> int:
        return self.static_smem + self.dynamic_smem


@dataclasses.dataclass(frozen=True)
class Compiled:
    """The artifacts of one compile: paths, per-kernel resources, wall time (0.0 on a cache hit)."""

    cubin: Path
    ptx: Path
    arch: str
    resources: dict[str, Resources]
    seconds: float
    cached: bool = False


def check_arch(arch: str) -> str:
    """`arch` if it names an sm_XY target this backend supports, else NvccError saying what is allowed."""
    m = _ARCH.fullmatch(arch) if isinstance(arch, str) else None
    if m is None or int(m.group(1)) < MIN_ARCH:
        raise NvccError(f"arch: got {arch!r}; the cuda backend needs sm_80 or newer, spelled like 'sm_80' or 'sm_90'")
    return arch


def nvcc_path() -> str:
    path = find_nvcc()
    if path is None:
        raise NvccError("nvcc not found on PATH or in $CUDA_HOME/bin; install the CUDA toolkit (12.x or 13.x) or add "
                        "its bin/ to PATH")
    return path


@functools.cache
def nvcc_version() -> str:
    """The `release X.Y, VX.Y.Z` line of nvcc --version: part of every cache key."""
    out = subprocess.run([nvcc_path(), "--version"], capture_output=True, text=True, check=False).stdout
    lines = [line for line in out.splitlines() if "release" in line]
    return lines[-1].strip() if lines else out.strip()


def parse_resources(log: str) -> dict[str, Resources]:
    """Per-kernel resources from `-Xptxas -v` output (one 'Compiling entry function' block per kernel)."""
    found: dict[str, Resources] = {}
    name = None
    stack = stores = loads = 0
    for line in log.splitlines():
        if m := re.search(r"Compiling entry function '([^']+)'", line):
            name, stack, stores, loads = m.group(1), 0, 0, 0
        elif m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line):
            stack, stores, loads = (int(x) for x in m.groups())
        elif name and (m := re.search(r"Used (\d+) registers", line)):
            smem = re.search(r"(\d+) bytes smem", line)
            found[name] = Resources(registers=int(m.group(1)), spill_stores=stores, spill_loads=loads,
                                    stack=stack, static_smem=int(smem.group(1)) if smem else 0)
            name = None
    return found


def compile(source: str, arch: str, out_dir: str | Path, *, name: str = "kernel", werror: bool = False,
            timeout: float = 600.0) -> Compiled:
    """nvcc `source` for `arch` into out_dir/{name}.cubin and out_dir/{name}.ptx, with ptxas's resource report.

    Raises NvccError with nvcc's log when it fails. Writes are atomic: a failure leaves no half-written file.
    """
    arch = check_arch(arch)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fagen-nvcc-") as tmp:
        cu, cubin, ptx = (Path(tmp) / f"{name}.{ext}" for ext in ("cu", "cubin", "ptx"))
        cu.write_text(source)
        # One nvcc run: --keep leaves the PTX it compiled the cubin from beside the source.
        cmd = nvcc_command(nvcc_path(), arch, cu, cubin, (*(WERROR if werror else ()), "--keep", "--keep-dir", tmp))
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            raise NvccError(f"nvcc ({arch}) ran past {timeout:.0f} s on {name}") from None
        log = proc.stdout + proc.stderr
        if proc.returncode != 0 or not cubin.exists() or not ptx.exists():
            raise NvccError(f"nvcc ({arch}) failed on {name} (exit {proc.returncode}):\n{log.strip()}")
        outputs = {"cubin": cubin.read_bytes(), "ptx": ptx.read_bytes()}
    seconds = time.perf_counter() - start
    resources = parse_resources(log)
    if not resources:
        raise NvccError(f"nvcc ({arch}) printed no resource report for {name}:\n{log}")
    paths = {}
    for kind, data in outputs.items():
        paths[kind] = out_dir / f"{name}.{kind}"
        files.write_if_different(paths[kind], data)
    return Compiled(cubin=paths["cubin"], ptx=paths["ptx"], arch=arch, resources=resources, seconds=seconds)


def _flags(werror: bool) -> list[str]:
    return [*FLAGS, *(WERROR if werror else ())]


def artifact_key(source: str, arch: str, *, werror: bool = False) -> str:
    """Cache key of a compile: format, nvcc version, arch, flags and the source bytes."""
    return files.digest("nvcc", FORMAT, nvcc_version(), check_arch(arch), " ".join(_flags(werror)), source)[:24]


def compile_cached(source: str, arch: str, *, name: str = "kernel", werror: bool = False) -> Compiled:
    """compile() into the content-addressed cache ($FAGEN_CACHE_DIR/cuda/<key>/); a hit runs no nvcc.

    resources.json is written last, so a folder that has it is complete; a concurrent compile of the same key
    waits on the lock and then finds it.
    """
    folder = files.cache_root() / "cuda" / artifact_key(source, arch, werror=werror)
    report = folder / "resources.json"
    with files.lock_for(folder):
        if report.exists():
            data = json.loads(report.read_text())
            return Compiled(cubin=folder / data["cubin"], ptx=folder / data["ptx"], arch=arch, cached=True,
                            seconds=0.0, resources={k: Resources(**v) for k, v in data["resources"].items()})
        done = compile(source, arch, folder, name=name, werror=werror)
        record = {"cubin": done.cubin.name, "ptx": done.ptx.name, "arch": arch,
                  "resources": {k: dataclasses.asdict(v) for k, v in done.resources.items()}}
        files.write_if_different(report, json.dumps(record, indent=1, sort_keys=True))
        return done


def check_fits(spec, arch: str) -> int:
    """The dynamic shared memory a cuda spec needs; NvccError if `arch` cannot give a block that much."""
    need = backends.CUDA.smem_bytes(spec)
    limit = targets.ARCH_SMEM_LIMIT.get(check_arch(arch).rstrip("a"))
    if limit is not None and need > limit:
        raise NvccError(f"{spec.name}: needs {need} bytes of shared memory but {arch} gives a block at most {limit}; "
                        "use fewer stages (--num-stages) or a smaller --block-n / --block-m")
    return need


def compile_spec(spec, arch: str, out_dir: str | Path | None = None, *, werror: bool = False,
                 rendered=None) -> Compiled:
    """Compile a cuda spec (its render, or `rendered` when the caller has it) for one arch; resources include its
    dynamic shared memory.

    With out_dir, artifacts land in out_dir/{spec.name}.{cubin,ptx}; without, in the cache (compile_cached).
    """
    from fagen.codegen.render import render

    if backends.get(spec.backend).compiler != "nvcc":
        raise NvccError(f"{spec.name}: backend {spec.backend} is not compiled by nvcc")
    dynamic = check_fits(spec, arch)
    source = (rendered or render(spec)).source
    if out_dir is None:
        done = compile_cached(source, arch, name=spec.name, werror=werror)
    else:
        done = compile(source, arch, out_dir, name=spec.name, werror=werror)
    resources = {k: dataclasses.replace(v, dynamic_smem=dynamic) for k, v in done.resources.items()}
    return dataclasses.replace(done, resources=resources)
