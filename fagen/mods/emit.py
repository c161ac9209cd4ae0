"""Emit a mod's tree as Triton (or Gluon) expression code. Only the tree is printed: names come from the kernel's own
mapping, numbers are formatted here, and nothing of the user's text reaches the source.

A kernel that uses mods pastes TRITON_HELPERS once at module level (after `import triton.language as tl`) and
calls `to_triton(tree, names)` wherever it needs the value. A Gluon kernel (fagen/templates/gluon/attention.py.j2)
pastes GLUON_HELPERS and calls `to_gluon`: the same tree walk over `gl` ops, whose operands carry the score tile's
distributed layout (the inputs' expressions are slices of it, so every value and load takes that layout).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from fagen.mods import ir

# [Note] Index clamping.
# A captured tensor's element is read at indices that user values computed (positions, document ids, lengths).
# No value may make a kernel read outside the tensor, so every index goes through _mod_index: a negative index
# counts from the end as in torch (i + size for -size <= i < 0), and what is still outside [0, size - 1] is
# clamped into it. Wherever torch's own indexing is defined the kernel reads the same element; where torch
# would raise IndexError (i >= size or i < -size) the kernel reads the nearest end's element. The offsets are
# int64, so a tensor of more than 2**31 elements is addressed correctly.
#
# [Note] Floor division.
# Python's and torch's `//` and `%` on ints round toward -inf; Triton's follow C on the GPU (toward zero). The
# helpers correct the C result with the remainder r = a - (a // b) * b: when r is nonzero and its sign differs
# from b's, the quotient was rounded up. The correction is a no-op where `//` already floors, so the same code is
# right on both (the interpreter's numpy ops floor). Division by zero is outside the contract.
# The helpers both languages share, written once: {jit} is the decorator and {ns} the module (tl or gl).
_SHARED = '''
@{jit}
def _mod_floordiv(a, b):
    """Python's a // b on ints (see [Note] Floor division in fagen/mods/emit.py)."""
    q = a // b
    r = a - q * b
    return q - ((r != 0) & ((r < 0) != (b < 0))).to(q.dtype)


@{jit}
def _mod_floormod(a, b):
    """Python's a % b on ints: the sign of b."""
    r = a - (a // b) * b
    return r + {ns}.where((r != 0) & ((r < 0) != (b < 0)), b, 0)
'''
_INDEX = '''

@{jit}
def _mod_index(i, size):
    """A captured tensor's index, as torch reads it, clamped into [0, size - 1] (see [Note] Index clamping)."""
    i = {ns}.where(i < 0, i + size, i)
    return {ns}.minimum({ns}.maximum(i, 0), size - 1).to({ns}.int64)
'''
TRITON_HELPERS = _SHARED.format(jit="triton.jit", ns="tl") + '''

@triton.jit
def _mod_divisible(a, d):
    """a % d == 0 on ints, for d uniform over the tile and nonzero ([Note] Cheaper forms): the lowest set bit of |d|
    and the inverse of its odd part mod 2**32 once, then per element a multiply and two compares, in uint32."""
    du = tl.abs(d).to(tl.uint32, bitcast=True)
    low = du & (0 - du)  # 2**k, the lowest set bit (uint32 wraps)
    odd = du // low
    inv = odd  # odd * odd = 1 mod 8: Newton's steps double the bits of the inverse, 3 -> 48
    inv = inv * (2 - odd * inv)
    inv = inv * (2 - odd * inv)
    inv = inv * (2 - odd * inv)
    inv = inv * (2 - odd * inv)
    x = tl.abs(a).to(tl.uint32, bitcast=True)
    return ((x & (low - 1)) == 0) & (x * inv <= (du * 0 - 1) // odd)  # x * inv wraps mod 2**32

@triton.jit
def _mod_tanh(x):
    """tanh from exp2, exact to fp32 rounding at both tails."""
    return 1.0 - 2.0 / (tl.math.exp2(x * 2.8853900817779268) + 1.0)  # 2 / ln 2
''' + _INDEX.format(jit="triton.jit", ns="tl")

# [Note] Gluon mods. The same helpers as @gluon.jit functions over `gl` (a Gluon kernel cannot call a @triton.jit
# one), plus _mod_sigmoid (gl has no sigmoid; tl.sigmoid's 1 / (1 + exp(-x))). tanh is tanh.approx.f32, the
# softcap switch's ([Note] Gluon score switches): a Gluon kernel always runs compiled for sm_90 with fp16/bf16 out,
# and the exact exp2 form costs a second MUFU op and a division per score in a loop the exponentials already bound.
# NaN propagation of minimum/maximum is gl's PROPAGATE_NAN.ALL, named through a module constexpr.
GLUON_HELPERS = '''
from triton.language.core import PropagateNan as _PropagateNan

_MOD_NAN = gl.constexpr(_PropagateNan.ALL)

''' + _SHARED.format(jit="gluon.jit", ns="gl") + '''

@gluon.jit
def _mod_tanh(x):
    """tanh.approx.f32 ([Note] Gluon mods in fagen/mods/emit.py)."""
    return gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def _mod_sigmoid(x):
    return 1.0 / (1.0 + gl.exp(-x))
''' + _INDEX.format(jit="gluon.jit", ns="gl")


# [Note] Cheaper forms. Two rewrites save work per score without changing what the mods mean:
#   - `a / d` with d uniform over a tile (numbers, scalars, b and h, loads indexed by them: softcap's
#     `score / soft_cap`) is `a * (1 / d)`: one reciprocal per tile, one multiply per score, in place of an IEEE
#     division per score. It may differ from the division in the last bit (fp32), within every tolerance here; a
#     subnormal d, whose reciprocal overflows, is outside the contract.
#   - `a % d == 0` (and `!= 0`) on ints compares C's truncated remainder with 0: it is zero exactly when Python's
#     floored one is, so the sign correction of _mod_floormod is not needed (a dilated window's `diff % dilation`).
#     With d uniform over a tile (a closure int: no constant for the compiler to strength-reduce) Triton's form is
#     _mod_divisible: |d| = 2**k * m with m odd, and |a| is a multiple of it when its low k bits are 0 and
#     |a| * inv(m) mod 2**32 <= (2**32 - 1) // m (the multiples of m are exactly the |a| that the inverse maps below
#     that bound). The inverse and bound are per tile; per element it is a multiply and two compares in place of
#     an int division: sm_90 ptxas, the dilated window's partial loop at m64n64, 1021 -> 810 instructions. Gluon
#     keeps C's remainder.
def _uniform(n: ir.Node) -> bool:
    if isinstance(n, ir.Input):
        return n.name in ("b", "h")
    return all(_uniform(c) for c in n.children())


def _int_mod_of_zero(n: ir.Binary) -> bool:
    zero = ir.Const(0, ir.INT)
    for this, other in ((n.a, n.b), (n.b, n.a)):
        if other == zero and isinstance(this, ir.Binary) and this.op == "%" and this.type == ir.INT:
            return True
    return False


class TensorRef(NamedTuple):
    """How a kernel names one captured tensor: its pointer, one stride and one size per dimension."""
    ptr: str
    strides: tuple[str, ...]
    sizes: tuple[str, ...]


class _Flavour(NamedTuple):
    """The language a tree is printed in: its module prefix, type names, functions and NaN policy."""
    ns: str
    types: dict
    fn: dict
    nan: str


_TRITON = _Flavour("tl", {ir.INT: "tl.int32", ir.FLOAT: "tl.float32"},
                   {"exp": "tl.exp", "exp2": "tl.math.exp2", "log": "tl.log", "tanh": "_mod_tanh",
                    "sigmoid": "tl.sigmoid", "sqrt": "tl.sqrt", "abs": "tl.abs"},
                   "propagate_nan=tl.PropagateNan.ALL")  # torch.minimum/maximum propagate NaN; Triton's default not
_GLUON = _Flavour("gl", {ir.INT: "gl.int32", ir.FLOAT: "gl.float32"},
                  {"exp": "gl.exp", "exp2": "gl.exp2", "log": "gl.log", "tanh": "_mod_tanh",
                   "sigmoid": "_mod_sigmoid", "sqrt": "gl.sqrt", "abs": "gl.abs"},
                  "propagate_nan=_MOD_NAN")  # [Note] Gluon mods


def _const(value) -> str:
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if math.isinf(value):
        return 'float("inf")' if value > 0 else '(-float("inf"))'
    return repr(value)


def to_triton(tree: ir.Node, names: dict) -> str:
    """Triton source for the tree's value. names: each input ("score", "b", "h", "q_idx", "kv_idx") and scalar
    the tree uses -> a Triton expression (already broadcast as the kernel needs); each tensor -> a TensorRef."""
    return _emit(tree, names, _TRITON)


def to_gluon(tree: ir.Node, names: dict, unclamped: bool = False, split: dict | None = None) -> str:
    """Gluon source for the tree's value (GLUON_HELPERS' functions, `gl` ops; [Note] Gluon mods). names as for
    to_triton, with the inputs' expressions in the kernel's distributed layouts. unclamped: captured tensors read at
    their int32 indices as they are, with int32 offsets (only where `in_range` holds: [Note] Clamp-free tiles).
    split (with unclamped): {"q_idx": (base, local), "kv_idx": (base, local)}, each position as a tile-uniform base
    plus a vector of the tile's offsets ([Note] Split offsets)."""
    return _emit(tree, names, _GLUON, unclamped, split)


# [Note] Clamp-free tiles. _mod_index ([Note] Index clamping) costs a wrap, two clamps and int64 offsets per
# element and load (ptxas sm_90, the Gluon backward with a relative bias: 5360 SASS instructions, 1156 bytes of
# spill stores; without the clamp 3760 and 448). Where every index of a load is an affine form of q_idx and kv_idx
# (+, -, unary -, * by a number or a tile-uniform int: b, h, int closure numbers, int constants), its least and
# greatest value over a tile's rectangle of rows and keys are int64 scalars, per tile: `in_range` is the source of
# one tile-uniform condition that every such bound, and every intermediate one, lies in int32, each index in
# [0, size) and each offset sum((size - 1) * stride) below 2**31. A kernel then reads the tile through
# to_gluon(unclamped=True) where it holds and through _mod_index elsewhere: the same elements either way (an index
# already in [0, size) is what _mod_index returns). A load whose index is anything else (a floor division, a load,
# a where) gives no condition: the clamped code alone.
#
# [Note] Clamp-free problems. The tile test above is cheap, but the clamped branch it guards is still compiled into
# the kernel, and its registers are the kernel's (the Gluon backward with a relative bias at d128: 1088 bytes of
# spill stores with both branches, 448 with no clamp at all; H100, B1 H16 S8192: 254 against 293 TF/s). So the
# host evaluates the same bounds once per call over the whole problem, in Python ints (in_range(host=True): b in
# [0, B), h in [0, Hq), the rows and keys the kernel's padded tiles reach), and where they hold launches the kernel
# built with a constexpr that compiles the unclamped read alone (the Gluon backward's MOD_FREE). Anything else, an
# index out of range or an offset past int32 for any tile, launches the kernel with both branches: the same
# elements as before, clamped where they must be.
def in_range(tree: ir.Node, names: dict, ranges: dict, host: bool = False) -> str | None:
    """Gluon source of the tile-uniform condition of [Note] Clamp-free tiles for every load in `tree`, or None where
    a load's index is not affine in the tile's positions (or the tree has no load). names as to_gluon's (b, h and
    scalars uniform); ranges: {"q_idx": (lo, hi), "kv_idx": (lo, hi)}, int source expressions of the tile's
    least and greatest row and key (uniform). host: Python source over Python ints instead ([Note] Clamp-free
    problems), where ranges may bound b and h too."""
    conds: list[str] = []
    loads = [n for n in ir.walk(tree) if isinstance(n, ir.Load)]
    lo_fn, hi_fn = ("min", "max") if host else ("gl.minimum", "gl.maximum")

    def i64(code: str) -> str:
        return f"({code})" if host else f"({code}).to(gl.int64)"

    def bounds(n: ir.Node):
        if n.type != ir.INT:
            return None
        if isinstance(n, ir.Const):
            return str(n.value), str(n.value)
        if isinstance(n, ir.Input) and n.name in ranges:
            lo, hi = ranges[n.name]
            got = i64(lo), i64(hi)
        elif isinstance(n, (ir.Input, ir.Scalar)) and n.name in names and n.name != "score":
            x = i64(names[n.name])
            return x, x
        elif isinstance(n, ir.Unary) and n.op == "neg":
            x = bounds(n.x)
            got = None if x is None else (f"(-{x[1]})", f"(-{x[0]})")
        elif isinstance(n, ir.Binary) and n.op in ("+", "-", "*"):
            a, b = bounds(n.a), bounds(n.b)
            if a is None or b is None:
                return None
            if n.op == "+":
                got = f"({a[0]} + {b[0]})", f"({a[1]} + {b[1]})"
            elif n.op == "-":
                got = f"({a[0]} - {b[1]})", f"({a[1]} - {b[0]})"
            elif not (_uniform(n.a) or _uniform(n.b)):
                return None  # q_idx * kv_idx: not affine
            else:
                ps = [f"({x} * {y})" for x in a for y in b]
                got = (f"{lo_fn}({lo_fn}({ps[0]}, {ps[1]}), {lo_fn}({ps[2]}, {ps[3]}))",
                       f"{hi_fn}({hi_fn}({ps[0]}, {ps[1]}), {hi_fn}({ps[2]}, {ps[3]}))")
        else:
            return None
        if got is not None:  # no int32 wrap anywhere in the element's computation
            conds.append(f"({got[0]} >= -2147483648) & ({got[1]} <= 2147483647)")
        return got

    for n in loads:
        ref = names[n.name]
        span = []
        for i, size, stride in zip(n.index, ref.sizes, ref.strides):
            b = bounds(i)
            if b is None:
                return None
            conds.append(f"({b[0]} >= 0) & ({b[1]} < {i64(size)})")
            span.append(f"({i64(size)} - 1) * {i64(stride)}")
        conds.append(f"({' + '.join(span) or '0'} <= 2147483647)")
    return " & ".join(dict.fromkeys(conds)) if loads else None


# [Note] Split offsets (variant bwd_mod_split, the Gluon backward's clamp-free reads). A clamp-free load's offset
# sum(index_d * stride_d) is computed per element as written: for a relative bias `bias[h, q_idx - kv_idx + c]`
# a subtraction, two adds, a multiply by the stride and the 64-bit address per score. Each index there is affine in
# q_idx and kv_idx (in_range's forms), and the kernel's positions are a tile-uniform base plus a vector of offsets
# (q_idx = m0 + r, kv_idx = n0 + c): the offset is the rows' part (the bases, the uniform terms and the keys'
# offsets, in int64: one pointer per held key) plus the queries' part, coefficient x stride x r, in int32, so each
# score costs one address add. The int32 part cannot wrap where in_range holds: with the key fixed, every query of
# the tile indexes inside the tensor, so |coefficient x r| <= size - 1 per dimension and the sum over dimensions is
# at most the offset span in_range bounds below 2^31. Where the host sees stride 1 in every dimension whose index
# reads q_idx (q_dims; the Gluon backward's MOD_FREE 2), split["unit"] leaves those strides out, and the per-score
# offsets are the layout's constants over one pointer per key: ptxas sm_90, the bench's relative bias, the compute
# loop 832 -> 537 SASS instructions and 101 -> 9 spill loads and stores in it (the plain kernel's: 446, 11).
def _affine(n: ir.Node, emit) -> dict | None:
    """{"q_idx": c, "kv_idx": c, "u": code} with n = c_q q_idx + c_kv kv_idx + u (codes; None: zero), or None
    where n is not such a form (in_range's: +, -, unary -, * by a uniform int)."""
    if n.type != ir.INT:
        return None
    if isinstance(n, ir.Input) and n.name in ("q_idx", "kv_idx"):
        return {n.name: "1"}
    if _uniform(n):
        return {"u": emit(n)}
    if isinstance(n, ir.Unary) and n.op == "neg":
        x = _affine(n.x, emit)
        return None if x is None else {k: f"(-{v})" for k, v in x.items()}
    if isinstance(n, ir.Binary) and n.op in ("+", "-"):
        a, b = _affine(n.a, emit), _affine(n.b, emit)
        if a is None or b is None:
            return None
        out = dict(a)
        for k, v in b.items():
            out[k] = (f"({out[k]} {n.op} {v})" if k in out else v if n.op == "+" else f"(-{v})")
        return out
    if isinstance(n, ir.Binary) and n.op == "*":
        for x, k in ((n.a, n.b), (n.b, n.a)):
            if _uniform(k):
                got = _affine(x, emit)
                return None if got is None else {key: f"({v} * {emit(k)})" for key, v in got.items()}
    return None


def q_dims(tree: ir.Node) -> list[tuple[str, int]] | None:
    """(tensor, dimension) of each load index that reads q_idx, where every load's indices are affine forms (the
    split offsets' per-element part: with those strides 1 on the host, split["unit"] drops them); None otherwise."""
    found = []
    for n in ir.walk(tree):
        if isinstance(n, ir.Load):
            for d, i in enumerate(n.index):
                form = _affine(i, lambda x: "x")
                if form is None:
                    return None
                if "q_idx" in form:
                    found.append((n.name, d))
    return list(dict.fromkeys(found))


def _emit(tree: ir.Node, names: dict, fl: _Flavour, unclamped: bool = False, split: dict | None = None) -> str:
    ns = fl.ns

    def as_type(node: ir.Node, want: str) -> str:
        code = emit(node)
        if node.type == want or (isinstance(node, ir.Const) and node.type != ir.BOOL):
            return code  # Python numbers take the tensor operand's type in Triton
        return f"({code}).to({fl.types[want]})"

    def emit(n: ir.Node) -> str:
        if isinstance(n, (ir.Input, ir.Scalar)):
            if n.name not in names:
                raise KeyError(f"to_triton/to_gluon: no kernel name given for {n.name!r}")
            return f"({names[n.name]})"
        if isinstance(n, ir.Const):
            return _const(n.value)
        if isinstance(n, ir.Load):
            return load(n)
        if isinstance(n, ir.Where):
            return f"{ns}.where({emit(n.cond)}, {as_type(n.a, n.type)}, {as_type(n.b, n.type)})"
        if isinstance(n, ir.Clamp):
            x, lo, hi = (as_type(c, n.type) for c in (n.x, n.lo, n.hi))
            return f"{ns}.minimum({ns}.maximum({x}, {lo}, {fl.nan}), {hi}, {fl.nan})"
        if isinstance(n, ir.Unary):
            if n.op == "neg":
                return f"(-{emit(n.x)})"
            if n.op == "invert":
                return f"({emit(n.x)} == 0)" if n.type == ir.BOOL else f"(~{emit(n.x)})"
            return f"{fl.fn[n.op]}({as_type(n.x, n.type)})"
        return binary(n)

    def binary(n: ir.Binary) -> str:
        if n.op in ("==", "!=") and _int_mod_of_zero(n):  # [Note] Cheaper forms
            mod = n.a if isinstance(n.a, ir.Binary) else n.b
            if fl is _TRITON and _uniform(mod.b):
                test = f"_mod_divisible({as_type(mod.a, ir.INT)}, {as_type(mod.b, ir.INT)})"
                return test if n.op == "==" else f"({test} == 0)"
            return f"(({as_type(mod.a, ir.INT)} % {as_type(mod.b, ir.INT)}) {n.op} 0)"
        if n.op in ir.COMPARE:
            common = ir.FLOAT if ir.FLOAT in (n.a.type, n.b.type) else ir.INT
            same = n.a.type == n.b.type
            a, b = (emit(n.a), emit(n.b)) if same else (as_type(n.a, common), as_type(n.b, common))
            return f"({a} {n.op} {b})"
        want = ir.FLOAT if n.op == "/" else n.type
        a, b = as_type(n.a, want), as_type(n.b, want)
        if n.op in ir.MINMAX:
            return f"{ns}.{n.op}({a}, {b}, {fl.nan})"
        if n.op == "/" and _uniform(n.b):  # [Note] Cheaper forms
            return f"({a} * (1.0 / {b}))"
        if n.type == ir.FLOAT and n.op == "//":
            return f"{ns}.floor({a} / {b})"
        if n.type == ir.FLOAT and n.op == "%":  # torch.remainder: a - b * floor(a / b)
            return f"({a} - {b} * {ns}.floor({a} / {b}))"
        if n.op == "//":
            return f"_mod_floordiv({a}, {b})"
        if n.op == "%":
            return f"_mod_floormod({a}, {b})"
        return f"({a} {n.op} {b})"

    def load(n: ir.Load) -> str:
        ref = names.get(n.name)
        if not isinstance(ref, TensorRef) or len(ref.strides) != len(n.index) or len(ref.sizes) != len(n.index):
            raise KeyError(f"to_triton/to_gluon: tensor {n.name!r} needs a TensorRef with {len(n.index)} strides and "
                           "sizes")
        forms = [_affine(i, emit) for i in n.index] if unclamped and split else []
        if forms and all(f is not None for f in forms):  # [Note] Split offsets
            rows, cols = [], []
            for f, stride in zip(forms, ref.strides):
                for key, c in f.items():
                    if key == "u":
                        rows.append(f"({stride}).to(gl.int64) * ({c})")
                        continue
                    base, local = split[key]
                    rows.append(f"({stride}).to(gl.int64) * ({base}) * ({c})")
                    if key == "q_idx" and split.get("unit"):  # the host saw stride 1 (q_dims)
                        cols.append(f"({c}) * ({local})")
                    else:
                        (rows if key == "kv_idx" else cols).append(f"(({c}) * {stride}) * ({local})")
            row = f"({ref.ptr} + ({' + '.join(rows)}))"
            value = f"{ns}.load({row} + ({' + '.join(cols)}))" if cols else f"{ns}.load({row})"
            return f"({value} != 0)" if n.type == ir.BOOL else f"{value}.to({fl.types[n.type]})"
        if unclamped:  # [Note] Clamp-free tiles
            offset = " + ".join(f"{emit(i)} * {stride}" for i, stride in zip(n.index, ref.strides))
        else:
            offset = " + ".join(f"_mod_index({emit(i)}, {size}) * {stride}"
                                for i, size, stride in zip(n.index, ref.sizes, ref.strides))
        value = f"{ns}.load({ref.ptr}{' + ' + offset if offset else ''})"
        if n.type == ir.BOOL:
            return f"({value} != 0)"
        return f"{value}.to({fl.types[n.type]})"

    return emit(tree)
