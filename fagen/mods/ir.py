"""The mods' expression tree: immutable typed nodes for score_mod / mask_mod, their type rules and limits.

Every node has a `type`: "int" (an index, int32 in a kernel), "float" (a score, fp32 in a kernel) or "bool".
Nodes are built only through the constructors below (`binary`, `unary`, `where`, `clamp`, `load`, `const`), which
check the operands' types and compute the result's, so a tree that exists is well typed. The type rules follow
torch's on int32 index tensors and a float score: bool promotes to int, int to float; `/` always gives float;
`//` and `%` floor (Python's rule for negative operands); `&` `|` `~` take bool or int, never float.
"""

from __future__ import annotations

import dataclasses
import math
import re

from fagen.errors import SpecError

INT, FLOAT, BOOL = "int", "float", "bool"

# The inputs of FlexAttention's signatures: score_mod(score, b, h, q_idx, kv_idx), mask_mod(b, h, q_idx, kv_idx).
INDEX_INPUTS = ("b", "h", "q_idx", "kv_idx")
SCORE_INPUTS = ("score",) + INDEX_INPUTS

ARITH = ("+", "-", "*", "/", "//", "%")
BITS = ("&", "|")
COMPARE = ("<", "<=", ">", ">=", "==", "!=")
MINMAX = ("minimum", "maximum")
BINARY = ARITH + BITS + COMPARE + MINMAX
FLOAT_FNS = ("exp", "exp2", "log", "tanh", "sigmoid", "sqrt")  # int operands become float (torch.exp(int) is float)
UNARY = ("neg", "invert", "abs") + FLOAT_FNS
FUNCTIONS = FLOAT_FNS + ("abs",) + MINMAX + ("where", "clamp")  # the names a call may use in the text form

# Element types of captured tensors, with the tree type of one loaded element.
TENSOR_DTYPES = {"fp32": FLOAT, "fp16": FLOAT, "bf16": FLOAT, "i64": INT, "i32": INT, "i16": INT, "i8": INT,
                 "u8": INT, "bool": BOOL}
MAX_RANK = 4

# Limits every tree keeps, whether traced or parsed: they bound the source a kernel gets and the parser's work.
MAX_NODES = 1024  # attention-gym's largest (STA 3-d) has 271
MAX_DEPTH = 32
INT_MAX = 2 ** 31 - 1  # int constants are int32 in a kernel
FLOAT_MAX = 3.4028234663852886e38  # the largest finite fp32; inf itself is allowed

NAME_RE = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,31}\Z")
RESERVED = frozenset(SCORE_INPUTS + FUNCTIONS + ("inf", "True", "False", "None"))


class Node:
    """Base of the tree's nodes (frozen dataclasses: equal trees compare and hash equal)."""

    type: str

    def children(self) -> tuple[Node, ...]:
        return ()


@dataclasses.dataclass(frozen=True)
class Input(Node):
    name: str  # one of SCORE_INPUTS
    type: str


@dataclasses.dataclass(frozen=True)
class Const(Node):
    value: bool | int | float
    type: str


@dataclasses.dataclass(frozen=True)
class Scalar(Node):
    """A named runtime scalar (a captured Python number): its value is a kernel argument, never in the source."""
    name: str
    type: str  # INT or FLOAT


@dataclasses.dataclass(frozen=True)
class Load(Node):
    """One element of a captured tensor: `name[i0, i1, ...]`; each index is clamped into the tensor (docs/mods.md)."""
    name: str
    dtype: str  # a TENSOR_DTYPES key
    index: tuple[Node, ...]
    type: str

    def children(self):
        return self.index


@dataclasses.dataclass(frozen=True)
class Unary(Node):
    op: str  # one of UNARY
    x: Node
    type: str

    def children(self):
        return (self.x,)


@dataclasses.dataclass(frozen=True)
class Binary(Node):
    op: str  # one of BINARY
    a: Node
    b: Node
    type: str

    def children(self):
        return (self.a, self.b)


@dataclasses.dataclass(frozen=True)
class Where(Node):
    cond: Node
    a: Node
    b: Node
    type: str

    def children(self):
        return (self.cond, self.a, self.b)


@dataclasses.dataclass(frozen=True)
class Clamp(Node):
    """clamp(x, lo, hi) = minimum(maximum(x, lo), hi), torch's rule (hi wins when lo > hi)."""
    x: Node
    lo: Node
    hi: Node
    type: str

    def children(self):
        return (self.x, self.lo, self.hi)


class TypeRuleError(Exception):
    """An operation the type rules refuse; the tracer and the parser turn it into a SpecError with a location."""


def _promote(*types: str) -> str:
    return FLOAT if FLOAT in types else INT if INT in types else BOOL


def const(value) -> Const:
    """A numeric constant. Python numbers only; huge or NaN values are refused (one line, no traceback)."""
    if isinstance(value, bool):
        return Const(value, BOOL)
    if isinstance(value, int):
        if abs(value) > INT_MAX:
            raise TypeRuleError(f"integer constant {value} does not fit int32 (|v| <= {INT_MAX})")
        return Const(value, INT)
    if isinstance(value, float):
        if math.isnan(value):
            raise TypeRuleError("NaN constant")
        if not math.isinf(value) and abs(value) > FLOAT_MAX:
            raise TypeRuleError(f"float constant {value!r} overflows fp32 (|v| <= {FLOAT_MAX!r}, or inf)")
        return Const(value + 0.0, FLOAT)  # + 0.0 turns -0.0 into 0.0: one spelling per value
    raise TypeRuleError(f"constant {value!r} of type {type(value).__name__}; only int, float and bool")


_PY_BINARY = {"+": lambda x, y: x + y, "-": lambda x, y: x - y, "*": lambda x, y: x * y, "/": lambda x, y: x / y,
              "//": lambda x, y: x // y, "%": lambda x, y: x % y, "&": lambda x, y: x & y, "|": lambda x, y: x | y,
              "<": lambda x, y: x < y, "<=": lambda x, y: x <= y, ">": lambda x, y: x > y, ">=": lambda x, y: x >= y,
              "==": lambda x, y: x == y, "!=": lambda x, y: x != y, "minimum": min, "maximum": max}
_PY_UNARY = {"abs": abs, "exp": math.exp, "exp2": lambda x: 2.0 ** x, "log": math.log, "tanh": math.tanh,
             "sigmoid": lambda x: 1.0 / (1.0 + math.exp(-x)), "sqrt": math.sqrt}


def _fold(fn, node: Node, *values) -> Node:
    """An operation on constants only, computed here (Python's rules, which torch's follow for these ops)."""
    try:
        value = fn(*values)
    except (ArithmeticError, ValueError) as e:
        raise TypeRuleError(f"constant expression fails: {e}") from None
    if node.type == FLOAT:
        value = float(value)
    elif node.type == INT:
        value = int(value)
    return const(value)


def binary(op: str, a: Node, b: Node) -> Node:
    node = _binary(op, a, b)
    if isinstance(node, Binary) and isinstance(a, Const) and isinstance(b, Const):
        return _fold(_PY_BINARY[op], node, a.value, b.value)
    return node


def _binary(op: str, a: Node, b: Node) -> Node:
    ta, tb = a.type, b.type
    if op in COMPARE:
        return Binary(op, a, b, BOOL)
    if op in BITS:
        if FLOAT in (ta, tb):
            raise TypeRuleError(f"`{op}` on a float; `&` `|` `~` take bools (comparisons) or ints")
        if ta == tb == BOOL:  # True & x = x, False | x = x: torch's and_masks/or_masks start from these
            unit = op == "&"
            if isinstance(a, Const) and a.value is unit:
                return b
            if isinstance(b, Const) and b.value is unit:
                return a
        return Binary(op, a, b, _promote(ta, tb))
    if op in MINMAX:
        return Binary(op, a, b, _promote(ta, tb))
    if ta == BOOL and tb == BOOL:
        raise TypeRuleError(f"`{op}` on two bools; combine conditions with `&` and `|`")
    if op == "/":
        return Binary(op, a, b, FLOAT)
    return Binary(op, a, b, _promote(ta, tb))


def unary(op: str, x: Node) -> Node:
    if op == "neg":
        if x.type == BOOL:
            raise TypeRuleError("unary `-` on a bool; use `~` for not")
        if isinstance(x, Const):
            return const(-x.value)  # folded: `-1` is one constant in the text and in a trace alike
        return Unary(op, x, x.type)
    if op == "invert":
        if x.type == FLOAT:
            raise TypeRuleError("`~` on a float; `~` negates a bool (or flips an int's bits)")
        if isinstance(x, Const):
            return const(not x.value if x.type == BOOL else ~x.value)
        return Unary(op, x, x.type)
    if x.type == BOOL:
        raise TypeRuleError(f"{op}() of a bool; use torch.where(cond, 1.0, 0.0) to make it a number")
    node = Unary(op, x, x.type if op == "abs" else FLOAT)
    return _fold(_PY_UNARY[op], node, x.value) if isinstance(x, Const) else node


def where(cond: Node, a: Node, b: Node) -> Node:
    if cond.type != BOOL:
        raise TypeRuleError("where() needs a bool condition (a comparison)")
    t = _promote(a.type, b.type)
    if isinstance(cond, Const):  # a constant condition picks its branch (if the branch keeps the type)
        pick = a if cond.value else b
        if pick.type == t:
            return pick
        if isinstance(pick, Const):
            return const(float(pick.value) if t == FLOAT else int(pick.value))
    return Where(cond, a, b, t)


def clamp(x: Node, lo: Node, hi: Node) -> Node:
    if BOOL in (x.type, lo.type, hi.type):
        raise TypeRuleError("clamp() of a bool")
    return Clamp(x, lo, hi, _promote(x.type, lo.type, hi.type))


def load(name: str, dtype: str, rank: int, index: tuple[Node, ...]) -> Node:
    if len(index) != rank:
        raise TypeRuleError(f"tensor {name} has rank {rank} and takes exactly {rank} indices; got {len(index)}")
    for i in index:
        if i.type != INT:
            raise TypeRuleError(f"index of {name} is a {i.type}; indices are int expressions of b, h, q_idx, "
                                "kv_idx, int scalars and int tensor elements")
    return Load(name, dtype, tuple(index), TENSOR_DTYPES[dtype])


def walk(node: Node):
    """Every node of the tree, parents before children (iterative: no recursion limit)."""
    stack = [node]
    while stack:
        n = stack.pop()
        yield n
        stack.extend(reversed(n.children()))


def depth(node: Node) -> int:
    best, stack = 0, [(node, 1)]
    while stack:
        n, d = stack.pop()
        best = max(best, d)
        stack.extend((c, d + 1) for c in n.children())
    return best


def check_size(node: Node) -> None:
    """The tree stays within MAX_NODES nodes and MAX_DEPTH levels, counted as a tree (shared subtrees twice)."""
    count = 0
    for _ in walk(node):
        count += 1
        if count > MAX_NODES:
            raise TypeRuleError(f"expression has more than {MAX_NODES} nodes; simplify it")
    if depth(node) > MAX_DEPTH:
        raise TypeRuleError(f"expression nests deeper than {MAX_DEPTH} levels; simplify it")


def check_name(field: str, name) -> str:
    """A scalar or tensor name: an identifier of up to 32 ASCII letters, digits and `_`, not reserved."""
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise SpecError(field, name, "a name is a letter then up to 31 letters, digits or `_` (ASCII)")
    if name in RESERVED:
        raise SpecError(field, name, "is reserved (inputs, functions, inf, True, False); choose another name")
    return name


def names_in(node: Node) -> tuple[set[str], set[str]]:
    """(scalar names, tensor names) the tree uses."""
    scalars, tensors = set(), set()
    for n in walk(node):
        if isinstance(n, Scalar):
            scalars.add(n.name)
        elif isinstance(n, Load):
            tensors.add(n.name)
    return scalars, tensors
