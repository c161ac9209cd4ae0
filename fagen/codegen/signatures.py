"""Render the argument lists of fagen/codegen/args.py into code: the Jinja helpers of the strict environment.

Each helper takes the spec from the template's context and returns text; the templates call them where a
signature, a launch, an operator schema or an AOT entry goes ([Note] Argument lists in args.py).
"""

from __future__ import annotations

import re

import jinja2

from fagen.codegen.args import CONSTEXPR, FLOAT, INT, IO, KERNELS, LISTS, TENSOR, Arg, Kernel, Keyword, expand
from fagen.spec.kernel import KernelSpec

WIDTH = 120  # the house's line length: launches and AOT entries wrap there
_SCHEMA = {INT: "int", FLOAT: "float"}
_WINDOW_INTS = ("win_left", "win_right")  # the window switch's extents: never specialised (mod_jit)
_STRIDE = re.compile(r"mt\d+_s\d+")  # a captured tensor's stride argument ([Note] Mod argument names)
_C_TYPE = {IO: "T", "fp32": "float", "i32": "int"}


def _wrap(items: list[str], indent: int, first: int | None = None, end: str = ",") -> str:
    """items joined by ", ", filled greedily to WIDTH; every line but the last ends with ",", the last with `end`.
    `first`: the column the first line starts at (default: indent)."""
    lines, line, col = [], "", indent if first is None else first
    for item in items:
        piece = (", " if line else "") + item
        if line and col + len(line) + len(piece) + 1 > WIDTH:
            lines.append(line + ",")
            line, col = item, indent
        else:
            line += piece
    lines.append(line + end)
    return ("\n" + " " * indent).join(lines)


def _joined(args: list, text, indent: int, breaks: tuple[str, ...] = ()) -> str:
    """text(arg) of each arg joined by ", ", with a line break (to column `indent`) before each arg with `br` set or
    named in `breaks`."""
    out = ""
    for i, a in enumerate(args):
        if i:
            out += ",\n" + " " * indent if getattr(a, "br", False) or a.name in breaks else ", "
        out += text(a)
    return out


def _host(a: Arg, spec: KernelSpec, fast: bool = False) -> str:
    if fast and a.fast:
        return a.fast
    return a.host(spec) if callable(a.host) else a.host


def _positional(kernel: Kernel, spec: KernelSpec, fast: bool = False) -> list[str]:
    """The launch's positional expressions: each arg's host expression, a pack's star once."""
    items, pack = [], None
    for a in kernel.of(spec):
        if a.kind == CONSTEXPR:
            continue
        if a.pack:
            if a.pack != pack:
                items.append("*" + kernel.packs.get(a.pack, a.pack))
        elif _host(a, spec, fast):
            items.append(_host(a, spec, fast))
        pack = a.pack or None
    return items


def _pointer(a: Arg, spec: KernelSpec) -> str:
    return "*" + (str(spec.dtype) if a.dtype == IO else a.dtype)


class Helpers:
    """The helpers of one spec, as the templates call them."""

    def __init__(self, spec: KernelSpec):
        self.spec = spec

    def _list(self, name: str) -> list:
        return expand(LISTS[name], self.spec)

    # -- kernels ------------------------------------------------------------------------------------------------
    def def_kernel(self, name: str) -> str:
        """`def name(params):` of a @triton.jit / @gluon.jit entry point, its constexprs annotated."""
        kernel = KERNELS[name]
        text = lambda a: a.name + (": " + kernel.constexpr_type if a.kind == CONSTEXPR else "")  # noqa: E731
        return f"def {name}(" + _joined(kernel.of(self.spec), text, len(f"def {name}(")) + "):"

    def launch(self, name: str, indent: int, fast: bool = False, end: str = ",") -> str:
        """The arguments of a launch of `name`, positional then constexpr keywords and launch options, on lines ending
        in ","; fast: the
        positional ones of a step's launch, with device addresses for tensors ([Note] Forward steps)."""
        kernel = KERNELS[name]
        text = _wrap(_positional(kernel, self.spec, fast), indent, end=end)
        consts = [f"{a.name}={_host(a, self.spec)}" for a in kernel.of(self.spec) if a.kind == CONSTEXPR]
        consts += [f"num_{k}={v}" for k, v in (("warps", kernel.warps), ("stages", kernel.stages)) if v]
        return text if fast or not consts else text + "\n" + " " * indent + _wrap(consts, indent, end=end)

    def pack(self, name: str, pack: str, indent: int) -> str:
        """The element expressions of one pack of `name`'s arguments (the tuple the launch stars)."""
        args = [a for a in KERNELS[name].of(self.spec) if a.pack == pack]
        return _wrap([h for a in args if (h := _host(a, self.spec))], indent, end="")

    def do_not_specialize(self, name: str) -> str:
        """The int arguments of `name`, quoted: one compiled kernel serves every length."""
        return ", ".join(f'"{a.name}"' for a in KERNELS[name].of(self.spec) if a.kind == INT)

    def mod_jit(self, name: str) -> str:
        """`@triton.jit` of kernel `name`; a modded spec's lists its mods' and block mask's ints in do_not_specialize
        ([Note] Runtime scalars in fagen/runtime/modded.py): a changed closure int never compiles a new kernel. The
        window switch's extents are listed too: Triton would otherwise compile a variant per value class (1, a
        multiple of 16, other), and a window is a runtime argument (README "Score switches"), which a lowered
        mod's closure number becomes (fagen/mods/lower.py)."""
        names = [a.name for a in KERNELS[name].of(self.spec) if a.name in _WINDOW_INTS and a.kind == INT]
        if not self.spec.modded:
            return "@triton.jit(do_not_specialize=[" + ", ".join(f'"{n}"' for n in names) + "])" if names \
                else "@triton.jit"
        from fagen.codegen.args import BLOCK_ARGS, MOD_ARGS

        names += [a.name for a in expand((MOD_ARGS, *BLOCK_ARGS), self.spec) if a.kind == INT]
        strides = [n for n in names if _STRIDE.fullmatch(n)]  # [Note] Captured strides in fagen/codegen/mod_args.py
        return ("@triton.jit(do_not_specialize=[" + ", ".join(f'"{n}"' for n in names if n not in strides) + "]"
                + (", do_not_specialize_on_alignment=[" + ", ".join(f'"{n}"' for n in strides) + "]" if strides else "")
                + ")")

    def aot_entry(self, name: str, indent: int) -> str:
        """The AOT_KERNELS entry of `name` ([Note] AOT kernels): each argument's Triton type, the constexpr values
        (a pointer this spec passes as None is a constexpr None), the arguments assumed multiples of 16."""
        kernel, spec, pad = KERNELS[name], self.spec, " " * indent
        signature, constexprs, divisible = [], [], []
        for a in kernel.of(spec):
            if a.kind == TENSOR and not a.real(spec):
                signature.append(f'"{a.name}": "constexpr"')
                constexprs.append(f'"{a.name}": None')
                continue
            kind = {TENSOR: _pointer(a, spec), INT: "i32", FLOAT: "fp32", CONSTEXPR: "constexpr"}[a.kind]
            signature.append(f'"{a.name}": "{kind}"')
            if a.kind == CONSTEXPR:
                constexprs.append(f'"{a.name}": {a.aot or _host(a, spec)}')
            if a.divisible is not None and a.divisible(spec):
                divisible.append(f'"{a.name}"')
        inner = indent + 4
        fields = [f'"name": "{name}"', f'"fn": {name}',
                  '"signature": {' + _wrap(signature, inner + 14, end="}"),
                  '"constexprs": {' + _wrap(constexprs, inner + 15, end="}"),
                  '"divisible": [' + _wrap(divisible, inner + 14, end="]"),
                  f'"num_warps": {kernel.warps}', f'"num_stages": {kernel.stages}']
        return pad + "{\n" + "".join(" " * inner + f + ",\n" for f in fields) + pad + "},"

    def c_params(self, name: str, indent: int = 4) -> str:
        """The C parameter list of a __global__ kernel, one group of related parameters a line."""
        def text(a: Arg) -> str:
            if a.kind == TENSOR:
                return ("" if a.written else "const ") + _C_TYPE[a.dtype] + "* __restrict__ " + a.name
            return {INT: "int64_t" if a.wide else "int", FLOAT: "float"}[a.kind] + " " + a.name
        return " " * indent + _joined(KERNELS[name].of(self.spec), text, indent)

    def c_launch(self, name: str, indent: int) -> str:
        """The ctypes values of a launch of `name`, in its C parameter order."""
        kernel, items, pack = KERNELS[name], [], None
        wrap = {TENSOR: "ptr({})", FLOAT: "ctypes.c_float({})"}
        for a in kernel.of(self.spec):
            if a.pack:
                if a.pack != pack:
                    items.append("*" + kernel.packs[a.pack])
            else:
                items.append(wrap.get(a.kind, "ctypes.c_int64({})" if a.wide else "ctypes.c_int({})")
                             .format(_host(a, self.spec)))
            pack = a.pack or None
        return _wrap(items, indent)

    # -- host functions -----------------------------------------------------------------------------------------
    def args(self, name: str, lead: bool = False, breaks: tuple[str, ...] = (), indent: int = 0,
             typed: bool = False, ctx: bool = False) -> str:
        """The names of list `name` ("op", "op_scores", a threaded list, ...) joined by ", "; lead: with a leading
        ", " (nothing when the list is empty); typed: with operator schema annotations; ctx: non-tensors read
        from the autograd ctx."""
        def text(a) -> str:
            if typed:
                kind = "torch.Tensor" if a.kind == TENSOR else _SCHEMA[a.kind]
                return f"{a.name}: " + (f"Optional[{kind}]" if a.optional else kind)
            return f"ctx.{a.name}" if ctx and a.kind != TENSOR else a.name
        out = _joined(self._list(name), text, indent, breaks)
        return (", " + out if out else "") if lead else out

    def keywords(self, name: str, trailing: bool = False) -> str:
        """The public keywords of list `name` with their defaults ("window=None, ..."); trailing: end in ", "."""
        words: list[Keyword] = self._list(name)
        out = ", ".join(k.name if k.default is None else f"{k.name}={k.default}" for k in words)
        return out + ", " if trailing and out else out

    def saved(self, name: str = "op") -> str:
        """The tensors of list `name`, with out and lse after v: what the autograd saves for the backward."""
        names = [a.name for a in self._list(name) if a.kind == TENSOR]
        return ", ".join(names[:3] + ["out", "lse"] + names[3:])

    def ctx_values(self, name: str = "op") -> str:
        """`ctx.a, ctx.b = a, b` for the non-tensors of list `name`."""
        names = [a.name for a in self._list(name) if a.kind != TENSOR]
        return ", ".join("ctx." + n for n in names) + " = " + ", ".join(names)

    def grads(self, name: str = "op") -> str:
        """The autograd backward's return tuple: each input's gradient expression (a tensor input the spec passes
        as None has none), or None."""
        return ", ".join(a.grad if a.grad and a.real(self.spec) else "None" for a in self._list(name))

    def grad_index(self, arg: str, name: str = "op") -> int:
        return [a.name for a in self._list(name)].index(arg)


def register(env: jinja2.Environment) -> None:
    """Make every helper a global of `env`, reading the spec from the calling template's context."""
    for attr in ("def_kernel", "launch", "pack", "do_not_specialize", "mod_jit", "aot_entry", "c_params", "c_launch", "args",
                 "keywords", "saved", "ctx_values", "grads", "grad_index"):
        env.globals[attr] = _bound(attr)


def _bound(attr: str):
    @jinja2.pass_context
    def helper(context, *args, **kwargs):
        return getattr(Helpers(context["spec"]), attr)(*args, **kwargs)
    helper.__name__ = attr
    return helper
