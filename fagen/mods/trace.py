"""Tracing: call a user's score_mod / mask_mod on symbolic proxies and record the expression tree it computes.

The proxies overload Python's operators and catch `torch.where`, `torch.exp`, ... through `__torch_function__`,
as FlexAttention's FX tracing does. torch is imported only when a function is traced.

[Note] What a number in a mod becomes.
  - A literal in the function's code (`8.0`, `1`, `float("inf")`) is a constant: it is part of the text and of
    the kernel's source, as the code itself is.
  - A Python int or float the function reads from outside its code is a runtime scalar: a closure cell (the
    numbers attention-gym's factories close over), a default argument, or a module global read by name. Before
    the call, each such function is rebuilt (types.FunctionType over the same code) with those values replaced by
    proxies, recursively through the functions, tuples and lists it closes over (so `and_masks(f, g)` traces f
    and g with their own numbers). A scalar is named after its variable (`window_size`, `window_size_1` for a
    second one) and enters the tree only if used, so a changed number changes neither the text nor the kernel.
  - A bool read from outside stays a Python bool: it may steer the function (`if causal:`), and a changed bool
    is a different tree, so a different kernel.
  - A runtime scalar cannot steer Python control flow (`if`, `and`, `or`, `min()`, `range()`, `int()`): that is a
    SpecError naming the line. Numbers reached only through other objects (attributes, dicts, bound methods)
    are read while tracing and become constants.
"""

from __future__ import annotations

import dataclasses
import linecache
import os
import sys
import types
from typing import Any

from fagen.mods import ir
from fagen.mods.proxy import TORCH_DIR, Proxy, ScalarProxy, TensorProxy, init_torch, node_of, tensor_dtype
from fagen.mods.text import ModScalar, ModTensor, parse, to_text
from fagen.errors import SpecError

_HERE = os.path.dirname(os.path.abspath(__file__))
def _is_user_file(filename: str) -> bool:
    path = os.path.abspath(filename)
    return not path.startswith(_HERE + os.sep) and not (TORCH_DIR[0] and path.startswith(TORCH_DIR[0] + os.sep))


def _site(frames) -> str:
    """`line N of FILE, in FUNC: SOURCE` for the innermost user frame of `frames` (innermost first)."""
    for filename, lineno, func in frames:
        if _is_user_file(filename):
            src = linecache.getline(filename, lineno).strip()
            return f"line {lineno} of {os.path.basename(filename)}, in {func}" + (f": {src}" if src else "")
    return "in the traced function"


def _stack_site() -> str:
    f, frames = sys._getframe(1), []
    while f is not None:
        frames.append((f.f_code.co_filename, f.f_lineno, f.f_code.co_name))
        f = f.f_back
    return _site(frames)


def _tb_site(tb) -> str:
    frames = []
    while tb is not None:
        frames.append((tb.tb_frame.f_code.co_filename, tb.tb_lineno, tb.tb_frame.f_code.co_name))
        tb = tb.tb_next
    return _site(reversed(frames))


@dataclasses.dataclass
class Traced:
    """A traced pair of mods: the trees, their declarations and the captured values for this call.

    `paths` says where each captured value lives in the user's functions (("score_mod", ("cell", 0), ...)), so the
    runtime's trace-cache guards (fagen/runtime/mods.py) re-read changed numbers instead of tracing again."""
    score_mod: ir.Node | None
    mask_mod: ir.Node | None
    tensors: tuple[ModTensor, ...]
    scalars: tuple[ModScalar, ...]
    values: dict[str, Any]  # name -> the captured tensor or number
    paths: dict[str, tuple]

    @property
    def score_text(self) -> str | None:
        return None if self.score_mod is None else to_text(self.score_mod)

    @property
    def mask_text(self) -> str | None:
        return None if self.mask_mod is None else to_text(self.mask_mod)

    def spec_fields(self) -> dict[str, Any]:
        """The KernelSpec fields these mods set (empty fields left out, as the spec's canonical JSON does)."""
        out = {"score_mod": self.score_text, "mask_mod": self.mask_text,
               "mod_tensors": [list(t) for t in self.tensors], "mod_scalars": [list(s) for s in self.scalars]}
        return {k: v for k, v in out.items() if v}


def trace_score_mod(fn) -> Traced:
    """Trace score_mod(score, b, h, q_idx, kv_idx) -> score."""
    return trace(score_mod=fn)


def trace_mask_mod(fn) -> Traced:
    """Trace mask_mod(b, h, q_idx, kv_idx) -> bool."""
    return trace(mask_mod=fn)


def trace(score_mod=None, mask_mod=None) -> Traced:
    """Trace either or both mods with one namespace of captured names (a tensor both use is one argument)."""
    init_torch()
    tracer = _Tracer()
    trees = [tracer.run(field, fn) if fn is not None else None
             for field, fn in (("score_mod", score_mod), ("mask_mod", mask_mod))]
    tensors = tuple(sorted(tracer.tensor_decls.values()))
    scalars = tuple(sorted(tracer.scalar_decls.values()))
    for tree, field in zip(trees, ("score_mod", "mask_mod")):
        if tree is not None and parse(to_text(tree), field, tensors, scalars) != tree:  # pragma: no cover
            raise AssertionError(f"{field}: the text {to_text(tree)!r} does not parse back to its tree")
    return Traced(trees[0], trees[1], tensors, scalars, tracer.values, tracer.paths)


def _num_type(v) -> str:
    return ir.INT if isinstance(v, int) else ir.FLOAT


def _global_names(code: types.CodeType) -> set[str]:
    names, stack = set(), [code]
    while stack:
        c = stack.pop()
        names.update(c.co_names)
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    return names


class _Tracer:
    def __init__(self):
        self.field = ""
        self.taken = set(ir.RESERVED)
        self.tensor_decls: dict[str, ModTensor] = {}
        self.scalar_decls: dict[str, ModScalar] = {}
        self.values: dict[str, Any] = {}
        self.paths: dict[str, tuple] = {}
        self.memo: dict = {}  # id of a function / cell / (globals, name) / tensor -> its replacement
        self.keep: list = []  # keeps memo keys' objects alive while tracing, so ids stay unique

    def fail(self, op: str, why: str, site: str | None = None):
        raise SpecError(self.field, f"{op} at {site or _stack_site()}", why)

    def unique(self, base: str) -> str:
        base = base if ir.NAME_RE.match(base) and base not in ir.RESERVED else "c" + "".join(
            ch if ch.isalnum() else "_" for ch in base)[:24]
        name, n = base, 0
        while name in self.taken:
            n += 1
            name = f"{base}_{n}"
        self.taken.add(name)
        return name

    def run(self, field: str, fn) -> ir.Node:
        self.field = field
        if not callable(fn):
            raise SpecError(field, type(fn).__name__, "must be a function")
        bound = self.capture(fn, fn.__name__ if hasattr(fn, "__name__") else field, (field,), 0)
        idx = [Proxy(ir.Input(n, ir.INT), self) for n in ir.INDEX_INPUTS]
        args = ([Proxy(ir.Input("score", ir.FLOAT), self)] if field == "score_mod" else []) + idx
        try:
            out = bound(*args)
        except SpecError:
            raise
        except Exception as e:  # anything the function did that the proxies could not follow
            self.fail(type(e).__name__, f"{e}; a mod may use only the whitelisted operations (docs/mods.md)",
                      _tb_site(e.__traceback__))
        node = node_of(out, self, "the returned value")
        want = ir.FLOAT if field == "score_mod" else ir.BOOL
        if node.type != want:
            self.fail("return", "a score_mod returns a float score" if want == ir.FLOAT else
                      "a mask_mod returns a bool (True: visible)", f"the result of {getattr(fn, '__name__', fn)}")
        try:
            ir.check_size(node)
        except ir.TypeRuleError as e:
            self.fail("expression", str(e), f"the result of {getattr(fn, '__name__', fn)}")
        return node

    # -- captured values -------------------------------------------------------------------------------------------
    def capture(self, value, name: str, path: tuple, depth: int):
        """The stand-in for a value the function reads from outside its code (see the module's [Note])."""
        import torch

        if isinstance(value, bool) or value is None:
            return value
        if isinstance(value, (int, float)):
            return ScalarProxy(self, name, value, path)
        if isinstance(value, torch.Tensor):
            key = ("tensor", id(value))
            if key not in self.memo:
                self.keep.append(value)
                self.memo[key] = TensorProxy(self, name, value, path)
            return self.memo[key]
        if isinstance(value, types.FunctionType) and depth < 16:
            return self.rebind(value, path, depth + 1)
        if isinstance(value, (tuple, list)) and len(value) <= 64 and depth < 16:
            items = [self.capture(v, f"{name}_{i}", path + (("item", i),), depth + 1) for i, v in enumerate(value)]
            return value if all(a is b for a, b in zip(items, value)) else type(value)(items)
        return value

    def rebind(self, fn: types.FunctionType, path: tuple, depth: int) -> types.FunctionType:
        """fn over the same code, with its closure cells, defaults and read globals replaced by stand-ins."""
        if ("fn", id(fn)) in self.memo:
            return self.memo["fn", id(fn)]
        self.keep.append(fn)
        self.memo["fn", id(fn)] = fn  # a function that reaches itself (recursion) sees the original
        code = fn.__code__
        g = fn.__globals__
        overrides = {}
        for name in sorted(_global_names(code)):
            if name in g and not isinstance(g[name], types.ModuleType):
                key = ("global", id(g), name)
                if key not in self.memo:
                    self.memo[key] = self.capture(g[name], name, path + (("global", name),), depth)
                if self.memo[key] is not g[name]:
                    overrides[name] = self.memo[key]
        cells = None
        if fn.__closure__:
            cells = []
            for i, (name, cell) in enumerate(zip(code.co_freevars, fn.__closure__)):
                key = ("cell", id(cell))
                if key not in self.memo:
                    self.keep.append(cell)
                    try:
                        content = cell.cell_contents
                    except ValueError:  # an empty cell (a variable not yet assigned)
                        self.memo[key] = cell
                    else:
                        new = self.capture(content, name, path + (("cell", i),), depth)
                        self.memo[key] = cell if new is content else types.CellType(new)
                cells.append(self.memo[key])
            cells = tuple(cells)
        defaults = fn.__defaults__
        if defaults:
            first = code.co_argcount - len(defaults)
            defaults = tuple(self.capture(d, code.co_varnames[first + i], path + (("default", i),), depth)
                             for i, d in enumerate(defaults))
        new = types.FunctionType(code, {**g, **overrides} if overrides else g, fn.__name__, defaults, cells)
        if fn.__kwdefaults__:
            new.__kwdefaults__ = {k: self.capture(v, k, path + (("kwdefault", k),), depth)
                                  for k, v in fn.__kwdefaults__.items()}
        self.memo["fn", id(fn)] = new
        return new

    def declare_scalar(self, base: str, value, path: tuple) -> ir.Scalar:
        name = self.unique(base)
        kind = _num_type(value)
        self.scalar_decls[name] = ModScalar(name, kind)
        self.values[name], self.paths[name] = value, path
        return ir.Scalar(name, kind)

    def declare_tensor(self, base: str, tensor, path: tuple) -> ModTensor:
        dtype = tensor_dtype(tensor)
        if dtype is None:
            self.fail(f"tensor {base}", f"has dtype {tensor.dtype}; captured tensors are "
                      + ", ".join(ir.TENSOR_DTYPES))
        if tensor.dim() > ir.MAX_RANK or 0 in tensor.shape:
            self.fail(f"tensor {base}", f"has shape {tuple(tensor.shape)}; captured tensors have rank 0 to "
                      f"{ir.MAX_RANK} and no empty dimension")
        name = self.unique(base)
        decl = ModTensor(name, dtype, tensor.dim())
        self.tensor_decls[name] = decl
        self.values[name], self.paths[name] = tensor, path
        return decl
