"""fagen/runtime/driver.py without a GPU: the nvcc command line, and CudaDriver's calls against a fake libcuda."""

import ctypes

import pytest

from fagen.runtime import driver

OPTIN = 227 * 1024  # the H100's MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
STATIC = 1024  # the fake kernel's static shared memory


class FakeLibcuda:
    """Records the driver calls; fills the out-parameters the way libcuda does; `fail` names a call to fail."""

    def __init__(self, fail=None):
        self.calls, self.current, self.fail = [], None, fail

    def __getattr__(self, name):
        if not name.startswith("cu"):
            raise AttributeError(name)
        fn = getattr(type(self), "_" + name, None)

        def call(*args):
            self.calls.append((name, args))
            if name == self.fail:
                return 1  # CUDA_ERROR_INVALID_VALUE
            return fn(self, *args) if fn else 0

        self.__dict__[name] = call
        return call

    @staticmethod
    def _out(ref, value):
        ref._obj.value = value

    def _cuGetErrorName(self, rc, ref):
        self._out(ref, b"CUDA_ERROR_INVALID_VALUE")
        return 0

    def _cuGetErrorString(self, rc, ref):
        self._out(ref, b"invalid argument")
        return 0

    def _cuDeviceGet(self, ref, index):
        self._out(ref, 100 + index)
        return 0

    def _cuDevicePrimaryCtxRetain(self, ref, device):
        self._out(ref, 0x1000 + device.value)
        return 0

    def _cuCtxSetCurrent(self, context):
        self.current = context.value
        return 0

    def _cuModuleLoadData(self, ref, image):
        self._out(ref, 0x2000)
        return 0

    def _cuModuleGetFunction(self, ref, module, symbol):
        self._out(ref, 0x3000)
        return 0

    def _cuDeviceGetAttribute(self, ref, attribute, device):
        self._out(ref, OPTIN if attribute == 97 else 0)
        return 0

    def _cuFuncGetAttribute(self, ref, attribute, function):
        self._out(ref, STATIC if attribute == 1 else 0)
        return 0

    def _cuLaunchKernel(self, function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        self.launched = dict(grid=(gx, gy, gz), block=(bx, by, bz), shared=shared, stream=stream.value,
                             context=self.current)
        return 0


@pytest.fixture
def fake(monkeypatch):
    lib = FakeLibcuda()
    monkeypatch.setattr(driver.ctypes, "CDLL", lambda name: lib)
    return lib


def names(lib):
    return [name for name, _ in lib.calls]


def test_nvcc_command_is_one_line_for_every_compile():
    cmd = driver.nvcc_command("/cuda/bin/nvcc", "sm_90", "k.cu", "k.cubin", ("--keep",))
    assert cmd == ["/cuda/bin/nvcc", "-cubin", "-arch=sm_90", "-O3", "-std=c++17", "-Xptxas", "-v", "--keep",
                   "-o", "k.cubin", "k.cu"]
    assert "-use_fast_math" not in cmd  # exp2f/log2f keep their documented accuracy


def test_find_nvcc_looks_on_path_then_in_cuda_home(tmp_path, monkeypatch):
    nvcc = tmp_path / "bin" / "nvcc"
    nvcc.parent.mkdir()
    nvcc.write_text("")
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    assert driver.find_nvcc() == str(nvcc)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "none"))
    monkeypatch.delenv("CUDA_PATH", raising=False)
    assert driver.find_nvcc() in (None, "/usr/local/cuda/bin/nvcc")


def test_load_opts_in_above_48k_and_launch_runs_in_the_primary_context(fake):
    cuda = driver.CudaDriver()
    kernel = cuda.load(b"\x7fELF", "k", 1, 100_000, "attn_x")
    assert fake.current == kernel[0].value == 0x1000 + 101  # device 1's primary context, made current
    assert names(fake) == ["cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuCtxSetCurrent", "cuModuleLoadData",
                           "cuModuleGetFunction", "cuDeviceGetAttribute", "cuFuncGetAttribute",
                           "cuFuncSetCacheConfig", "cuFuncSetAttribute"]
    assert fake.calls[-1][1][1:] == (8, OPTIN - STATIC)  # MAX_DYNAMIC_SHARED_SIZE_BYTES: what is left after static
    fake.current = None  # another thread, with no context current
    args = [ctypes.c_void_p(0x7000), ctypes.c_int(5), ctypes.c_float(0.5)]
    cuda.launch(kernel, (3, 2, 1), 128, 100_000, 77, args)
    assert fake.launched == dict(grid=(3, 2, 1), block=(128, 1, 1), shared=100_000, stream=77, context=0x1000 + 101)
    params = fake.calls[-1][1][9]
    assert [params[i] for i in range(3)] == [ctypes.addressof(a) for a in args]
    cuda.load(b"\x7fELF", "small", 1, 48 * 1024, "attn_y")
    assert "cuDevicePrimaryCtxRetain" not in names(fake)[-5:]  # one retain per device
    assert names(fake)[-1] == "cuModuleGetFunction"  # no opt-in up to 48 KB


def test_too_much_shared_memory_and_failed_calls_are_one_clear_line(fake):
    cuda = driver.CudaDriver()
    with pytest.raises(driver.CudaError, match=f"attn_x needs 300000 bytes .* device 0 allows {OPTIN - STATIC}: "
                                               "use a spec with fewer stages"):
        cuda.load(b"\x7fELF", "k", 0, 300_000, "attn_x")
    fake.fail = "cuModuleLoadData"
    with pytest.raises(driver.CudaError, match="^cuModuleLoadData failed for attn_x: CUDA_ERROR_INVALID_VALUE: "
                                               "invalid argument$"):
        cuda.load(b"\x7fELF", "k", 0, 1024, "attn_x")


def test_no_libcuda_is_one_clear_error(monkeypatch):
    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(driver.ctypes, "CDLL", missing)
    with pytest.raises(driver.CudaError, match="cannot load the CUDA driver libcuda.so.1"):
        driver.CudaDriver()
