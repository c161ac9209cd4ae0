"""ALiBi slopes written as an expression of h, evaluated on the host once per query head (lower.py's ALiBi
lowering hands the result to the ALiBi switch as its float32 [Hq] `alibi_slopes`)."""

from __future__ import annotations

import math

from fagen.mods import ir

LIMIT = 1 << 24  # as lower.LIMIT: |ints| within which the kernel's int32 arithmetic cannot wrap


# [Note] Host slopes. A slope written as an expression of h (attention-gym's `exp2(-((h + 1) * 8.0 / H))`) is the
# same number for every score of a head, so the ALiBi switch can take it as its float32 [Hq] alibi_slopes,
# evaluated here once per head: ints as Python ints (the kernel's int32, so refused past 2**24, where wrapping
# could start, and on a division by zero), floats in float64, rounded once to float32 by the caller. The kernel
# evaluates the same tree in fp32, so the two slopes agree to a few fp32 ulps: the same attention to rounding.
# Any value past fp32's range or NaN on the way (exp overflow, a division by zero, log of a negative) is refused,
# since the kernel's inf or NaN would not be the host's number, and so is a slope past 2**100 in size (see [Note]
# ALiBi without its row term): the mod then runs as written. fagen/runtime/modded.py caches the tensor by (tree, Hq, the numbers it reads, device), so
# a changed closure number costs one evaluation and one small copy to the device, and no compile.
_HOST_BINARY = {"+": lambda x, y: x + y, "-": lambda x, y: x - y, "*": lambda x, y: x * y,
                "minimum": min, "maximum": max}
_HOST_UNARY = {"neg": lambda x: -x, "abs": abs, "exp": math.exp, "exp2": lambda x: 2.0 ** x, "log": math.log,
               "tanh": math.tanh, "sigmoid": lambda x: 1.0 / (1.0 + math.exp(-x)), "sqrt": math.sqrt}


def head_slopes(tree: ir.Node, heads: int, values: dict) -> tuple[float, ...] | None:
    """The values of an expression of h (`_of_heads`) for h = 0 .. heads - 1 with the closure's current numbers,
    as Python floats, or None where the host cannot match the kernel's value ([Note] Host slopes)."""
    try:
        out = tuple(float(_host(tree, h, values)) for h in range(heads))
    except (ArithmeticError, ValueError, _Refused):
        return None
    return out if all(abs(x) <= 2.0 ** 100 for x in out) else None


class _Refused(Exception):
    pass


def _host(node: ir.Node, h: int, values: dict):
    if isinstance(node, ir.Input):
        x = h
    elif isinstance(node, ir.Const):
        x = node.value
    elif isinstance(node, ir.Scalar):
        x = values[node.name]
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            raise _Refused
    elif isinstance(node, ir.Unary):
        x = _HOST_UNARY[node.op](_host(node.x, h, values) if node.op in ("neg", "abs")
                                 else float(_host(node.x, h, values)))
    else:
        a, b = _host(node.a, h, values), _host(node.b, h, values)
        if node.op == "/":
            x = float(a) / float(b)
        elif node.op in ("//", "%"):
            if node.type != ir.INT:
                raise _Refused  # floor division of floats: torch's and Python's roundings differ
            x = a // b if node.op == "//" else a % b
        else:
            x = _HOST_BINARY[node.op](a, b)
    if node.type == ir.INT:
        if isinstance(x, float) or abs(x) > LIMIT:
            raise _Refused
        return x
    if not abs(x) <= ir.FLOAT_MAX:  # past fp32 (or NaN): the kernel's value would be inf or NaN from here on
        raise _Refused
    return float(x)
