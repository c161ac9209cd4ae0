"""Rewrites of a mod's tree that a kernel gets instead of the tree as written: same value, less work per score.

[Note] Mask algebra. attention-gym's document mask is

    (doc[q_idx] == doc[kv_idx]) & (q_idx - offsets[doc[q_idx]] >= kv_idx - offsets[doc[kv_idx]])

and as written a kernel's key loop gathers doc[kv_idx], then offsets[doc[kv_idx]] with the loaded value: two
dependent global loads per key tile, whose latency the loop waits for (Nsight Compute, H100, the bench's document
row: long-scoreboard stalls lead, 1.44 warps per issue). Two rewrites, each exact on the kernel's int32 values:

  - **Equality substitution.** In `E & F` where E is `A == B` on ints (or bools), F may read A where it reads B:
    where A != B the conjunction is False whatever F is, and where A == B, F(B) = F(A) (every node is a pure
    function of its operands; a captured tensor is never written by a kernel). B is the side that depends on kv_idx
    and not on q_idx, A the side that depends on q_idx and not on kv_idx, so what is left is loop-invariant in the
    forward's key loop. Floats are left alone: 0.0 == -0.0 but 1 / 0.0 != 1 / -0.0, and NaN != NaN.
  - **Cancellation.** A comparison of two int sums with a common term drops it: `x - c >= y - c` is `x >= y`,
    likewise `+ c` on both sides, for every comparison. Exact on integers; the kernels compute indices in int32,
    where a sum that overflows already differs from torch's int64 (README "User mods", "Arithmetic"), and the
    rewrite only removes such an overflow.

The document mask becomes `(doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)`: one load per key tile. The spec's text
(its name, its hash, what `fagen verify` and the float64 reference read) stays the user's; only emitted kernel code
sees the rewritten tree (ModCode in fagen/codegen/mod_args.py, before the loops' invariant parts are hoisted), so a rewrite cannot change what a spec means, and the property tests
compare the kernels against the tree as written.
"""

from __future__ import annotations

import dataclasses

from fagen.mods import ir


def simplify(tree: ir.Node) -> ir.Node:
    """The tree with [Note] Mask algebra's rewrites applied bottom-up until nothing changes (at most a few rounds)."""
    for _ in range(8):
        new = _rewrite(tree)
        if new == tree:
            return new
        tree = new
    return tree


def _inputs(node: ir.Node) -> set[str]:
    return {n.name for n in ir.walk(node) if isinstance(n, ir.Input)}


def _exact(node: ir.Node) -> bool:
    return node.type in (ir.INT, ir.BOOL)


def _rewrite(n: ir.Node) -> ir.Node:
    kids = n.children()
    if kids:
        new = tuple(_rewrite(c) for c in kids)
        if new != kids:
            n = _rebuild(n, new)
    if isinstance(n, ir.Binary) and n.op == "&" and n.type == ir.BOOL:
        return _substitute_conjunction(n)
    if isinstance(n, ir.Binary) and n.op in ir.COMPARE and n.a.type == ir.INT and n.b.type == ir.INT:
        return _cancel(n)
    return n


def _rebuild(n: ir.Node, kids: tuple) -> ir.Node:
    if isinstance(n, ir.Load):
        return dataclasses.replace(n, index=kids)
    names = [f.name for f in dataclasses.fields(n) if isinstance(getattr(n, f.name), ir.Node)]
    return dataclasses.replace(n, **dict(zip(names, kids)))


def _substitute_conjunction(n: ir.Binary) -> ir.Node:
    for eq, other, first in ((n.a, n.b, True), (n.b, n.a, False)):
        if not (isinstance(eq, ir.Binary) and eq.op == "==" and _exact(eq.a) and eq.a.type == eq.b.type):
            continue
        pair = _orient(eq.a, eq.b)
        if pair is None:
            continue
        keep, drop = pair
        replaced = _replace(other, drop, keep)
        if replaced != other:
            replaced = _rewrite(replaced)
            return ir.Binary("&", eq, replaced, ir.BOOL) if first else ir.Binary("&", replaced, eq, ir.BOOL)
    return n


def _orient(a: ir.Node, b: ir.Node) -> tuple[ir.Node, ir.Node] | None:
    """(kept, replaced): the q_idx-only side is kept, the kv_idx-only side replaced; None when neither is so."""
    ia, ib = _inputs(a), _inputs(b)
    if "q_idx" in ia and "kv_idx" not in ia and "kv_idx" in ib and "q_idx" not in ib:
        return a, b
    if "q_idx" in ib and "kv_idx" not in ib and "kv_idx" in ia and "q_idx" not in ia:
        return b, a
    return None


def _replace(node: ir.Node, old: ir.Node, new: ir.Node) -> ir.Node:
    if node == old:
        return new
    kids = node.children()
    if not kids:
        return node
    out = tuple(_replace(c, old, new) for c in kids)
    return _rebuild(node, out) if out != kids else node


def _terms(node: ir.Node, sign: int = 1) -> list[tuple[int, ir.Node]]:
    """node as a signed sum of terms, through int `+` and `-` (and unary minus)."""
    if isinstance(node, ir.Binary) and node.op in ("+", "-") and node.type == ir.INT:
        return _terms(node.a, sign) + _terms(node.b, sign if node.op == "+" else -sign)
    if isinstance(node, ir.Unary) and node.op == "neg" and node.type == ir.INT:
        return _terms(node.x, -sign)
    return [(sign, node)]


def _sum(terms: list[tuple[int, ir.Node]]) -> ir.Node:
    if not terms:
        return ir.const(0)
    sign, out = terms[0]
    out = ir.unary("neg", out) if sign < 0 else out
    for sign, t in terms[1:]:
        out = ir.binary("+" if sign > 0 else "-", out, t)
    return out


def _cancel(n: ir.Binary) -> ir.Node:
    left, right = _terms(n.a), _terms(n.b)
    common = False
    for term in list(left):
        if term in right:
            left.remove(term)
            right.remove(term)
            common = True
    if not common:
        return n
    return ir.binary(n.op, _sum(left), _sum(right))
