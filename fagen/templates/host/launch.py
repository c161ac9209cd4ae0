"""Fast launches of @triton.jit kernels, shared by the Triton templates.

Static code: the render includes everything below the marker line verbatim (`verbatim` in
fagen/codegen/render.py). The code there uses the including module's os, torch, triton and _INTERPRET; the lines
above the marker define them only for linters and readers.
"""
import os

import torch
import triton

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# -- fagen: included verbatim below this line --


# [Note] Fast launches
# fn[grid](...) re-binds and re-specialises every argument and recomputes the kernel's cache key on each call:
# about half of a small call's host time (benchmarks/latency.md). _run keeps the compiled kernel of each
# specialisation under a key of exactly what Triton specialises on and calls the launcher's C entry point directly
# (past triton's Python wrapper, with the scratch of [Note] Launch scratch; through the wrapper only for kernels
# with a profiling buffer). The key: the device;
# for each tensor its 16-byte alignment (its dtype per position is fixed by the module's checks: q, k, v, out in
# DTYPE, lengths int32, lse float32); for each int whether it == 1, is a multiple of 16 and fits int32 (a class
# looked up in _INT_CLASS, not computed per call); floats are never specialised; None and bools are their own key.
# The first call of a specialisation (and the interpreter, and Triton releases whose launcher this was not checked
# on) go through fn[grid]. Triton's launch hooks (knobs.runtime.launch_enter_hook) are not called on fast launches.
_FAST_LAUNCH = not _INTERPRET and triton.__version__.split("+")[0] in ("3.6.0",) \
    and os.environ.get("FAGEN_FAST_LAUNCH", "1") != "0"
_KERNELS = {}
_Tensor = torch.Tensor


def _cdiv(a, b):
    """triton.cdiv for host ints: triton's is a constexpr_function, ~1-3 us a call from host code."""
    return -(-a // b)


def _pow2(n):
    """triton.next_power_of_2 for host ints >= 0 (1 for 0), without the constexpr_function wrapper."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


class _IntClass(dict):
    """int -> its Triton specialisation class: bit 0 multiple of 16, bit 1 == 1, bit 2 fits int32."""

    def __missing__(self, a):
        if len(self) > 65536:  # distinct ints seen (strides, lengths): bounded
            self.clear()
        cls = self[a] = ((a & 15) == 0) | (a == 1) << 1 | (-2147483648 <= a <= 2147483647) << 2
        return cls


_INT_CLASS = _IntClass()


try:  # the raw current stream, as Triton's own launch path reads it (falls back to the public API)
    from torch._C import _cuda_getCurrentRawStream as _raw_stream
except ImportError:
    def _raw_stream(device):
        return torch.cuda.current_stream(device).cuda_stream


def _entry(kernel, fn, n_args, consts):
    """(launch, flags, function, packed metadata, constexpr tail, scratch bytes per program) of a compiled kernel
    for _run; None when the kernel does not look like triton 3.6's CompiledKernel (then every call goes through
    fn[grid]). flags None: launch is triton's Python wrapper (a kernel with a profiling scratch buffer)."""
    try:
        launcher = kernel.run  # loads the module on the current device the first time
        tail = tuple(consts[name] for name in fn.arg_names[n_args:])
        if launcher.profile_scratch_size:
            return launcher, None, kernel.function, kernel.packed_metadata, tail, 0
        return (launcher.launch, (launcher.launch_cooperative_grid, launcher.launch_pdl), kernel.function,
                kernel.packed_metadata, tail, launcher.global_scratch_size * launcher.num_ctas)
    except (AttributeError, KeyError, TypeError):
        return None


# [Note] Launch scratch
# Kernels that build TMA descriptors on the device (tl.make_tensor_descriptor) need a global scratch buffer of a
# few hundred bytes per program. Triton's wrapper asks its allocator for a fresh one at every launch (a
# torch.empty, ~4 us); _scratch keeps one per (device, stream) and grows it when a grid needs more. Kernels on one
# stream run in order and each writes its descriptors before reading them, so consecutive launches may share
# the bytes; another stream gets its own. While a CUDA graph is being captured the buffer is fresh from the
# caching allocator (the graph's pool owns it), so no graph holds the address of a buffer that may be replaced.
_SCRATCH = {}


def _scratch(nbytes, device, stream):
    """A uint8 device tensor of at least nbytes for one launch on (device, stream) (device -1: the CPU, for fakes)."""
    capturing = torch.cuda.is_current_stream_capturing()
    buf = None if capturing else _SCRATCH.get((device, stream))
    if buf is None or buf.numel() < nbytes:
        where = torch.device("cuda", device) if device >= 0 else torch.device("cpu")
        buf = torch.empty(nbytes if capturing else max(nbytes, 1 << 16), dtype=torch.uint8, device=where)
        if not capturing:
            _SCRATCH[(device, stream)] = buf
    return buf


def _direct_entry(entry):
    """True for a launch entry of _run that _launch_entry calls through the launcher's C entry point (not None, not
    triton's wrapper): what a step may keep."""
    return type(entry) is tuple and entry[1] is not None


def _launch_entry(entry, grid, device, args):
    """Launch a compiled kernel through its entry (see _entry) on the current stream of `device`."""
    launch, flags, function, metadata, tail, scratch = entry
    stream = _raw_stream(device)
    if flags is None:
        launch(grid[0], grid[1], grid[2], stream, function, metadata, None, None, None, *args, *tail)
    elif scratch:
        buf = _scratch(scratch * grid[0] * grid[1] * grid[2], device, stream)
        launch(grid[0], grid[1], grid[2], stream, function, flags[0], flags[1], buf.data_ptr(), None, metadata,
               None, None, None, *args, *tail)
    else:
        launch(grid[0], grid[1], grid[2], stream, function, flags[0], flags[1], None, None, metadata,
               None, None, None, *args, *tail)


def _new_out(t):
    """An empty contiguous tensor like t (empty_like: about half the host time of torch.empty(shape, dtype=, device=),
    which parses a shape and a device)."""
    return torch.empty_like(t, memory_format=torch.contiguous_format)


_LSE_LIKE = {}


def _new_lse(q):
    """An empty contiguous float32 [B, Hq, Sq] on q's device. empty_like of a kept 4-byte tensor expanded to that
    shape: about half the host time of q.new_empty(shape, dtype=torch.float32), which parses a shape and a dtype."""
    key = (q.shape, q.get_device())
    like = _LSE_LIKE.get(key)
    if like is None:
        if len(_LSE_LIKE) >= 1024:
            _LSE_LIKE.clear()
        like = _LSE_LIKE[key] = q.new_empty(1, dtype=torch.float32).expand(q.shape[:3])
    return torch.empty_like(like, memory_format=torch.contiguous_format)


def _run(fn, grid, args, consts):
    """fn[grid](*args, **consts), through the compiled kernel's launcher once this specialisation was compiled.
    Returns the launch entry of this specialisation (see _entry), or None where launches go through fn[grid]."""
    if not _FAST_LAUNCH:
        fn[grid](*args, **consts)
        return None
    device = args[0].get_device()
    key = (fn, device, tuple(consts.items()),
           *[_INT_CLASS[a] if type(a) is int else (a.data_ptr() & 15) == 0 if type(a) is _Tensor
             else 0.5 if type(a) is float else a for a in args])
    entry = _KERNELS.get(key, _KERNELS)
    if entry is None or entry is _KERNELS:
        kernel = fn[grid](*args, **consts)
        if entry is _KERNELS:
            entry = _KERNELS[key] = _entry(kernel, fn, len(args), consts)
        return entry
    _launch_entry(entry, grid if len(grid) == 3 else (*grid, 1, 1), device, args)
    return entry


class _Fast:
    """_fast(fn)[grid](*args, **consts): the call syntax of fn[grid](...), through _run."""

    __slots__ = ("fn", "grid")

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        self.grid = grid
        return self

    def __call__(self, *args, **consts):
        return _run(self.fn, self.grid, args, consts)


def _fast(fn):
    """A fast launcher for a triton.jit kernel; anything else (a prebuilt launcher) is returned as it is."""
    return _Fast(fn) if isinstance(fn, triton.runtime.JITFunction) else fn
