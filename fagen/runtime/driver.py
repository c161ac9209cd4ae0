"""The CUDA toolchain a cubin needs at run time: the nvcc command line, and libcuda's calls that load and launch.

Static code with two users. fagen imports it: fagen/aot/nvcc.py builds its nvcc command with nvcc_command, and
fagen/runtime/prebuilt.py launches prebuilt Triton cubins through cuda_driver(). The render also includes everything
below the marker line verbatim into each CUDA backend launcher (`verbatim` in fagen/codegen/render.py;
fagen/templates/cuda/launcher.py.j2), which so stays a module that needs only torch and nvcc, not fagen. The code
below uses only the standard library modules imported above the marker, and names that cannot clash with the
launcher's.

[Note] ctypes, not cuda-python. The driver calls go through ctypes over libcuda.so.1, which every CUDA GPU machine
has (torch loads it too): `pip install fagen` needs no CUDA Python package for either the CUDA backend or prebuilt
cubins. cuda-python (an optional extra before) gave the CUDA launcher typed calls, but the dozen calls below are
short to declare, and one wrapper keeps one set of checks and one error.
"""

import ctypes
import os
import shutil
import threading

# -- fagen: included verbatim below this line --


class CudaError(RuntimeError):
    """A CUDA driver call failed, or the GPU cannot run a kernel; the message says which and why."""


# -O3 and C++17; no fast-math: exp2f/log2f keep their documented accuracy. -Xptxas -v prints each kernel's
# resources (fagen/aot/nvcc.py reads them); it also leaves a note in the cubin, so every compile passes it and the
# launcher's cubin is byte-identical to `fagen build`'s.
NVCC_FLAGS = ("-O3", "-std=c++17", "-Xptxas", "-v")


def find_nvcc():
    """The nvcc to compile with: on PATH, else in $CUDA_HOME/bin ($CUDA_PATH, /usr/local/cuda); None if none is."""
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    path = shutil.which("nvcc") or os.path.join(cuda_home, "bin", "nvcc")
    return path if os.path.isfile(path) else None


def nvcc_command(nvcc, arch, source, cubin, extra=()):
    """The one nvcc command line of fagen: `source` to a cubin for `arch` ("sm_90") with NVCC_FLAGS, then `extra`."""
    return [str(nvcc), "-cubin", f"-arch={arch}", *NVCC_FLAGS, *extra, "-o", str(cubin), str(source)]


class CudaDriver:
    """The few CUDA driver calls a launch needs, from libcuda.so.1 through ctypes ([Note] ctypes, not cuda-python).

    load() puts a cubin's kernel into the device's primary context (the one torch uses) and returns it as
    (context, function); launch() runs it on a stream with its arguments given as ctypes values, in the order and
    C types of the kernel's parameter list.
    """

    def __init__(self):
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise CudaError(f"cannot load the CUDA driver libcuda.so.1 ({e}); a CUDA GPU and its driver are "
                            "needed to launch") from None
        P, I, U, S = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.c_char_p  # noqa: N806
        ref = ctypes.POINTER
        for fn, args in {
            "cuInit": [U], "cuGetErrorName": [I, ref(S)], "cuGetErrorString": [I, ref(S)],
            "cuDeviceGet": [ref(I), I], "cuDevicePrimaryCtxRetain": [ref(P), I], "cuCtxSetCurrent": [P],
            "cuModuleLoadData": [ref(P), S], "cuModuleGetFunction": [ref(P), P, S],
            "cuDeviceGetAttribute": [ref(I), I, I], "cuFuncGetAttribute": [ref(I), I, P],
            "cuFuncSetAttribute": [P, I, I], "cuFuncSetCacheConfig": [P, I],
            "cuLaunchKernel": [P, U, U, U, U, U, U, U, P, ref(P), ref(P)],
        }.items():
            getattr(lib, fn).argtypes, getattr(lib, fn).restype = args, I
        self.lib = lib
        self._devices = {}  # device index -> (CUdevice, its retained primary context)
        self.check(lib.cuInit(0), "cuInit")

    def check(self, rc, call, label="fagen"):
        """CudaError naming `call`, the kernel (`label`) and the driver's error when rc is not CUDA_SUCCESS."""
        if rc != 0:
            name, text = ctypes.c_char_p(), ctypes.c_char_p()
            self.lib.cuGetErrorName(rc, ctypes.byref(name))
            self.lib.cuGetErrorString(rc, ctypes.byref(text))
            raise CudaError(f"{call} failed for {label}: {(name.value or str(rc).encode()).decode()}"
                            f"{': ' + text.value.decode() if text.value else ''}")

    def device(self, index):
        """(CUdevice, primary context) of GPU `index`, the context made current on this thread (a thread may have
        none current yet)."""
        lib, found = self.lib, self._devices.get(index)
        if found is None:
            device, context = ctypes.c_int(), ctypes.c_void_p()
            self.check(lib.cuDeviceGet(ctypes.byref(device), index), "cuDeviceGet")
            self.check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "cuDevicePrimaryCtxRetain")
            found = self._devices.setdefault(index, (device, context))
        self.check(lib.cuCtxSetCurrent(found[1]), "cuCtxSetCurrent")
        return found

    def load(self, image, symbol, index, shared, label=None):
        """(context, function) of kernel `symbol` of cubin bytes `image` on GPU `index`, able to launch with
        `shared` bytes of dynamic shared memory; CudaError if the GPU cannot give that much."""
        lib, byref, label = self.lib, ctypes.byref, label or symbol
        device, context = self.device(index)
        module, function = ctypes.c_void_p(), ctypes.c_void_p()
        self.check(lib.cuModuleLoadData(byref(module), image), "cuModuleLoadData", label)
        self.check(lib.cuModuleGetFunction(byref(function), module, symbol.encode()), "cuModuleGetFunction", label)
        if shared > 48 * 1024:  # as Triton's loader does: above 48 KB a kernel must opt in to dynamic shared memory
            optin, static = ctypes.c_int(), ctypes.c_int()
            self.check(lib.cuDeviceGetAttribute(byref(optin), 97, device), "cuDeviceGetAttribute")  # SHARED_OPTIN
            self.check(lib.cuFuncGetAttribute(byref(static), 1, function), "cuFuncGetAttribute")  # SHARED_SIZE
            limit = optin.value - static.value
            if shared > limit:
                raise CudaError(f"{label} needs {shared} bytes of shared memory per block; device {index} allows "
                                f"{limit}: use a spec with fewer stages or smaller blocks")
            self.check(lib.cuFuncSetCacheConfig(function, 1), "cuFuncSetCacheConfig", label)  # PREFER_SHARED
            self.check(lib.cuFuncSetAttribute(function, 8, limit), "cuFuncSetAttribute", label)  # MAX_DYNAMIC_SHARED
        return context, function

    def launch(self, kernel, grid, threads, shared, stream, args, label="fagen"):
        """Queue `kernel` (from load) with grid (x, y, z), `threads` per block, `shared` bytes of dynamic shared
        memory and `args` (ctypes values) on `stream` (a CUstream as an int; 0 is the legacy default stream)."""
        context, function = kernel
        self.check(self.lib.cuCtxSetCurrent(context), "cuCtxSetCurrent", label)
        pointers = (ctypes.c_void_p * len(args))(*(ctypes.addressof(a) for a in args))
        self.check(self.lib.cuLaunchKernel(function, *grid, threads, 1, 1, shared, ctypes.c_void_p(stream or None),
                                           pointers, None), "cuLaunchKernel", label)


_CUDA_DRIVER = []  # the one CudaDriver of this process, made on first use
_CUDA_DRIVER_LOCK = threading.Lock()


def cuda_driver():
    """The process's CudaDriver (libcuda loaded and initialised once)."""
    with _CUDA_DRIVER_LOCK:
        if not _CUDA_DRIVER:
            _CUDA_DRIVER.append(CudaDriver())
    return _CUDA_DRIVER[0]
