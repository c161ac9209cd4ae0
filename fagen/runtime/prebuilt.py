"""Run prebuilt cubins from a build directory through the CUDA driver (fagen/runtime/driver.py): no compile at run
time."""

from __future__ import annotations

import ctypes
import hashlib
import json
import threading
from pathlib import Path
from types import ModuleType

from fagen import files
from fagen.runtime.driver import cuda_driver
from fagen.runtime.modules import import_module
from fagen.spec.kernel import KernelSpec

_MAX_I32 = 2**31


class PrebuiltError(RuntimeError):
    """A build directory cannot serve this spec on this GPU; the message says what to rebuild."""


def load(spec: KernelSpec, build_dir: Path) -> ModuleType:
    """The variant's module from build_dir, its kernels replaced by launchers of the prebuilt cubins."""
    vdir = build_dir / spec.name
    try:
        variant = json.loads((vdir / "variant.json").read_text())
    except (OSError, ValueError) as e:
        raise PrebuiltError(f"{vdir}/variant.json cannot be read ({e}); build the variant first: "
                            f"fagen compile ... -o {build_dir} (or fagen build MANIFEST -o {build_dir})") from None
    if variant.get("hash") != spec.hash:
        raise PrebuiltError(f"{vdir} holds spec {variant.get('hash')}, not {spec.hash}; rebuild it")
    source = vdir / variant["source"]
    source_sha = hashlib.sha256(source.read_bytes()).hexdigest()
    if source_sha != variant["source_sha256"]:
        raise PrebuiltError(f"{source} changed after it was built; rebuild {build_dir}")
    name = f"fagen_prebuilt.{spec.name}_{files.digest(str(vdir.resolve()), source_sha)[:16]}"
    with _lock:
        module = import_module(source, name)
        if not getattr(module, "_FAGEN_PREBUILT", False):
            for entry in module.AOT_KERNELS:
                builds = {arch: _checked(vdir, arch, entry, info) for arch, info in variant["archs"].items()}
                attr = next(k for k, v in vars(module).items() if v is entry["fn"])
                setattr(module, attr, PrebuiltKernel(entry, builds, vdir, module.InputError))
            module._FAGEN_PREBUILT = True
    return module


def _checked(vdir: Path, arch: str, entry: dict, info: dict) -> dict:
    """The build record of entry's kernel for arch, after checking it matches the module and its cubin."""
    record = next((k for k in info["kernels"] if k["name"] == entry["name"]), None)
    if record is None:
        raise PrebuiltError(f"{vdir}/variant.json has no kernel {entry['name']} for {arch}; rebuild it")
    params = [[n, t] for n, t in entry["signature"].items() if t != "constexpr"]
    if record["launch"]["params"] != params or record["launch"]["constexprs"] != entry["constexprs"]:
        raise PrebuiltError(f"{vdir}: the {arch} cubin of {entry['name']} was built for other arguments than "
                            "the module declares; rebuild it")
    cubin = (vdir / record["cubin"]).read_bytes()
    if hashlib.sha256(cubin).hexdigest() != record["cubin_sha256"]:
        raise PrebuiltError(f"{vdir / record['cubin']} changed after it was built; rebuild it")
    return {**record, "cubin_bytes": cubin}


_lock = threading.Lock()
_CTYPE = {"i1": ctypes.c_int8, "i8": ctypes.c_int8, "i16": ctypes.c_int16, "i32": ctypes.c_int32,
          "i64": ctypes.c_int64, "u1": ctypes.c_uint8, "u8": ctypes.c_uint8, "u16": ctypes.c_uint16,
          "u32": ctypes.c_uint32, "u64": ctypes.c_uint64, "fp32": ctypes.c_float, "fp64": ctypes.c_double}


class PrebuiltKernel:
    """Stands in for a @triton.jit kernel: kernel[grid](*args, **kwargs) launches the cubin for this GPU's arch.

    [Note] Kernel ABI (Triton 3.6, as in triton/backends/nvidia/driver.py and triton/tools/compile.py): the
    kernel's parameters are its non-constexpr arguments in order (pointers as 64-bit device addresses, ints
    and floats by value), then two pointers Triton appends: global scratch and profile scratch. The block is
    num_warps * 32 threads; dynamic shared memory is the compiled `shared`, opted in above 48 KB.
    """

    def __init__(self, entry: dict, builds: dict[str, dict], vdir: Path, input_error: type):
        self.fn, self.name, self.vdir, self.builds = entry["fn"], entry["name"], vdir, builds
        self.arg_names = list(self.fn.arg_names)
        self.signature, self.constexprs = entry["signature"], entry["constexprs"]
        self.divisible = set(entry.get("divisible", ()))
        self.num_warps, self.num_stages = entry["num_warps"], entry["num_stages"]
        self.input_error = input_error
        self._functions: dict[tuple[int, str], tuple] = {}

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.run(grid, args, kwargs)

    def run(self, grid, args: tuple, kwargs: dict):
        kwargs = dict(kwargs)
        warps, stages = kwargs.pop("num_warps", self.num_warps), kwargs.pop("num_stages", self.num_stages)
        bound = dict(zip(self.arg_names, args))
        given = set(bound) | set(kwargs)
        if len(args) > len(self.arg_names) or set(bound) & set(kwargs) or given != set(self.arg_names):
            raise TypeError(f"{self.name}: takes exactly the arguments {self.arg_names}")
        bound.update(kwargs)
        params = self._params(bound)
        device = next(v.device for v in bound.values() if hasattr(v, "data_ptr"))
        if device.type != "cuda":
            # [Note] No GPU: under TRITON_INTERPRET=1 the interpreted kernel runs instead, after the same checks,
            # so the CPU tests exercise everything but the launch itself.
            return self.fn[grid](*args, num_warps=warps, num_stages=stages, **kwargs)
        wrong = {n: (bound[n], v) for n, v in self.constexprs.items() if bound[n] != v}
        if (warps, stages) != (self.num_warps, self.num_stages):
            wrong["(num_warps, num_stages)"] = ((warps, stages), (self.num_warps, self.num_stages))
        if wrong:
            raise PrebuiltError(f"{self.name}: launched with " + ", ".join(
                f"{n}={got!r} but built for {want!r}" for n, (got, want) in wrong.items()))
        return self._launch(grid, bound, params, device)

    def _params(self, bound: dict) -> list[tuple[str, int | float]]:
        """(type, value) of every non-constexpr argument; inputs the cubin was not built for raise InputError."""
        out = []
        for name in self.arg_names:
            ty, value = self.signature[name], bound[name]
            if ty == "constexpr":
                continue
            if ty.startswith("*"):
                if not hasattr(value, "data_ptr"):
                    raise self.input_error(f"{name}: {self.name} expects a tensor, got {type(value).__name__}")
                value = value.data_ptr()
                if name in self.divisible and value % 16:
                    raise self.input_error(
                        f"{name}: data pointer is not 16-byte aligned, but the prebuilt {self.name} assumes it (as "
                        "Triton's JIT specializes for aligned inputs); pass a fresh or .clone()d tensor, or load "
                        "without build_dir to compile for this case")
            elif ty in ("fp32", "fp64"):
                value = float(value)
            elif ty in _CTYPE:
                value = int(value)
                if ty == "i32" and not -_MAX_I32 <= value < _MAX_I32:
                    raise self.input_error(f"{name} = {value} does not fit the prebuilt kernel's int32 argument; "
                                           "use smaller tensors, or load without build_dir")
                if name in self.divisible and value % 16:
                    raise self.input_error(
                        f"{name} = {value} is not a multiple of 16, but the prebuilt {self.name} assumes it (as "
                        "Triton's JIT would specialize for contiguous inputs); pass .contiguous() tensors, or load "
                        "without build_dir to compile for this layout")
            else:
                raise PrebuiltError(f"{self.name}: argument type {ty} of {name} is not supported by prebuilt launch")
            out.append((ty, value))
        return out

    def _launch(self, grid, bound: dict, params: list, device):
        import torch

        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        arch = f"sm_{major}{minor}"
        record = self.builds.get(arch)
        if record is None:
            raise PrebuiltError(f"{self.vdir} has {self.name} for {', '.join(self.builds) or 'no arch'}, but this GPU "
                                f"is {arch}; rebuild with --arch {arch}")
        launch = record["launch"]
        grid = grid(bound) if callable(grid) else grid
        gx, gy, gz = (tuple(int(g) for g in grid) + (1, 1))[:3]
        if gx * gy * gz == 0:
            return None
        with torch.cuda.device(index):
            function = self._function(index, arch, record)
            stream = torch.cuda.current_stream(index).cuda_stream
            scratch = []  # kept alive until the launch is queued; stream order protects the memory after that
            for kind in ("global", "profile"):
                size, align = launch[f"{kind}_scratch_size"], launch[f"{kind}_scratch_align"]
                if size:
                    buf = torch.empty(gx * gy * gz * size + align, dtype=torch.uint8, device=device)
                    scratch.append(buf)
                    params.append(("*", buf.data_ptr() + (-buf.data_ptr()) % align))
                else:
                    params.append(("*", 0))
            args = [(ctypes.c_uint64 if ty.startswith("*") else _CTYPE[ty])(value) for ty, value in params]
            cuda_driver().launch(function, (gx, gy, gz), 32 * launch["num_warps"], launch["dynamic_shared"], stream,
                                 args, self.name)
        return None

    def _function(self, index: int, arch: str, record: dict):
        key = (index, arch)
        if key not in self._functions:
            self._functions[key] = cuda_driver().load(record["cubin_bytes"], record["launch"]["symbol"], index,
                                                      record["launch"]["dynamic_shared"], self.name)
        return self._functions[key]
