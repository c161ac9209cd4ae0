"""Symbolic derivatives of a score_mod tree: d(mod)/d(score) for the backward's dS, and d(mod)/d(element) for each
load of a captured float tensor (a learned bias's gradient).

The rules are torch's autograd formulas, so the kernels' gradients agree with the float64 reference's:
`where` differentiates branch-wise and its condition is constant; comparisons, `&`, `|`, `~`, ints and bools
have no derivative; minimum/maximum split a tie evenly; abs has derivative 0 at 0; clamp passes the gradient
to x inside [lo, hi] (inclusive) and to the bound it hits outside. Trivial terms fold (`score + bias[...]`: 1).
"""

from __future__ import annotations

import math

from fagen.mods import ir

ZERO, ONE = ir.Const(0.0, ir.FLOAT), ir.Const(1.0, ir.FLOAT)


def _zero(n: ir.Node) -> bool:
    return isinstance(n, ir.Const) and n.value == 0


def _one(n: ir.Node) -> bool:
    return isinstance(n, ir.Const) and n.value == 1


def _add(a, b):
    return b if _zero(a) else a if _zero(b) else ir.binary("+", a, b)


def _sub(a, b):
    return a if _zero(b) else ir.unary("neg", b) if _zero(a) else ir.binary("-", a, b)


def _mul(a, b):
    if _zero(a) or _zero(b):
        return ZERO
    return b if _one(a) else a if _one(b) else ir.binary("*", a, b)


def _div(a, b):
    return ZERO if _zero(a) else a if _one(b) else ir.binary("/", a, b)


def _where(c, a, b):
    return a if a == b else ir.where(c, a, b)


def derivative(tree: ir.Node, wrt) -> ir.Node:
    """d tree / d v, where `wrt(node)` is True exactly for the nodes that are v (an Input or a Load)."""
    memo: dict[ir.Node, ir.Node] = {}

    def d(n: ir.Node) -> ir.Node:
        if n in memo:
            return memo[n]
        if wrt(n):
            out = ONE
        elif n.type != ir.FLOAT or isinstance(n, (ir.Input, ir.Const, ir.Scalar, ir.Load)):
            out = ZERO
        else:
            out = _rule(n, d)
        memo[n] = out
        return out

    return d(tree)


def _rule(n: ir.Node, d) -> ir.Node:
    if isinstance(n, ir.Where):
        return _where(n.cond, d(n.a), d(n.b))
    if isinstance(n, ir.Clamp):
        x, lo, hi = n.x, n.lo, n.hi
        inside = ir.binary("&", ir.binary(">=", x, lo), ir.binary("<=", x, hi))
        return _add(_add(_where(inside, d(x), ZERO), _where(ir.binary("<", x, lo), d(lo), ZERO)),
                    _where(ir.binary(">", x, hi), d(hi), ZERO))
    if isinstance(n, ir.Unary):
        x, dx = n.x, d(n.x)
        if _zero(dx):
            return ZERO
        if n.op == "neg":
            return ir.unary("neg", dx)
        if n.op == "abs":
            return ir.where(ir.binary(">", x, ZERO), dx, _where(ir.binary("<", x, ZERO), ir.unary("neg", dx), ZERO))
        if n.op == "exp":
            return _mul(n, dx)
        if n.op == "exp2":
            return _mul(_mul(n, ir.const(math.log(2.0))), dx)
        if n.op == "log":
            return _div(dx, x)
        if n.op == "tanh":
            return _mul(_sub(ONE, ir.binary("*", n, n)), dx)
        if n.op == "sigmoid":
            return _mul(_mul(n, _sub(ONE, n)), dx)
        if n.op == "sqrt":
            return _div(dx, ir.binary("*", ir.const(2.0), n))
        raise AssertionError(n.op)  # pragma: no cover - ir.UNARY is covered above
    a, b = n.a, n.b
    da, db = d(a), d(b)
    if n.op == "+":
        return _add(da, db)
    if n.op == "-":
        return _sub(da, db)
    if n.op == "*":
        return _add(_mul(da, b), _mul(a, db))
    if n.op == "/":
        return _sub(_div(da, b), _div(_mul(a, db), ir.binary("*", b, b)))
    if n.op == "//":
        return ZERO  # floor is piecewise constant
    if n.op == "%":  # a % b = a - b * floor(a / b)
        return _sub(da, _mul(ir.binary("//", a, b), db))
    if n.op in ir.MINMAX:
        if _zero(da) and _zero(db):
            return ZERO
        win = "<" if n.op == "minimum" else ">"
        tie = _mul(_add(da, db), ir.const(0.5))
        return _where(ir.binary(win, a, b), da, _where(ir.binary(win, b, a), db, tie))
    raise AssertionError(n.op)  # pragma: no cover - other ops are never float


def d_score(tree: ir.Node) -> ir.Node:
    """d score_mod / d score: the backward multiplies dS by it."""
    return derivative(tree, lambda n: isinstance(n, ir.Input) and n.name == "score")


def d_loads(tree: ir.Node, tensor: str) -> list[tuple[ir.Load, ir.Node]]:
    """For each distinct load of a captured float tensor, (the load, d score_mod / d that element). A tensor read
    at one index expression (`bias[h, q_idx - kv_idx]`) has one entry: the bias gradient at that index is the sum
    over (b, h, q_idx, kv_idx) of dS times it. Loads inside a where branch that is not taken get 0 there."""
    loads = []
    for n in ir.walk(tree):
        if isinstance(n, ir.Load) and n.name == tensor and n.type == ir.FLOAT and n not in loads:
            loads.append(n)
    return [(load, derivative(tree, lambda n, load=load: n == load)) for load in loads]


# [Note] Gradient index classes. The gradient of a captured tensor read at `t[idx(b, h, q_idx, kv_idx)]` sums dS *
# derivative over every score that reads one element. Where idx depends on q_idx and kv_idx only through q_idx,
# only through kv_idx, only through q_idx - kv_idx, or through neither, the scores of one (b, h) that read one
# element lie on rows, columns, diagonals, or anywhere: the dK/dV kernel sums its tile along them first and writes
# one (value, index) per row, column, diagonal or tile (fagen/templates/triton/mods.j2, grad_host). The class is
# proven on the tree, never sampled: every subtree that reads q_idx or kv_idx must be an exact int affine form
# c * q_idx - c * kv_idx + (a term of neither), or a function (any node: a load, `//`, a clamp, a where) of
# subtrees that are all of one class. Int arithmetic is exact in two's complement (a ring, overflow included), so
# q_idx - kv_idx + 7 and 3 * q_idx - 3 * kv_idx are functions of q_idx - kv_idx bitwise; float arithmetic is not, so
# affine forms are tracked through int nodes only. Anything else (q_idx + kv_idx, 2 * q_idx - kv_idx, the score in a
# condition) is SCORE: one pair per score, as before.
TILE, ROW, COLUMN, DIAGONAL, SCORE = "tile", "row", "column", "diagonal", "score"
_CLASS = {frozenset(): TILE, frozenset({"q"}): ROW, frozenset({"kv"}): COLUMN, frozenset({"d"}): DIAGONAL}


def _lin_vars(lin: tuple[int, int]) -> frozenset | None:
    cq, ckv = lin
    if cq == 0 and ckv == 0:
        return frozenset()
    if ckv == 0:
        return frozenset({"q"})
    if cq == 0:
        return frozenset({"kv"})
    return frozenset({"d"}) if cq == -ckv else None


def _union(parts) -> frozenset | None:
    out: frozenset = frozenset()
    for p in parts:
        if p is None:
            return None
        out = out | p
    return out if len(out) <= 1 else None


def _form(n: ir.Node, memo: dict) -> tuple[frozenset | None, tuple[int, int] | None]:
    """(the set of {"q", "kv", "d"} that n is a function of, None if of more than one or of the score; n's exact int
    affine coefficients (on q_idx, on kv_idx) or None)."""
    if n in memo:
        return memo[n]
    lin = None
    if isinstance(n, ir.Input):
        lin = {"q_idx": (1, 0), "kv_idx": (0, 1), "b": (0, 0), "h": (0, 0)}.get(n.name)
        out = (_lin_vars(lin) if lin is not None else None, lin)
    else:
        kids = [_form(c, memo) for c in n.children()]
        if n.type == ir.INT and isinstance(n, ir.Binary) and n.op in ("+", "-") and all(k[1] for k in kids):
            (a, b), sign = (kids[0][1], kids[1][1]), 1 if n.op == "+" else -1
            lin = (a[0] + sign * b[0], a[1] + sign * b[1])
        elif n.type == ir.INT and isinstance(n, ir.Unary) and n.op == "neg" and kids[0][1]:
            lin = (-kids[0][1][0], -kids[0][1][1])
        elif n.type == ir.INT and isinstance(n, ir.Binary) and n.op == "*":
            for this, other in ((n.a, kids[1][1]), (n.b, kids[0][1])):
                if isinstance(this, ir.Const) and this.type == ir.INT and other:
                    lin = (this.value * other[0], this.value * other[1])
                    break
        deps = _lin_vars(lin) if lin is not None else _union(k[0] for k in kids)
        if lin is None and deps == frozenset() and n.type == ir.INT:
            lin = (0, 0)  # a term of neither index (b, h, a scalar, a load at such an index) is an offset
        out = (deps, lin)
    memo[n] = out
    return out


def index_class(load: ir.Load) -> str:
    """The load's [Note] Gradient index classes: TILE, ROW, COLUMN, DIAGONAL or SCORE."""
    memo: dict = {}
    return _CLASS.get(_union(_form(i, memo)[0] for i in load.index), SCORE)
