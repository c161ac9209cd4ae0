"""Fast launches of @gluon.jit kernels with host TMA descriptors, shared by the Gluon templates.

Static code: the render includes everything below the marker line verbatim (`verbatim` in
fagen/codegen/render.py), after host/launch.py, whose _FAST_LAUNCH, _KERNELS, _INT_CLASS, _Tensor, _entry and
_launch_entry it uses, and the including module's _GL_DTYPE (torch dtype -> gl dtype of its descriptors). The lines
above the marker define those names for linters and readers.
"""
import triton
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from fagen.templates.host.launch import _FAST_LAUNCH, _INT_CLASS, _KERNELS, _Tensor, _entry, _launch_entry

_GL_DTYPE = {}
# -- fagen: included verbatim below this line --


# [Note] Gluon fast launches
# A Gluon kernel takes its TMA descriptors from the host. fn[grid](...) with four TensorDescriptors costs, per
# call: four NVMMASharedLayout.get_default_for (a constexpr_function each), four TensorDescriptor dataclasses and
# their checks, the JIT's binding and specialisation of every argument (a descriptor's key is a string of its
# dtype, box and layout), and in triton's launcher wrapper one cuTensorMapEncodeTiled per descriptor: 200-219 us
# a call of the bf16 module on the H100 before this (benchmarks/latency.md). Here a launch names a descriptor as
# a request (tensor, box): a tuple argument, the box a tuple of ints, the layout
# NVMMASharedLayout.get_default_for(box, the tensor's dtype). The first call of a specialisation builds real
# TensorDescriptors (layouts cached per box and dtype) and goes through fn[grid]; its compiled kernel is kept
# under launch.py's key ([Note] Fast launches), a request counting as its dtype and box (all that Triton
# specialises a descriptor on). Later calls go to the launcher's C entry point with each request expanded as
# triton's wrapper does (wrap_handle_tensordesc): (CUtensorMap, *shape, *strides), the map from triton's own
# fill_tma_descriptor with the compiled kernel's tensordesc_meta (swizzle, element type, block), kept per
# (address, shape, strides): a CUtensorMap is only those values, encoded, and goes to the kernel by value (a
# __grid_constant__ parameter), so a kept one is exactly the one a fresh encode gives, and a CUDA graph captures
# its bytes like any argument. Other tensors go as their addresses (as launch.py's steps pass them). Requests
# must be TMA-ready (the module checks: 16-byte aligned base and strides, unit last stride, no empty dimension):
# the fast path skips TensorDescriptor's own assertions. Off under the interpreter, on a triton other than 3.6.0
# (launch.py's _FAST_LAUNCH; the plain path then builds the descriptors and calls fn[grid], as before), with
# $FAGEN_FAST_LAUNCH=0, or with _GLUON_FAST = False (scripts/gpu_gluon_host.py times both paths). Use: include
# host/launch.py and this file verbatim, pass each descriptor as (tensor, box) and launch with
# _gluon(kernel)[grid](*args, **constexprs).
_GLUON_FAST = True
_LAYOUTS = {}  # (box, torch dtype) -> NVMMASharedLayout
_TMA_MAPS = 4096  # kept CUtensorMaps per descriptor argument of a compiled kernel, then cleared


def _tensor_descriptor(t, box):
    """The TensorDescriptor of a request: t's shape and strides, block `box`, the default NVMMA layout for t's dtype
    (the including module's _GL_DTYPE maps torch dtypes to gl ones)."""
    layout = _LAYOUTS.get((box, t.dtype))
    if layout is None:
        layout = _LAYOUTS[(box, t.dtype)] = gl.NVMMASharedLayout.get_default_for(list(box), _GL_DTYPE[t.dtype])
    return TensorDescriptor(t, list(t.shape), list(t.stride()), list(box), layout)


def _plain_args(args):
    """args with each descriptor request made a TensorDescriptor (the form fn[grid] takes)."""
    return [_tensor_descriptor(a[0], a[1]) if type(a) is tuple else a for a in args]


def _gluon_entry(kernel, fn, args, consts):
    """(launch entry, per-argument plans) of a compiled Gluon kernel; None where its launcher is not triton 3.6's
    (then every call goes through fn[grid]). A plan: None for an ordinary argument, else (fill, swizzle, element
    size, element type, block, kept maps) of a descriptor, or False for one the kernel takes as pointer, shape and
    strides (no tensordesc_meta)."""
    try:
        entry = _entry(kernel, fn, len(args), consts)
        if entry is None or entry[1] is None:
            return None
        launch = entry[0]
        if getattr(launch, "__closure__", None):  # wrap_handle_tensordesc's inner(*args) around the C entry point
            launch = dict(zip(launch.__code__.co_freevars, launch.__closure__))["launcher"].cell_contents
        from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST
        fill = triton.runtime.driver.active.utils.fill_tma_descriptor
        metas = iter(getattr(kernel.metadata, "tensordesc_meta", None) or [None] * len(args))
        plans = []
        for a in args:
            if type(a) is not tuple:
                plans.append(None)
                continue
            meta = next(metas)
            if meta is not None and meta["fp4_padded"]:
                return None
            plans.append(False if meta is None else (fill, meta["swizzle"], meta["elem_size"],
                                                     TMA_DTYPE_DEVICE_TO_HOST[meta["elem_type"]],
                                                     list(meta["block_size"]), {}))
        return (launch, *entry[1:]), tuple(plans)
    except (AttributeError, KeyError, TypeError, ImportError, StopIteration, RuntimeError):
        return None


def _expand(args, plans):
    """The launcher's flat argument list: each request as triton's wrapper expands a TensorDescriptor (its map,
    shape and strides kept together per (address, shape, strides)), a tensor as its address (as the Triton steps
    pass them: the launcher then skips its pointer query)."""
    flat = []
    for a, plan in zip(args, plans):
        if plan is None:
            flat.append(a.data_ptr() if type(a) is _Tensor else a)
            continue
        t = a[0]
        shape, strides = t.shape, t.stride()
        if plan is False:
            flat += (t, *shape, *strides, False, *shape, *strides)
            continue
        maps, key = plan[5], (t.data_ptr(), shape, strides)
        part = maps.get(key)
        if part is None:
            if len(maps) >= _TMA_MAPS:
                maps.clear()
            part = maps[key] = (plan[0](key[0], plan[1], plan[2], plan[3], plan[4], shape, strides, 0), *shape,
                                *strides)
        flat += part
    return flat


def _gluon_run(fn, grid, args, consts):
    """fn[grid](*args, **consts) for a @gluon.jit kernel whose descriptor arguments are requests (tensor, box)
    ([Note] Gluon fast launches). Returns the kept entry of this specialisation, or None."""
    if not (_FAST_LAUNCH and _GLUON_FAST):
        fn[grid](*_plain_args(args), **consts)
        return None
    first = args[0][0] if type(args[0]) is tuple else args[0]
    device = first.get_device()
    key = (fn, device, tuple(consts.items()),
           *[(a[0].dtype, a[1]) if type(a) is tuple else _INT_CLASS[a] if type(a) is int
             else (a.data_ptr() & 15) == 0 if type(a) is _Tensor else 0.5 if type(a) is float else a for a in args])
    entry = _KERNELS.get(key, _KERNELS)
    if entry is None or entry is _KERNELS:
        kernel = fn[grid](*_plain_args(args), **consts)
        if entry is _KERNELS:
            entry = _KERNELS[key] = _gluon_entry(kernel, fn, args, consts)
        return entry
    _launch_entry(entry[0], grid if len(grid) == 3 else (*grid, 1, 1), device, _expand(args, entry[1]))
    return entry


class _GluonLaunch:
    """_gluon(fn)[grid](*args, **consts): the call syntax of fn[grid](...), through _gluon_run."""

    __slots__ = ("fn", )

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        fn = self.fn
        return lambda *args, **consts: _gluon_run(fn, grid, args, consts)


def _gluon(fn):
    """A fast launcher for a @gluon.jit kernel ([Note] Gluon fast launches)."""
    return _GluonLaunch(fn)
