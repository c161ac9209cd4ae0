"""The mods' canonical text: print a tree as a small Python-like expression, and parse that text back.

The text is what a spec, a manifest or `fagen generate --score-mod` carries, and what enters a spec's name hash:

    score + bias[h, q_idx - kv_idx + 4095]
    (q_idx >= kv_idx) & (doc[q_idx] == doc[kv_idx])

Grammar (a subset of Python expressions; docs/mods.md has the full table):

    expr  := expr BINOP expr | expr CMP expr | '-' expr | '~' expr | CALL '(' expr, ... ')'
           | TENSOR '[' expr, ... ']' | INPUT | SCALAR | number | 'inf' | 'True' | 'False' | '(' expr ')'
    BINOP := + - * / // % & |          CMP := < <= > >= == !=   (one per comparison, no chains)
    CALL  := exp exp2 log tanh sigmoid sqrt abs (1 argument) | minimum maximum (2) | where clamp (3)

The parser reads the text with `ast.parse(mode="eval")` and accepts only the node types and names above; the tree
is printed back by `to_text`, never by echoing the user's text, and nothing is ever evaluated. parse(to_text(t)) == t.
"""

from __future__ import annotations

import ast
from typing import NamedTuple

from fagen.mods import ir
from fagen.errors import SpecError

MAX_TEXT = 8000  # characters: room for MAX_NODES nodes; far above any real mod, small enough that parsing stays trivial


class ModTensor(NamedTuple):
    """A captured tensor, as the spec declares it: a kernel argument of this element type and rank."""
    name: str
    dtype: str  # an ir.TENSOR_DTYPES key
    rank: int


class ModScalar(NamedTuple):
    """A runtime scalar (a captured Python number): an int32 or fp32 kernel argument."""
    name: str
    type: str  # ir.INT or ir.FLOAT


# -- printing -------------------------------------------------------------------------------------------------------
_PREC = {**{op: 1 for op in ir.COMPARE}, "|": 2, "&": 3, "+": 4, "-": 4, "*": 5, "/": 5, "//": 5, "%": 5}
_UNARY_PREC, _ATOM = 6, 7
_UNARY_SIGN = {"neg": "-", "invert": "~"}


def _const_text(value) -> str:
    if isinstance(value, bool) or isinstance(value, int):
        return str(value)
    return repr(value)  # shortest round-trip form: 0.5, 1e-06, inf, -inf


def _prec(node: ir.Node) -> int:
    if isinstance(node, ir.Binary) and node.op in _PREC:
        return _PREC[node.op]
    if isinstance(node, ir.Unary) and node.op in _UNARY_SIGN:
        return _UNARY_PREC
    if isinstance(node, ir.Const) and not isinstance(node.value, bool) and node.value < 0:
        return _UNARY_PREC
    return _ATOM


def to_text(node: ir.Node) -> str:
    """The canonical text of a tree: minimal parentheses, one space around binary operators."""
    if isinstance(node, (ir.Input, ir.Scalar)):
        return node.name
    if isinstance(node, ir.Const):
        return _const_text(node.value)
    if isinstance(node, ir.Load):
        return f"{node.name}[{', '.join(to_text(i) for i in node.index) or '()'}]"
    if isinstance(node, ir.Unary):
        if node.op in _UNARY_SIGN:
            inner = to_text(node.x)
            return _UNARY_SIGN[node.op] + (f"({inner})" if _prec(node.x) < _UNARY_PREC else inner)
        return f"{node.op}({to_text(node.x)})"
    if isinstance(node, ir.Where):
        return f"where({to_text(node.cond)}, {to_text(node.a)}, {to_text(node.b)})"
    if isinstance(node, ir.Clamp):
        return f"clamp({to_text(node.x)}, {to_text(node.lo)}, {to_text(node.hi)})"
    if node.op in ir.MINMAX:
        return f"{node.op}({to_text(node.a)}, {to_text(node.b)})"
    p = _PREC[node.op]
    left, right = to_text(node.a), to_text(node.b)
    # Left-associative: the left operand needs parentheses only when it binds more loosely; comparisons never chain.
    if _prec(node.a) < p or (p == 1 and _prec(node.a) == 1):
        left = f"({left})"
    if _prec(node.b) <= p:
        right = f"({right})"
    return f"{left} {node.op} {right}"


# -- parsing --------------------------------------------------------------------------------------------------------
_BINOPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%",
           ast.BitAnd: "&", ast.BitOr: "|"}
_CMPOPS = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!="}
_ARITY = {**{f: 1 for f in ir.FLOAT_FNS + ("abs",)}, "minimum": 2, "maximum": 2, "where": 3, "clamp": 3}
_WHAT = {ast.Attribute: "attribute access", ast.Lambda: "a lambda", ast.ListComp: "a comprehension",
         ast.SetComp: "a comprehension", ast.DictComp: "a comprehension", ast.GeneratorExp: "a comprehension",
         ast.IfExp: "an if-expression (use where(cond, a, b))", ast.BoolOp: "`and`/`or` (use & and |)",
         ast.NamedExpr: "an assignment expression", ast.JoinedStr: "a string", ast.Starred: "a starred argument",
         ast.Slice: "a slice", ast.List: "a list", ast.Tuple: "a tuple", ast.Dict: "a dict", ast.Set: "a set",
         ast.Await: "await", ast.Yield: "yield", ast.YieldFrom: "yield"}


class _Parser:
    def __init__(self, field: str, text: str, inputs: tuple[str, ...], tensors: dict, scalars: dict):
        self.field, self.text, self.inputs, self.tensors, self.scalars = field, text, inputs, tensors, scalars

    def fail(self, node: ast.AST | None, why: str):
        seg = (ast.get_source_segment(self.text, node) if node is not None else None) or self.text
        raise SpecError(self.field, seg if len(seg) <= 60 else seg[:57] + "...", why)

    def expr(self, node: ast.AST, level: int) -> ir.Node:
        if level > ir.MAX_DEPTH:
            self.fail(None, f"expression nests deeper than {ir.MAX_DEPTH} levels; simplify it")
        try:
            return self._expr(node, level + 1)
        except ir.TypeRuleError as e:
            self.fail(node, str(e))

    def _expr(self, node: ast.AST, level: int) -> ir.Node:
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            return ir.binary(_BINOPS[type(node.op)], self.expr(node.left, level), self.expr(node.right, level))
        if isinstance(node, ast.Compare):
            if len(node.ops) != 1 or type(node.ops[0]) not in _CMPOPS:
                self.fail(node, "one comparison (< <= > >= == !=) at a time: write (a < b) & (b < c), not a < b < c")
            return ir.binary(_CMPOPS[type(node.ops[0])], self.expr(node.left, level),
                             self.expr(node.comparators[0], level))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.Invert)):
            return ir.unary("neg" if isinstance(node.op, ast.USub) else "invert", self.expr(node.operand, level))
        if isinstance(node, ast.Call):
            return self.call(node, level)
        if isinstance(node, ast.Subscript):
            return self.subscript(node, level)
        if isinstance(node, ast.Name):
            return self.name(node)
        if isinstance(node, ast.Constant):
            if type(node.value) not in (bool, int, float):
                self.fail(node, f"a {type(node.value).__name__} literal; only int and float numbers, True, False")
            return ir.const(node.value)
        what = _WHAT.get(type(node)) or {ast.BinOp: "operator", ast.UnaryOp: "operator"}.get(type(node))
        self.fail(node, f"{what or type(node).__name__} is not allowed; a mod uses + - * / // % & | ~, "
                        "comparisons, " + ", ".join(ir.FUNCTIONS) + ", numbers and declared names")

    def call(self, node: ast.Call, level: int) -> ir.Node:
        fn = node.func.id if isinstance(node.func, ast.Name) else None
        if fn not in _ARITY:
            self.fail(node.func, "calls only " + ", ".join(ir.FUNCTIONS))
        if node.keywords or len(node.args) != _ARITY[fn]:
            self.fail(node, f"{fn}() takes {_ARITY[fn]} positional argument(s)")
        args = [self.expr(a, level) for a in node.args]
        if fn == "where":
            return ir.where(*args)
        if fn == "clamp":
            return ir.clamp(*args)
        if fn in ir.MINMAX:
            return ir.binary(fn, *args)
        return ir.unary(fn, *args)

    def subscript(self, node: ast.Subscript, level: int) -> ir.Node:
        name = node.value.id if isinstance(node.value, ast.Name) else None
        if name not in self.tensors:
            self.fail(node.value, "only a declared tensor can be indexed (declare it: --mod-tensor NAME=DTYPE:RANK)")
        dtype, rank = self.tensors[name]
        items = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        return ir.load(name, dtype, rank, tuple(self.expr(i, level) for i in items))

    def name(self, node: ast.Name) -> ir.Node:
        n = node.id
        if n in self.inputs:
            return ir.Input(n, ir.FLOAT if n == "score" else ir.INT)
        if n == "inf":
            return ir.const(float("inf"))
        if n in self.scalars:
            return ir.Scalar(n, self.scalars[n])
        if n in self.tensors:
            self.fail(node, f"tensor {n} must be indexed: {n}[...] with {self.tensors[n][1]} indices")
        hint = " (a mask_mod has no score)" if n == "score" else ""
        self.fail(node, f"unknown name{hint}; names are {', '.join(self.inputs)}, inf, declared scalars "
                        "(--mod-scalar NAME=int|float) and declared tensors")


def parse(text, field: str = "score_mod", tensors=(), scalars=()) -> ir.Node:
    """The tree of a score_mod (field "score_mod": a float expression of score, b, h, q_idx, kv_idx) or a
    mask_mod (field "mask_mod": a bool expression of b, h, q_idx, kv_idx). tensors: ModTensor-like triples;
    scalars: ModScalar-like pairs. Any text outside the grammar is one SpecError line naming the piece."""
    if not isinstance(text, str):
        raise SpecError(field, text, "must be an expression string such as \"score + bias[h, q_idx - kv_idx]\"")
    if len(text) > MAX_TEXT:
        raise SpecError(field, f"<{len(text)} characters>", f"is longer than {MAX_TEXT} characters; simplify it")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        why = getattr(e, "msg", None) or type(e).__name__
        raise SpecError(field, text if len(text) <= 60 else text[:57] + "...",
                        f"is not a valid expression ({why})") from None
    parser = _Parser(field, text.strip(), ir.SCORE_INPUTS if field == "score_mod" else ir.INDEX_INPUTS,
                     {t[0]: (t[1], t[2]) for t in tensors}, {s[0]: s[1] for s in scalars})
    node = parser.expr(tree.body, 0)
    try:
        ir.check_size(node)
    except ir.TypeRuleError as e:
        raise SpecError(field, f"<{len(text)} characters>", str(e)) from None
    want = ir.FLOAT if field == "score_mod" else ir.BOOL
    if node.type != want:
        raise SpecError(field, text if len(text) <= 60 else text[:57] + "...",
                        "must give a float score" if want == ir.FLOAT else "must give a bool (True: visible)")
    return node


def parse_tensor_decl(text: str) -> ModTensor:
    """`--mod-tensor NAME=DTYPE:RANK`, e.g. `bias=fp32:2`."""
    name, _, rest = str(text).partition("=")
    dtype, _, rank = rest.partition(":")
    field = "mod_tensors"
    if not rank.isdigit():
        raise SpecError(field, text, "write NAME=DTYPE:RANK, e.g. bias=fp32:2")
    return check_tensor(field, (name, dtype, int(rank)))


def parse_scalar_decl(text: str) -> ModScalar:
    """`--mod-scalar NAME=int|float`, e.g. `cap=float`."""
    name, _, kind = str(text).partition("=")
    return check_scalar("mod_scalars", (name, kind))


def check_tensor(field: str, decl) -> ModTensor:
    if not isinstance(decl, (tuple, list)) or len(decl) != 3:
        raise SpecError(field, decl, "each tensor is [name, dtype, rank], e.g. [\"bias\", \"fp32\", 2]")
    name, dtype, rank = decl
    ir.check_name(field, name)
    if dtype not in ir.TENSOR_DTYPES:
        raise SpecError(field, dtype, f"tensor {name}: dtype must be one of {', '.join(ir.TENSOR_DTYPES)}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank <= ir.MAX_RANK:
        raise SpecError(field, rank, f"tensor {name}: rank must be an integer from 0 to {ir.MAX_RANK}")
    return ModTensor(name, dtype, rank)


def check_scalar(field: str, decl) -> ModScalar:
    if not isinstance(decl, (tuple, list)) or len(decl) != 2:
        raise SpecError(field, decl, "each scalar is [name, type], type \"int\" or \"float\", e.g. [\"cap\", \"float\"]")
    name, kind = decl
    ir.check_name(field, name)
    if kind not in (ir.INT, ir.FLOAT):
        raise SpecError(field, kind, f"scalar {name}: type must be \"int\" or \"float\"")
    return ModScalar(name, kind)


def canonical(score_mod, mask_mod, tensors, scalars) -> tuple:
    """The spec's four mod fields, validated and in canonical form: (score text or None, mask text or None,
    tensors sorted by name, scalars sorted by name). Each declared name must be used by a mod and be unique."""
    tensors = tuple(sorted(check_tensor("mod_tensors", t) for t in _items("mod_tensors", tensors)))
    scalars = tuple(sorted(check_scalar("mod_scalars", s) for s in _items("mod_scalars", scalars)))
    names = [t.name for t in tensors] + [s.name for s in scalars]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise SpecError("mod_tensors" if dup[0] in {t.name for t in tensors} else "mod_scalars", dup[0],
                        "is declared twice; each tensor and scalar name is declared once")
    trees = [parse(text, field, tensors, scalars) if text is not None else None
             for text, field in ((score_mod, "score_mod"), (mask_mod, "mask_mod"))]
    used_s, used_t = set(), set()
    for tree in trees:
        if tree is not None:
            s, t = ir.names_in(tree)
            used_s |= s
            used_t |= t
    for decls, used, field in ((tensors, used_t, "mod_tensors"), (scalars, used_s, "mod_scalars")):
        for d in decls:
            if d.name not in used:
                raise SpecError(field, d.name, "is declared but no mod uses it; drop it (one spec per kernel)")
    return (*(to_text(t) if t is not None else None for t in trees), tensors, scalars)


def _items(field: str, value) -> tuple:
    if value is None:
        return ()
    if isinstance(value, str) or not isinstance(value, (tuple, list)):
        raise SpecError(field, value, "must be a list of declarations, e.g. [[\"bias\", \"fp32\", 2]]")
    return tuple(value)
