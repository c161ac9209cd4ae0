"""The symbolic values a traced mod computes with: each holds an expression tree and builds a bigger one.

Proxy stands for an input (score, b, h, q_idx, kv_idx) or any value computed from them; ScalarProxy for a
captured number (named on first use); TensorProxy for a captured tensor (it can only be indexed). Every operation
outside the whitelist raises a SpecError that names the operation and the user's line (the tracer finds it).
"""

from __future__ import annotations

import os

from fagen.mods import ir

_TORCH_FNS: dict = {}  # torch callable -> op name, filled on first trace
TORCH_DIR = [""]


def init_torch() -> None:
    import torch

    if _TORCH_FNS:
        return
    table = {"where": (torch.where, torch.Tensor.where), "exp": (torch.exp, torch.Tensor.exp),
             "exp2": (torch.exp2, torch.special.exp2, torch.Tensor.exp2), "log": (torch.log, torch.Tensor.log),
             "tanh": (torch.tanh, torch.Tensor.tanh), "sigmoid": (torch.sigmoid, torch.special.expit,
                                                                  torch.Tensor.sigmoid),
             "abs": (torch.abs, torch.absolute, torch.Tensor.abs), "sqrt": (torch.sqrt, torch.Tensor.sqrt),
             "minimum": (torch.minimum, torch.Tensor.minimum), "maximum": (torch.maximum, torch.Tensor.maximum),
             "clamp": (torch.clamp, torch.clip, torch.Tensor.clamp, torch.Tensor.clip),
             "&": (torch.logical_and, torch.Tensor.logical_and), "|": (torch.logical_or, torch.Tensor.logical_or),
             "~": (torch.logical_not, torch.Tensor.logical_not)}
    TORCH_DIR[0] = os.path.dirname(os.path.abspath(torch.__file__))
    _TORCH_FNS.update({fn: op for op, fns in table.items() for fn in fns})


_DTYPES: dict = {}  # torch dtype -> TENSOR_DTYPES key, filled on first use


def tensor_dtype(tensor) -> str | None:
    """The TENSOR_DTYPES spelling of a torch tensor's dtype, or None when captured tensors cannot have it."""
    if not _DTYPES:
        import torch

        _DTYPES.update({torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int64: "i64",
                        torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
                        torch.bool: "bool"})
    return _DTYPES.get(tensor.dtype)


def node_of(value, tracer, what: str) -> ir.Node:
    """The tree of an operand: a proxy's node, or a Python number as a constant."""
    if isinstance(value, (_Ops, TensorProxy)):
        return value.node
    if isinstance(value, (bool, int, float)):
        try:
            return ir.const(value)
        except ir.TypeRuleError as e:
            tracer.fail(what, str(e))
    import torch

    if isinstance(value, torch.Tensor):
        tracer.fail(what, "is a tensor made inside the function; build it outside and capture it (a closure), "
                          "or use Python numbers")
    tracer.fail(what, f"is a {type(value).__name__}; a mod computes with its inputs, numbers and captured tensors")


_REFUSED = {"__pow__": "`**` (write x * x)", "__rpow__": "`**`", "__xor__": "`^` (use `!=` on bools)",
            "__rxor__": "`^`", "__lshift__": "`<<`", "__rlshift__": "`<<`", "__rshift__": "`>>`",
            "__rrshift__": "`>>`", "__matmul__": "`@`", "__rmatmul__": "`@`",
            "__bool__": "Python `if`/`and`/`or`/`not`/min()/max() on a traced value (use torch.where, & and |)",
            "__int__": "int() of a traced value", "__float__": "float() or math.* of a traced value (use torch.*)",
            "__index__": "a traced value used as a Python index or size", "__iter__": "iterating a traced value",
            "__len__": "len() of a traced value", "__round__": "round()", "__trunc__": "math.trunc()",
            "__floor__": "math.floor() (use //)", "__ceil__": "math.ceil()", "__call__": "calling a traced value",
            "__setitem__": "assigning into a traced value", "__contains__": "`in` on a traced value",
            "__divmod__": "divmod()", "__rdivmod__": "divmod()", "__complex__": "complex()"}


def _refuse(what: str):
    def method(self, *args, **kwargs):
        self._tracer.fail(what, "is outside the whitelist: + - * / // % & | ~, comparisons, torch.where, exp, exp2, "
                                "log, tanh, sigmoid, abs, sqrt, minimum, maximum, clamp, captured tensors indexed")
    return method


class _Ops:
    """The operations of a traced value; its `node` is the expression tree computing it."""

    __slots__ = ("_node", "_tracer")
    __hash__ = object.__hash__  # `==` builds a tree, so identity is the hash

    def __init__(self, node: ir.Node | None, tracer):
        self._node, self._tracer = node, tracer

    @property
    def node(self) -> ir.Node:
        return self._node

    def _make(self, build, *args, what: str):
        nodes = [node_of(a, self._tracer, what) for a in args]
        try:
            return Proxy(build(*nodes), self._tracer)
        except ir.TypeRuleError as e:
            self._tracer.fail(what, str(e))

    def _bin(self, op, other, reverse=False):
        a, b = (other, self) if reverse else (self, other)
        return self._make(lambda x, y: ir.binary(op, x, y), a, b, what=f"`{op}`")

    def _un(self, op):
        return self._make(lambda x: ir.unary(op, x), self, what=f"{op}()")

    __add__ = lambda s, o: s._bin("+", o)  # noqa: E731 - one line per operator reads best
    __radd__ = lambda s, o: s._bin("+", o, True)  # noqa: E731
    __sub__ = lambda s, o: s._bin("-", o)  # noqa: E731
    __rsub__ = lambda s, o: s._bin("-", o, True)  # noqa: E731
    __mul__ = lambda s, o: s._bin("*", o)  # noqa: E731
    __rmul__ = lambda s, o: s._bin("*", o, True)  # noqa: E731
    __truediv__ = lambda s, o: s._bin("/", o)  # noqa: E731
    __rtruediv__ = lambda s, o: s._bin("/", o, True)  # noqa: E731
    __floordiv__ = lambda s, o: s._bin("//", o)  # noqa: E731
    __rfloordiv__ = lambda s, o: s._bin("//", o, True)  # noqa: E731
    __mod__ = lambda s, o: s._bin("%", o)  # noqa: E731
    __rmod__ = lambda s, o: s._bin("%", o, True)  # noqa: E731
    __and__ = lambda s, o: s._bin("&", o)  # noqa: E731
    __rand__ = lambda s, o: s._bin("&", o, True)  # noqa: E731
    __or__ = lambda s, o: s._bin("|", o)  # noqa: E731
    __ror__ = lambda s, o: s._bin("|", o, True)  # noqa: E731
    __lt__ = lambda s, o: s._bin("<", o)  # noqa: E731
    __le__ = lambda s, o: s._bin("<=", o)  # noqa: E731
    __gt__ = lambda s, o: s._bin(">", o)  # noqa: E731
    __ge__ = lambda s, o: s._bin(">=", o)  # noqa: E731
    __eq__ = lambda s, o: s._bin("==", o)  # noqa: E731
    __ne__ = lambda s, o: s._bin("!=", o)  # noqa: E731
    __neg__ = lambda s: s._un("neg")  # noqa: E731
    __invert__ = lambda s: s._un("invert")  # noqa: E731
    __abs__ = lambda s: s._un("abs")  # noqa: E731
    __pos__ = lambda s: s  # noqa: E731
    locals().update({name: _refuse(what) for name, what in _REFUSED.items()})

    # Tensor methods attention-gym's mods use (`(a - b).abs()`, `q.clamp(lo, hi)`), mapped to the same ops.
    exp = lambda s: s._un("exp")  # noqa: E731
    exp2 = lambda s: s._un("exp2")  # noqa: E731
    log = lambda s: s._un("log")  # noqa: E731
    tanh = lambda s: s._un("tanh")  # noqa: E731
    sigmoid = lambda s: s._un("sigmoid")  # noqa: E731
    sqrt = lambda s: s._un("sqrt")  # noqa: E731
    abs = lambda s: s._un("abs")  # noqa: E731
    minimum = lambda s, o: s._bin("minimum", o)  # noqa: E731
    maximum = lambda s, o: s._bin("maximum", o)  # noqa: E731
    logical_and = lambda s, o: s._bin("&", o)  # noqa: E731
    logical_or = lambda s, o: s._bin("|", o)  # noqa: E731
    logical_not = lambda s: s._un("invert") if s.node.type == ir.BOOL else s._tracer.fail(  # noqa: E731
        "logical_not", "takes a bool")

    def clamp(self, min=None, max=None):  # noqa: A002 - torch's keyword names
        return _clamp(self, min, max, self._tracer)

    clip = clamp

    def where(self, cond, other):
        return _call("where", (cond, self, other), self._tracer)

    def new_ones(self, size=(), *, dtype=None, **_):
        return self._new(size, dtype, 1)

    def new_zeros(self, size=(), *, dtype=None, **_):
        return self._new(size, dtype, 0)

    def _new(self, size, dtype, value):
        """`b.new_ones((), dtype=torch.bool)`, as torch's and_masks/or_masks/noop_mask start their result."""
        import torch

        if tuple(size) != ():
            self._tracer.fail("new_ones/new_zeros", "only a 0-dim (size ()) constant")
        kind = bool if dtype is torch.bool else float if dtype is not None and dtype.is_floating_point else int
        return Proxy(ir.const(kind(value)), self._tracer)

    @property
    def device(self):
        return None

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        self._tracer.fail(f".{name}", "attribute or method outside the whitelist")

    def __getitem__(self, index):
        self._tracer.fail("[...]", "only a captured tensor can be indexed")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        tracer = next(a._tracer for a in _flat(args, kwargs) if isinstance(a, (_Ops, TensorProxy)))
        op = _TORCH_FNS.get(func)
        name = f"torch.{getattr(func, '__name__', func)}"
        if op is None:
            tracer.fail(name, "is outside the whitelist: torch.where, exp, exp2, log, tanh, sigmoid, abs, sqrt, "
                              "minimum, maximum, clamp (and Python's + - * / // % & | ~ and comparisons)")
        kwargs = dict(kwargs or {})
        if op == "clamp":
            lo, hi = (list(args[1:]) + [None, None])[:2]
            return _clamp(args[0], kwargs.pop("min", lo), kwargs.pop("max", hi), tracer, kwargs)
        if kwargs:
            tracer.fail(name, f"keyword arguments {sorted(kwargs)} are not supported; pass positional ones")
        return _call(op, args, tracer, name)


class Proxy(_Ops):
    """An input or a computed value. Proxy and ScalarProxy are siblings, not parent and child: Python tries a
    right operand's reflected comparison first when its type subclasses the left one's, which would turn
    `q_idx - kv_idx <= window` into `window >= q_idx - kv_idx`."""

    __slots__ = ()


def _flat(args, kwargs):
    for a in list(args) + list((kwargs or {}).values()):
        yield from (a if isinstance(a, (tuple, list)) else (a,))


_ARITY = {"where": 3, "minimum": 2, "maximum": 2, "&": 2, "|": 2, "~": 1}


def _call(op: str, args, tracer, name: str | None = None):
    name = name or op
    if len(args) != _ARITY.get(op, 1):
        tracer.fail(name, f"takes {_ARITY.get(op, 1)} arguments here; got {len(args)}")
    nodes = [node_of(a, tracer, name) for a in args]
    try:
        if op == "where":
            node = ir.where(*nodes)
        elif op in ("minimum", "maximum", "&", "|"):
            node = ir.binary(op, *nodes)
        elif op == "~":
            if nodes[0].type != ir.BOOL:
                tracer.fail(name, "takes a bool")
            node = ir.unary("invert", nodes[0])
        else:
            node = ir.unary(op, nodes[0])
    except ir.TypeRuleError as e:
        tracer.fail(name, str(e))
    return Proxy(node, tracer)


def _clamp(x, lo, hi, tracer, extra=None):
    if extra:
        tracer.fail("clamp", f"keyword arguments {sorted(extra)} are not supported")
    if lo is None and hi is None:
        tracer.fail("clamp", "needs min or max")
    if lo is None:
        return _call("minimum", (x, hi), tracer, "clamp")
    if hi is None:
        return _call("maximum", (x, lo), tracer, "clamp")
    nodes = [node_of(a, tracer, "clamp") for a in (x, lo, hi)]
    try:
        return Proxy(ir.clamp(*nodes), tracer)
    except ir.TypeRuleError as e:
        tracer.fail("clamp", str(e))


class ScalarProxy(_Ops):
    """A captured Python number: a runtime scalar, declared (and named) the first time the trace uses it."""

    __slots__ = ("_base", "_value", "_path")

    def __init__(self, tracer, base: str, value, path: tuple):
        super().__init__(None, tracer)
        self._base, self._value, self._path = base, value, path

    @property
    def node(self) -> ir.Node:
        if self._node is None:
            if isinstance(self._value, int) and abs(self._value) > ir.INT_MAX:
                self._tracer.fail(self._base, f"captured int {self._value} does not fit int32")
            self._node = self._tracer.declare_scalar(self._base, self._value, self._path)
        return self._node


class TensorProxy:
    """A captured tensor. Indexing it with int expressions loads one element (a Load node); nothing else. Indexing
    fewer dimensions than its rank gives a row (`interval = intervals[i]`, then `interval[0]`): the indices
    collect until every dimension has one."""

    __slots__ = ("_tracer", "_base", "_tensor", "_path", "_decl", "_prefix")
    __hash__ = object.__hash__

    def __init__(self, tracer, base: str, tensor, path: tuple, decl=None, prefix: tuple = ()):
        self._tracer, self._base, self._tensor, self._path = tracer, base, tensor, path
        self._decl, self._prefix = decl, prefix

    def _declared(self):
        if self._decl is None:
            self._decl = self._tracer.declare_tensor(self._base, self._tensor, self._path)
        return self._decl

    def __getitem__(self, index):
        decl = self._declared()
        items = index if isinstance(index, tuple) else (index,)
        nodes = []
        for i in items:
            if isinstance(i, (slice, type(None), type(Ellipsis))) or isinstance(i, bool):
                self._tracer.fail(f"{decl.name}[...]", "indices are int expressions (no slices, None, ..., bools)")
            nodes.append(node_of(i, self._tracer, f"{decl.name}[...]"))
        nodes = list(self._prefix) + nodes
        if len(nodes) < decl.rank:
            return TensorProxy(self._tracer, self._base, self._tensor, self._path, decl, tuple(nodes))
        try:
            return Proxy(ir.load(decl.name, decl.dtype, decl.rank, tuple(nodes)), self._tracer)
        except ir.TypeRuleError as e:
            self._tracer.fail(f"{decl.name}[...]", str(e))

    @property
    def node(self) -> ir.Node:
        """A 0-dim tensor reads as its one element; any other must be indexed."""
        decl = self._declared()
        if decl.rank != len(self._prefix):
            self._tracer.fail(decl.name, f"a captured tensor of rank {decl.rank} is used without an index; write "
                                         f"{decl.name}[i{', ...' if decl.rank > 1 else ''}]")
        return ir.load(decl.name, decl.dtype, decl.rank, self._prefix)

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        self._tracer.fail(f"{self._base}.{name}", "a captured tensor can only be indexed inside a mod")

    __torch_function__ = _Ops.__torch_function__

    def _op(name):  # noqa: N805 - builds the arithmetic of a 0-dim tensor
        return lambda self, *a: getattr(Proxy(self.node, self._tracer), name)(*a)

    for _n in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
               "__floordiv__", "__rfloordiv__", "__mod__", "__rmod__", "__lt__", "__le__", "__gt__", "__ge__",
               "__eq__", "__ne__", "__neg__", "__and__", "__rand__", "__or__", "__ror__", "__invert__", "__abs__"):
        locals()[_n] = _op(_n)
    del _n, _op
    locals().update({name: _refuse(what) for name, what in _REFUSED.items()})
