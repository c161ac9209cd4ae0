"""Lowering: user mods that are exactly a built-in mask, window or softcap become that switch, for its kernels.

[Note] Mod lowering. fagen.attention's modded path (fagen/runtime/modded.py) asks `lower` before it picks a
kernel. The traced trees are matched once per mods (memoised by their spec fields); each call then reads the
closure's current numbers and the call's shapes and decides:
  - a mask_mod that is a conjunction (`&`) of comparisons between `q_idx - kv_idx` and an int expression of
    constants and int closure numbers (`q_idx >= kv_idx`, `kv_idx <= q_idx`, attention-gym's
    `generate_sliding_window(w)`: `(q_idx - kv_idx <= w) & (q_idx >= kv_idx)`, `kv_idx - q_idx < w`, ...;
    `abs(q_idx - kv_idx) <= w` is two of them) bounds each row's keys to `q_idx - L <= kv_idx <= q_idx + R`.
    Where the built-in masks' bottom-right alignment is a host-known offset d (`i_aligned = q_idx + d`: dense
    mask none/causal d = Sk - Sq; padding, causal+padding and varlen d = 0 when the q and k lengths are one tensor
    object), that is the window (L + d, R - d); a right bound
    of 0 (or a built-in causal mask, which ANDs with it) is the causal mask, so `q_idx >= kv_idx` with Sq = Sk is
    mask="causal", and the sliding window is mask="causal", window=(w, 0). The other comparisons of the
    conjunction stay a (smaller) mask_mod. Not lowered: a bound that needs a negative window extent, a window
    when the call passes window= too, the tree mask, lengths that are two tensors, a block_mask with comparisons
    left over (it describes the whole mask_mod), and numbers past 2**24 (no int32 wrap in the mod's arithmetic
    then, so both paths compute the same bounds).
  - a score_mod that is exactly `cap * tanh(score / cap)` (either factor order, or `score * (1 / cap)`, cap one
    constant or one closure number, int or float) is softcap=cap when cap is a positive finite number and the
    call has no softcap or ALiBi switch (the score_mod sees the score after both, so the order would change).
    The softcap switch's tanh is the mods' (tanh.approx.f32 in fp16/bf16 kernels on CUDA).
  - a score_mod that is exactly ALiBi with a captured fp32 slope per query head, `score - slopes[h] *
    abs(q_idx - kv_idx)`, is alibi_slopes=slopes (the switch's `-slope[h] * |j - i_aligned|`) where the offset d
    is 0; `score + slopes[h] * (kv_idx - q_idx)` (no |.|) is the same only where every visible key has
    kv_idx <= q_idx, so it lowers under a causal mask (built-in or lowered) only. The tensor must be the switch's
    input: float32 [Hq] on q's device, and no gradient asked of it (the switch gives slopes none; the mods do).
    The call must have no ALiBi switch of its own (a softcap switch is fine: both orders are softcap, then ALiBi).
    The slope may also be an expression of h, constants and closure numbers (attention-gym's `(kv_idx - q_idx) *
    exp2(-((h + 1) * 8.0 / H))`): it is evaluated on the host per query head into the float32 [Hq] alibi_slopes
    ([Note] Host slopes), under the same conditions (so gym's form, without |.|, under a causal mask only).
  - three mask_mods become switch calls on views of q, k, v (fagen/mods/split.py's `run_split`, which
    fagen.attention's eager check runs, never the modded path): a window with `(q_idx - kv_idx) % d == 0` beside
    it, one window call over d strided subsequences ([Note] Dilated windows); attention-gym's prefix-LM mask, two
    calls on row slices ([Note] Prefix rows); a document mask, one varlen causal call over the documents' runs
    ([Note] Documents); each with gradients too (the switch calls' backwards).
Both paths give the same attention to rounding (the tests compare them and the float64 reference); the switch
kernels skip key blocks by interval reasoning and take the Gluon forward on sm_90. `FAGEN_MOD_LOWERING=0` (or
off, false, no; read at import) or `ENABLED = False` turns lowering off; the differential tests of mods against
the switch kernels run with it off.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import NamedTuple

from fagen.mods import ir
from fagen.mods.slopes import head_slopes  # noqa: F401  ([Note] Host slopes; runtime/modded.py calls it here)
from fagen.mods.text import to_text

ENABLED = os.environ.get("FAGEN_MOD_LOWERING", "1").strip().lower() not in ("0", "off", "false", "no")
LIMIT = 1 << 24  # (slopes.LIMIT is the same) |numbers|, Sq and Sk within which the mod's int32 arithmetic cannot wrap (64 leaves at most)
MAX_LEAVES = 64

_FLIP = {"<": ">=", "<=": ">", ">": "<=", ">=": "<"}  # ~(a < b) is a >= b on ints


@dataclasses.dataclass(frozen=True)
class Affine:
    """const + sum(coef * scalar): a bound, read per call from the closure's numbers."""
    const: int
    terms: tuple[tuple[str, int], ...]  # (int scalar name, coef), sorted

    def value(self, values: dict) -> int | None:
        total = self.const
        for name, coef in self.terms:
            x = values[name]
            if isinstance(x, bool) or not isinstance(x, int) or abs(x) > LIMIT:
                return None
            total += coef * x
        return total

    def shifted(self, sign: int, delta: int) -> Affine:
        """sign * self + delta."""
        return Affine(sign * self.const + delta, tuple((n, sign * c) for n, c in self.terms))


@dataclasses.dataclass(frozen=True)
class Plan:
    """What of one pair of traced mods matches a built-in: found once per mods, applied per call."""
    lefts: tuple[Affine, ...]  # kv_idx >= q_idx - L for each L
    rights: tuple[Affine, ...]  # kv_idx <= q_idx + R for each R
    mask_rest: ir.Node | None  # the mask_mod's other comparisons (None: the interval is all of it)
    cap: ir.Node | None  # the softcap's Const or Scalar when the score_mod is exactly a softcap
    alibi: tuple | None = None  # (slopes tensor name or h-tree, needs a causal mask, its numbers): exactly ALiBi
    dilation: Affine | None = None  # d where mask_rest is `(q_idx - kv_idx) % d == 0` (split.py: Dilated windows)
    prefix: Affine | None = None  # P where the mask_mod is `(kv_idx < P) | (q_idx >= kv_idx)` (split.py: Prefix rows)
    document: str | None = None  # T where it is `(T[q_idx] == T[kv_idx]) & (q_idx >= kv_idx)` (split.py: Documents)
    row_free: ir.Node | None = None  # `score + kv_idx * S` of an ALiBi `score + S * (kv_idx - q_idx)`, S of h only
    row_free_text: str | None = None  # to_text(row_free), made once: lower() runs on every call


class Lowering(NamedTuple):  # a tuple: built on every lowered call, where a frozen dataclass costs a microsecond
    """One call's lowering: run `mask` with `scores` added, and the mods left (fields None: nothing left)."""
    mask: str
    scores: dict
    fields: tuple | None  # (score_mod text, mask_mod text, tensors, scalars) of what is left
    names: tuple[str, ...]  # the captured values the mods left read
    mask_lowered: bool
    label: str  # what it became, e.g. "causal+window(1024,0)" or "softcap"
    split: tuple | None = None  # ("dilated", d), ("prefix", P), ("document", runs): run by split.run_split


_PLANS: dict[tuple, Plan | None] = {}


def plan(fields: tuple, score_tree: ir.Node | None, mask_tree: ir.Node | None) -> Plan | None:
    """The Plan of these mods (None: nothing lowers), memoised by their spec fields."""
    found = _PLANS.get(fields, _PLANS)  # one hash of the fields: the warm path's only work here
    if found is not _PLANS:
        return found
    lefts, rights, rest, cap = [], [], [], None
    if mask_tree is not None:
        for atom in _conjuncts(mask_tree):
            bounds = _bounds(atom)
            if bounds is None:
                rest.append(atom)
            else:
                lefts += bounds[0]
                rights += bounds[1]
    alibi = None
    if score_tree is not None:
        cap, alibi = _softcap(score_tree), _alibi(score_tree)
    found = None
    if lefts or rights or cap is not None or alibi is not None:
        mask_rest = None
        for atom in rest:
            mask_rest = atom if mask_rest is None else ir.binary("&", mask_rest, atom)
        row_free = None
        if alibi is not None and alibi[1] and not isinstance(alibi[0], str):  # [Note] ALiBi without its row term
            row_free = ir.binary("+", ir.Input("score", ir.FLOAT), ir.binary("*", ir.Input("kv_idx", ir.INT), alibi[0]))
        found = Plan(tuple(lefts), tuple(rights), mask_rest if lefts or rights else mask_tree, cap, alibi,
                     row_free=row_free, row_free_text=None if row_free is None else to_text(row_free))
    if len(_PLANS) >= 512:
        _PLANS.clear()
    _PLANS[fields] = found
    return found


def lower(p: Plan, fields: tuple, trees: tuple, values: dict, *, mask: str, offset: int | None, scores: dict,
          block_mask: bool, slopes_ok=None, host_slopes=None, score: bool = True, splits=None) -> Lowering | None:
    """This call's lowering of plan `p` (None: run the mods as they are). trees: the traced (score_mod, mask_mod);
    mask: the call's built-in mask (a string); offset: i_aligned - q_idx of the built-in mask for every row
    (`alignment`, None: not known on the host); scores: the call's switch keywords; block_mask: whether the call
    passes one; slopes_ok(tensor): whether a captured tensor can be the call's alibi_slopes (float32 [Hq] on q's
    device, no gradient asked of it); host_slopes(tree, names, values): the alibi_slopes tensor of a slope that is
    an expression of h ([Note] Host slopes in fagen/mods/slopes.py; `head_slopes` evaluates it), or None where it cannot be one; score:
    whether the score_mod may lower (False: only the mask_mod);
    splits(kind, arg): what split.run_split((kind, what), ...) takes for this call, or None (falsy) where the
    caller cannot run it ([Note] Dilated windows, [Note] Prefix rows, [Note] Documents in fagen/mods/split.py;
    splits None: no split at all)."""
    new_mask, add, labels = mask, {}, []
    mask_lowered = score_lowered = False
    split, mask_rest = None, p.mask_rest
    plain = splits is not None and offset == 0 and p.alibi is None \
        and not {"window", "alibi_slopes", "sinks"} & set(scores)
    if plain and p.document is not None and mask == "none":
        got = splits("document", values[p.document])
        if got:
            split, mask_rest, mask_lowered = ("document", got), None, True
            labels.append("documents+causal")
    if plain and p.prefix is not None and mask == "none":
        n = p.prefix.value(values)
        if n is not None and splits("prefix", n):
            split, mask_rest, mask_lowered = ("prefix", n), None, True
            labels.append(f"prefix({n})")
    if plain and p.dilation is not None and mask in ("none", "causal"):
        d = p.dilation.value(values)
        if d is not None and d >= 1 and splits("dilated", d):
            got = _window(p, values, mask, 0, False) if p.lefts or p.rights else (mask, None, mask)
            if got is not None:
                new_mask, window, label = got
                if window is not None:
                    window = tuple(None if x is None else x // d for x in window)  # d * |i - j| <= x
                    add["window"] = window
                labels.append(f"dilated({d})+{new_mask}"
                              + ("" if window is None else f"+window({window[0]},{window[1]})"))
                split, mask_rest, mask_lowered = ("dilated", d), None, True
    if not mask_lowered and (p.lefts or p.rights) and offset is not None \
            and not (block_mask and p.mask_rest is not None):
        got = _window(p, values, mask, offset, "window" in scores)
        if got is not None:
            new_mask, window, label = got
            if window is not None:
                add["window"] = window
            labels.append(label)
            mask_lowered = True
    if score and p.cap is not None and "softcap" not in scores and "alibi_slopes" not in scores:
        cap = p.cap.value if isinstance(p.cap, ir.Const) else values[p.cap.name]
        if not isinstance(cap, bool) and isinstance(cap, (int, float)) and math.isfinite(cap) and cap > 0:
            add["softcap"] = float(cap)
            labels.append("softcap")
            score_lowered = True
    if score and p.alibi is not None and "alibi_slopes" not in scores and offset == 0 \
            and (not p.alibi[1] or new_mask in ("causal", "causal+padding")):
        slope, slopes = p.alibi[0], None
        if isinstance(slope, str):
            slopes = values[slope] if slopes_ok is not None and slopes_ok(values[slope]) else None
        elif host_slopes is not None:  # [Note] Host slopes
            slopes = host_slopes(slope, p.alibi[2], values)
        if slopes is not None:
            add["alibi_slopes"] = slopes
            labels.append("alibi")
            score_lowered = True
    score_left = None if score_lowered else trees[0]
    if score_left is not None and p.row_free is not None and host_slopes is not None \
            and host_slopes(p.alibi[0], p.alibi[2], values) is not None:  # [Note] ALiBi without its row term
        score_left = p.row_free
        labels.append("alibi-rowfree")
    if not (mask_lowered or score_lowered or score_left is p.row_free is not None):
        return None
    mask_left = mask_rest if mask_lowered else trees[1]
    if score_left is None and mask_left is None:
        return Lowering(new_mask, add, None, (), mask_lowered, "+".join(labels), split)
    if split is not None:  # a score_mod left would see the positions the split changes
        return None
    scalars, tensors = set(), set()
    for tree in (score_left, mask_left):
        if tree is not None:
            s, t = ir.names_in(tree)
            scalars |= s
            tensors |= t
    left = (None if score_left is None else fields[0] if score_left is trees[0]
            else p.row_free_text if score_left is p.row_free else to_text(score_left),
            None if mask_left is None else fields[1] if mask_left is trees[1] else to_text(mask_left),
            tuple(t for t in fields[2] if t[0] in tensors), tuple(s for s in fields[3] if s[0] in scalars))
    return Lowering(new_mask, add, left, tuple(sorted(scalars | tensors)), mask_lowered, "+".join(labels))


def alignment(mask: str, seq_q: int, seq_k: int, lengths_q, lengths_k, packed: bool) -> int | None:
    """i_aligned - q_idx of the built-in masks (README: bottom-right) for every row of this call, where the host
    knows it: dense none/causal Sk - Sq; with lengths (padding masks, varlen) 0 when the q and k lengths are the
    same tensor object (each sequence then has as many queries as keys); otherwise None (the tree mask too)."""
    if max(seq_q, seq_k) > LIMIT:
        return None
    if packed or mask in ("padding", "causal+padding"):
        return 0 if lengths_q is lengths_k and lengths_q is not None else None
    if mask in ("none", "causal"):
        return seq_k - seq_q
    return None


def _window(p: Plan, values: dict, mask: str, offset: int, window_given: bool):
    """(mask, window or None, label) of the interval at this offset, or None where no built-in equals it."""
    lefts = [a.value(values) for a in p.lefts]
    rights = [a.value(values) for a in p.rights]
    if None in lefts or None in rights:
        return None
    left = min(lefts) + offset if lefts else None  # kv >= q - L = i_aligned - (L + d)
    right = min(rights) - offset if rights else None  # kv <= q + R = i_aligned + (R - d)
    causal = mask in ("causal", "causal+padding")
    if causal:
        if right is not None and right < 0:
            return None
        right = 0  # the built-in causal mask is the tighter bound (it ANDs with the mod)
    if left is not None and left < 0 or right is not None and right < 0:
        return None
    if right == 0:
        new_mask = {"none": "causal", "padding": "causal+padding"}.get(mask, mask)
        window = None if left is None else (left, 0)
    else:
        new_mask, window = mask, None if left is None and right is None else (left, right)
    if window is not None and window_given:
        return None  # two windows: not one switch
    parts = [new_mask] if right == 0 or window is None else []
    if window is not None:
        parts.append(f"window({left},{right})")
    return new_mask, window, "+".join(parts)


def _conjuncts(node: ir.Node) -> list[ir.Node]:
    """The operands of a tree of bool `&`s, left to right."""
    if isinstance(node, ir.Binary) and node.op == "&" and node.type == ir.BOOL:
        return _conjuncts(node.a) + _conjuncts(node.b)
    return [node]


def _bounds(atom: ir.Node):
    """([L], [R]) of one comparison of ±(q_idx - kv_idx) with constants and int scalars, or None."""
    if isinstance(atom, ir.Unary) and atom.op == "invert" and isinstance(atom.x, ir.Binary) \
            and atom.x.op in _FLIP:
        op, a, b = _FLIP[atom.x.op], atom.x.a, atom.x.b
    elif isinstance(atom, ir.Binary) and atom.op in _FLIP or isinstance(atom, ir.Binary) and atom.op == "==":
        op, a, b = atom.op, atom.a, atom.b
    else:
        return None
    if op in ("<", "<=") and isinstance(a, ir.Unary) and a.op == "abs" \
            or op in (">", ">=") and isinstance(b, ir.Unary) and b.op == "abs":
        band, u = (a.x, b) if op in ("<", "<=") else (b.x, a)  # |x| <= u: -u <= x <= u (a symmetric window)
        strict = "<" if op in ("<", ">") else "<="
        low, high = _bounds(ir.binary(strict, band, u)), _bounds(ir.binary(strict, ir.unary("neg", u), band))
        return None if low is None or high is None else (low[0] + high[0], low[1] + high[1])
    diff = _difference(a, b)
    if diff is None:
        return None
    sign = diff.pop("q_idx", 0)
    if sign not in (1, -1) or diff.pop("kv_idx", 0) != -sign:
        return None
    const = diff.pop(None, 0)
    if abs(const) > LIMIT:
        return None
    # sign * (q_idx - kv_idx) + t  OP  0, t = const + terms; u = -t
    u = Affine(-const, tuple(sorted((name, -c) for name, c in diff.items() if c)))
    lower_, upper = [], []
    if sign == 1:  # q - kv OP u
        if op in ("<=", "=="):
            lower_.append(u)  # kv >= q - u
        if op == "<":
            lower_.append(u.shifted(1, -1))
        if op in (">=", "=="):
            upper.append(u.shifted(-1, 0))  # kv <= q - u
        if op == ">":
            upper.append(u.shifted(-1, -1))
    else:  # kv - q OP u
        if op in ("<=", "=="):
            upper.append(u)  # kv <= q + u
        if op == "<":
            upper.append(u.shifted(1, -1))
        if op in (">=", "=="):
            lower_.append(u.shifted(-1, 0))  # kv >= q + u = q - (-u)
        if op == ">":
            lower_.append(u.shifted(-1, -1))
    return lower_, upper


def _difference(a: ir.Node, b: ir.Node) -> dict | None:
    """a - b as {leaf: coefficient} where both sides are linear (_linear) within MAX_LEAVES leaves together; else
    None."""
    la, lb = _linear(a), _linear(b)
    if la is None or lb is None or la[1] + lb[1] > MAX_LEAVES:
        return None
    diff = dict(la[0])
    for key, c in lb[0].items():
        diff[key] = diff.get(key, 0) - c
    return diff


def _linear(node: ir.Node):
    """({key: coef}, leaves) of an int expression of q_idx, kv_idx, int constants and int scalars with + and -
    (key: "q_idx", "kv_idx", a scalar's name, None for the constant), or None."""
    if node.type != ir.INT:
        return None
    if isinstance(node, ir.Input):
        return ({node.name: 1}, 1) if node.name in ("q_idx", "kv_idx") else None
    if isinstance(node, ir.Const):
        return ({None: node.value}, 1) if abs(node.value) <= LIMIT else None
    if isinstance(node, ir.Scalar):
        return {node.name: 1}, 1
    if isinstance(node, ir.Unary) and node.op == "neg":
        x = _linear(node.x)
        return None if x is None else ({k: -c for k, c in x[0].items()}, x[1])
    if isinstance(node, ir.Binary) and node.op in ("+", "-"):
        a, b = _linear(node.a), _linear(node.b)
        if a is None or b is None:
            return None
        out = dict(a[0])
        sign = 1 if node.op == "+" else -1
        for k, c in b[0].items():
            out[k] = out.get(k, 0) + sign * c
        return out, a[1] + b[1]
    return None


def _softcap(tree: ir.Node) -> ir.Node | None:
    """The cap (a Const or a Scalar) when `tree` is exactly cap * tanh(score / cap), else None."""
    if not (isinstance(tree, ir.Binary) and tree.op == "*"):
        return None
    for cap, t in ((tree.a, tree.b), (tree.b, tree.a)):
        if not (_is_cap(cap) and isinstance(t, ir.Unary) and t.op == "tanh"):
            continue
        x = t.x
        if isinstance(x, ir.Binary) and x.op == "/" and _is_score(x.a) and x.b == cap:
            return cap
        if isinstance(x, ir.Binary) and x.op == "*":
            for s, inv in ((x.a, x.b), (x.b, x.a)):
                if _is_score(s) and isinstance(inv, ir.Binary) and inv.op == "/" and inv.b == cap \
                        and isinstance(inv.a, ir.Const) and inv.a.value == 1 and inv.a.type != ir.BOOL:
                    return cap
    return None


def _is_cap(node: ir.Node) -> bool:
    return isinstance(node, ir.Scalar) or isinstance(node, ir.Const) and node.type != ir.BOOL


def _is_score(node: ir.Node) -> bool:
    return isinstance(node, ir.Input) and node.name == "score"


def _alibi(tree: ir.Node) -> tuple[str | ir.Node, bool, tuple[str, ...]] | None:
    """(slopes, causal only, scalar names) when `tree` is exactly ALiBi with a slope per query head: `score - S *
    abs(q_idx - kv_idx)` (any mask), or `score + S * (kv_idx - q_idx)` / `score - S * (q_idx - kv_idx)` (equal to
    it only where every visible key has kv_idx <= q_idx: under a causal mask). S is a captured fp32 tensor read at
    [h] (slopes: its name), or an expression of h, constants and closure numbers only (slopes: that tree, which
    `head_slopes` evaluates on the host; scalar names: the numbers it reads)."""
    if not isinstance(tree, ir.Binary) or tree.op not in ("+", "-"):
        return None
    pairs = [(tree.a, tree.b)] + ([(tree.b, tree.a)] if tree.op == "+" else [])
    for score, product in pairs:
        if not (_is_score(score) and isinstance(product, ir.Binary) and product.op == "*"):
            continue
        for slope, x in ((product.a, product.b), (product.b, product.a)):
            if isinstance(slope, ir.Load) and slope.dtype == "fp32" and len(slope.index) == 1 \
                    and isinstance(slope.index[0], ir.Input) and slope.index[0].name == "h":
                found, names = slope.name, ()
            elif _of_heads(slope):
                found, names = slope, tuple(sorted(ir.names_in(slope)[0]))
            else:
                continue
            if tree.op == "-" and isinstance(x, ir.Unary) and x.op == "abs" and _distance(x.x) in (1, -1):
                return found, False, names
            if _distance(x) == (1 if tree.op == "-" else -1):  # -(q - kv) = kv - q: -|kv - q| where kv <= q
                return found, True, names
    return None


_HEAD_OPS = {"+", "-", "*", "/", "//", "%", "minimum", "maximum", "neg", "abs"} | set(ir.FLOAT_FNS)


def _of_heads(node: ir.Node) -> bool:
    """Whether `node` is an int or float expression of h, constants and closure numbers with arithmetic,
    minimum/maximum and the float functions only (the ops `head_slopes` evaluates)."""
    if isinstance(node, ir.Input):
        return node.name == "h"
    if isinstance(node, (ir.Const, ir.Scalar)):
        return node.type != ir.BOOL
    if isinstance(node, (ir.Unary, ir.Binary)) and node.op in _HEAD_OPS and node.type != ir.BOOL:
        return all(_of_heads(c) for c in node.children())
    return False


# [Note] ALiBi without its row term. `score + S * (kv_idx - q_idx)` is `score + S * kv_idx` plus `-S * q_idx`,
# which is the same for every key of a row: softmax(x + c) = softmax(x), so out is the same, and so are dq, dk and
# dv (they depend on out and the probabilities only; the backward reads the lse its own forward wrote, which is
# shifted by the same c), where c is finite: S is checked on the host (`head_slopes`, |S| <= 2**100, so S * q_idx
# stays within fp32). fagen.attention returns out only, so where such an ALiBi (S an expression of h,
# constants and closure numbers: no tensor, so no gradient of S) does not become the switch, the mod left is
# `score + kv_idx * S`: one multiply-add per score instead of an int subtraction, an int-to-float conversion (a
# quarter-rate instruction on sm_90, next to the softmax's exp2) and a multiply-add. Rounding: the scores the
# kernel sees are `S * kv_idx` in size instead of `S * (kv_idx - q_idx)`, which is what the mod as written gives
# its first rows anyway (S * Sk at most), so the error bound is the mod's own worst row's.
def _distance(node: ir.Node) -> int | None:
    """1 for q_idx - kv_idx, -1 for kv_idx - q_idx (in any spelling + and - give), else None."""
    lin = _linear(node)
    if lin is None:
        return None
    terms = {k: c for k, c in lin[0].items() if c}
    return terms.get("q_idx") if terms in ({"q_idx": 1, "kv_idx": -1}, {"q_idx": -1, "kv_idx": 1}) else None
