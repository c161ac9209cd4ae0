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
