"""Mods that lower to built-in switch calls on views of q, k, v rather than to one switch call (fagen/mods/lower.py
reads the plans; fagen.attention runs `run_split`): dilated windows, the prefix-LM mask and packed documents."""

from __future__ import annotations

import dataclasses
import weakref

from fagen.mods import ir
from fagen.mods import lower as lowering
from fagen.mods.lower import _FLIP, LIMIT, Affine, Plan, _bounds, _conjuncts, _difference, _distance

_PLANS: dict[tuple, Plan | None] = {}


def plan(fields: tuple, score_tree: ir.Node | None, mask_tree: ir.Node | None) -> Plan | None:
    """lower.plan's Plan of these mods with the splits this module matches (Plan.dilation, Plan.prefix), memoised
    by the fields; what fagen.attention's lowering reads (fagen/runtime/modded.py)."""
    found = _PLANS.get(fields, _PLANS)
    if found is not _PLANS:
        return found
    found = lowering.plan(fields, score_tree, mask_tree)
    if mask_tree is not None:
        atoms = _conjuncts(mask_tree)
        rest = [a for a in atoms if _bounds(a) is None]
        d = dilation(rest[0]) if len(rest) == 1 else None
        p = prefix(mask_tree) if len(atoms) == 1 else None
        doc = document(mask_tree)
        if d is not None or p is not None or doc is not None:
            found = dataclasses.replace(found, dilation=d, prefix=p, document=doc) if found is not None else Plan(
                (), (), mask_tree, None, None, d, p, doc)
    if len(_PLANS) >= 512:
        _PLANS.clear()
    _PLANS[fields] = found
    return found


def prefix(tree: ir.Node) -> Affine | None:
    """P when `tree` is `(kv_idx < P) | (q_idx >= kv_idx)` (either order; any spelling of the two comparisons that
    _bounds and _key_limit read), P an int expression of constants and int scalars ([Note] Prefix rows)."""
    if not (isinstance(tree, ir.Binary) and tree.op == "|" and tree.type == ir.BOOL):
        return None
    for causal, limit in ((tree.a, tree.b), (tree.b, tree.a)):
        if _bounds(causal) == ([], [Affine(0, ())]):
            found = _key_limit(limit)
            if found is not None:
                return found
    return None


def _key_limit(atom: ir.Node) -> Affine | None:
    """P when `atom` is kv_idx < P in any spelling (`kv_idx <= P - 1`, `P > kv_idx`, `~(kv_idx >= P)`), else None."""
    if isinstance(atom, ir.Unary) and atom.op == "invert" and isinstance(atom.x, ir.Binary) and atom.x.op in _FLIP:
        op, a, b = _FLIP[atom.x.op], atom.x.a, atom.x.b
    elif isinstance(atom, ir.Binary) and atom.op in _FLIP:
        op, a, b = atom.op, atom.a, atom.b
    else:
        return None
    diff = _difference(a, b)
    if diff is None:
        return None
    sign = diff.pop("kv_idx", 0)
    if sign not in (1, -1) or diff.pop("q_idx", 0):
        return None
    const = diff.pop(None, 0)
    if abs(const) > LIMIT:
        return None
    t = Affine(const, tuple(sorted((name, c) for name, c in diff.items() if c)))  # sign * kv_idx + t OP 0
    if sign == 1:
        return {"<": t.shifted(-1, 0), "<=": t.shifted(-1, 1)}.get(op)  # kv < -t, kv <= -t
    return {">": t, ">=": t.shifted(1, 1)}.get(op)  # kv < t, kv <= t


# [Note] Prefix rows. attention-gym's prefix-LM mask `(kv_idx < P) | (q_idx >= kv_idx)` with Sq = Sk = S and no
# built-in mask: a row q < P sees exactly the keys kv < P (kv <= q < P adds none), a row q >= P exactly kv <= q
# (kv < P <= q adds none). So the rows [0, P) are mask "none" over the keys [0, P), and the rows [P, S) are the
# built-in causal mask over all S keys (bottom-right aligned: row i of that call is q = P + i = i + Sk - Sq). Two
# switch calls on slices of q, k, v and a concatenation of their outs (`run_split`), each on the plain kernels'
# full tiles, where the modded kernel runs the prefix blocks through its block mask's lists. P is read per call
# (a closure number); P <= 1 is the causal mask alone, P >= S the full one. With gradients too: the two calls'
# backwards (the switch kernels' dK/dV and dQ) in one autograd node that adds the first's dK, dV (keys [0, P)) into
# the second's (all keys), one in-place add of [B, Hkv, P, D] beside two backwards on full tiles ([Note] Split
# gradients).


def dilation(atom: ir.Node) -> Affine | None:
    """d when `atom` is `x % d == 0` (or `0 == x % d`) with x = ±(q_idx - kv_idx) or its abs, d an int constant or
    one int scalar: q_idx and kv_idx in the same residue class mod d ([Note] Dilated windows)."""
    if not (isinstance(atom, ir.Binary) and atom.op == "=="):
        return None
    for rem, zero in ((atom.a, atom.b), (atom.b, atom.a)):
        if not (isinstance(zero, ir.Const) and zero.type == ir.INT and zero.value == 0
                and isinstance(rem, ir.Binary) and rem.op == "%"):
            continue
        x, d = rem.a, rem.b
        if isinstance(x, ir.Unary) and x.op == "abs":
            x = x.x
        if _distance(x) is None:
            continue
        if isinstance(d, ir.Const) and d.type == ir.INT and 1 <= d.value <= LIMIT:
            return Affine(d.value, ())
        if isinstance(d, ir.Scalar) and d.type == ir.INT:
            return Affine(0, ((d.name, 1),))
    return None


# [Note] Dilated windows. A mask_mod that bounds q_idx - kv_idx (a window, causal or not) and asks
# `(q_idx - kv_idx) % d == 0` (attention-gym's dilated sliding window: `abs(q_idx - kv_idx) % dilation == 0`) lets
# a query see only keys of its own residue class mod d. With Sq = Sk = S, d dividing S, q = d * i + r and kv =
# d * j + r, the bounds `q - L <= kv <= q + R` are `i - L // d <= j <= i + R // d`: the d subsequences x[:, :, r::d]
# are d independent problems of S / d rows with the window (L // d, R // d) (causal stays causal). One switch call
# runs them all on strided views, no copy: x [B, H, S, D] as [B * H, d, S / d, D] (batch b * H + h, head r, row
# i), which needs Hq = Hkv (the kernel's GQA maps head r to kv head r // gqa) and B and H mergeable in one stride
# (`splittable`). The kernel then visits the visible pairs only, where the mod's kernel computes d pairs for each
# visible one inside its window's blocks. fagen.attention takes this path eagerly (modded.as_switches); out comes
# back through the inverse view, and autograd sees views and one switch call, so the backward is the switch's too.
# Not with ALiBi or sinks (positions and heads change), a window of the call's own, or anything left of the mods.


def document(tree: ir.Node) -> str | None:
    """T where `tree`, as the kernels compute it ([Note] Mask algebra in simplify.py: attention-gym's
    generate_doc_mask_mod(causal_mask, offsets) becomes this), is `(T[q_idx] == T[kv_idx]) & (q_idx >= kv_idx)`
    with T a captured int tensor of rank 1 ([Note] Documents)."""
    from fagen.mods.simplify import simplify

    tree = simplify(tree)
    if not (isinstance(tree, ir.Binary) and tree.op == "&" and tree.type == ir.BOOL):
        return None
    for eq, causal in ((tree.a, tree.b), (tree.b, tree.a)):
        if _bounds(causal) != ([], [Affine(0, ())]) or not (isinstance(eq, ir.Binary) and eq.op == "=="):
            continue
        a, b = eq.a, eq.b
        if isinstance(a, ir.Load) and isinstance(b, ir.Load) and a.name == b.name and a.type == ir.INT \
                and len(a.index) == 1 and {a.index[0], b.index[0]} == {ir.Input("q_idx", ir.INT),
                                                                       ir.Input("kv_idx", ir.INT)}:
            return a.name
    return None


# [Note] Documents. A mask `(T[q_idx] == T[kv_idx]) & (q_idx >= kv_idx)` over Sq = Sk = S, where each value of
# T[:S] fills one contiguous run of positions (packed documents: attention-gym's document ids), is the varlen
# layout's causal mask with one sequence per run: cu_seqlens = the runs' bounds. Built on q's device once per
# tensor object and version (`_runs`: one host sync for the check and the longest run, then kept beside a weak
# reference to T, so an in-place change of T or a new tensor is read again; a T made under torch.inference_mode has
# no version counter and is read every call), and run as one varlen call on
# views: q [1, H, S, D] as q.squeeze(0).transpose(0, 1), [S, H, D] (fagen's varlen takes any row and head strides).
# The varlen kernel tiles each document on its own (causal, bottom-right = top-left since each has as many
# queries as keys), where the modded kernel runs 64 x 64 tiles across document bounds with the mask per element.
# With gradients too: the varlen causal backward on the same views (autograd takes dq, dk, dv back through them;
# T, an int tensor, gets none), which tiles each document on its own as the forward does. B = 1 (a batch of such
# views is no one tensor), T at least S long (past its end the kernel clamps where torch raises); runs that repeat
# a value (T = [0, 0, 1, 0]) are not documents and keep the mod. Not while a CUDA graph captures: the check syncs,
# and a replay would keep the captured runs where the mod's kernel reads T again.
_RUNS: dict[int, tuple] = {}


def _runs(t, s: int):
    """(cu_seqlens int32 [n + 1], longest run) of t[:s]'s runs, or None where a value fills two runs."""
    keep = not t.is_inference()  # an inference tensor has no version counter: read every call, never kept
    hit = _RUNS.get(id(t)) if keep else None
    if hit is not None and hit[0]() is t and hit[1] == (t._version, s):
        return hit[2]
    import torch

    x = t[:s]
    starts = torch.nonzero(x[1:] != x[:-1]).flatten() + 1
    cu = torch.cat([starts.new_zeros(1), starts, starts.new_full((1,), s)]).to(torch.int32)
    found = (cu, int((cu[1:] - cu[:-1]).max())) if torch.unique(x).numel() == cu.numel() - 1 else None
    if keep:
        if len(_RUNS) >= 64:
            _RUNS.clear()
        _RUNS[id(t)] = (weakref.ref(t), (t._version, s), found)
    return found


def splittable(kind: str, arg, q, k, v, grad: bool):
    """What `run_split((kind, what), ...)` takes for fagen.attention's dense call on q, k, v [B, H, S, D] (arg: the
    dilation, the prefix length, the document tensor): True (the dilation and prefix take arg itself) or the
    document runs; None where it cannot serve the call. Every split serves gradients too (grad: whether the call
    asks for them, which no split refuses now)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or q.shape[2] != k.shape[2] or k.shape[:3] != v.shape[:3]:
        return None
    if kind == "document":
        if q.shape[0] != 1 or arg.dim() != 1 or arg.shape[0] < q.shape[2] or arg.device != q.device:
            return None
        if arg.is_cuda:
            import torch

            if torch.cuda.is_current_stream_capturing():  # a graph would replay these runs: keep the mod
                return None
        return _runs(arg, q.shape[2])
    if kind == "prefix":  # with a gradient too: the two calls' backwards, dK and dV summed ([Note] Prefix rows)
        return True
    if q.shape[1] != k.shape[1] or q.shape[2] % arg:
        return None
    return True if all(x.shape[0] == 1 or x.stride(0) == x.shape[1] * x.stride(1) for x in (q, k, v)) else None


def run_split(split: tuple, attention, q, k, v, *, mask: str, resolve=None, bwd_min_work=None, **kw):
    """out of the mods lowered to `split` ([Note] Dilated windows, [Note] Prefix rows, [Note] Documents):
    `attention` (fagen.attention) called on views of q, k, v with the lowered `mask` and the switch keywords `kw`;
    resolve (fagen.runtime.resolve's, which this layer may not import): the prefix split's modules with gradients
    ([Note] Split gradients; None: two fagen.attention calls); bwd_min_work (hopper.BWD_MIN_WORK, None: never):
    the pairs from which one of those calls asks resolve for its big_bwd module ([Note] Split calls' backward)."""
    kind, n = split
    b, h, s, _ = q.shape
    if kind == "dilated":
        out = attention(_strided(q, n), _strided(k, n), _strided(v, n), mask=mask, **kw)
        return out.transpose(1, 2).reshape(b, h, s, out.shape[-1])  # a view where out's layout allows
    if kind == "document":  # squeeze, not [0]: its backward is a view too ([Note] Split gradients)
        cu, longest = n
        out = attention(q.squeeze(0).transpose(0, 1), k.squeeze(0).transpose(0, 1), v.squeeze(0).transpose(0, 1),
                        mask="causal", cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
                        max_seqlen_k=longest, **kw)
        return out.transpose(0, 1).unsqueeze(0)
    p = min(max(n, 0), s)
    if p <= 1 or p == s:  # kv_idx < 1 adds nothing to the causal mask; P >= S: every row a prefix row
        return attention(q, k, v, mask="causal" if p <= 1 else "none", **kw)
    import torch

    if resolve is not None and torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad) \
            and kw.get("window") is None:
        switches = ("softcap",) if kw.get("softcap") is not None else ()
        big = [bwd_min_work is not None and b * h * rows * keys >= bwd_min_work for rows, keys in ((p, p), (s - p, s))]
        mods = (resolve(q[:, :, :p], k[:, :, :p], v[:, :, :p], "none", False, switches, False, big[0]),
                resolve(q[:, :, p:], k, v, "causal", False, switches, False, big[1]))
        return _Prefix.apply(q, k, v, p, mods, {name: x for name, x in kw.items() if x is not None})
    top = attention(q[:, :, :p], k[:, :, :p], v[:, :, :p], mask="none", **kw)
    return torch.cat([top, attention(q[:, :, p:], k, v, mask="causal", **kw)], dim=2)


# [Note] Split calls' backward. fagen.attention takes the Gluon backward (sm_90) for a call of at least
# hopper.BWD_MIN_WORK query-key pairs (its host path costs more than the Triton one's); the prefix split asks per
# call the same way, with the call's own pairs: at B1 H16 S8192 and P = S / 4 (the bench's prefix-LM row) the causal
# rows [P, S) over all keys are 1.5 x 2^29 pairs and take it, the "none" call over [0, P) (2^26) keeps the Triton
# backward. Without bwd_min_work (the caller's choice) both keep the Triton modules, as before.
#
# [Note] Split gradients. Autograd through slices and selects of a leaf is not free: the backward of x[:, :, :p]
# (and of x[0]) allocates a zero tensor of x's whole shape, copies the slice's gradient in and adds it to the
# others', several passes over [B, H, S, D] per input beside a backward that reads each once or twice. So the
# document split views q, k, v through squeeze and transpose (their backwards are views), and the prefix split with
# gradients is one autograd.Function (_Prefix) over the two switch modules' forward and backward: dq is the two
# calls' dq concatenated, dk and dv the causal call's with the prefix call's added into rows [0, P) in place.
# [Note] Prefix rows in one backward (tenth session). The split's backward runs two modules' backwards on slices:
# the causal call's q and dO rows [P, S) are copied to dense tensors (its kernels read dense [B, H, S, D]), dq is
# concatenated, dK and dV of the prefix call added into the causal call's. A Gluon causal render with variant
# bwd_prefix (fagen/templates/gluon/backward.py.j2, [Note] Prefix rows in the backward) takes the prefix length
# at run time and computes the mask `kv < P or kv <= q` itself: one backward over the whole q, k, v, dO with the
# two forwards' out and lse concatenated (out as returned, lse [B, H, S]), no copies, no adds. PREFIX_ONE_BWD
# (on since the tenth session's H100 rounds: 1.15-1.22x Flex against 1.00x) takes it where the causal call's module is such a render (BWD_PREFIX == 1),
# in the render's BWD_PREFIX_MODE: with bwd_prefix 2 the fixed-point dQ (mode 2, deterministic, rendered beside the
# chain that the plain causal calls keep). Since the eleventh session the d128 default (the fixed-point dQ with its
# qmul rows by TMA) carries the prefix too (variant bwd_prefix_tma): 1.34-1.37x Flex on the H100.
PREFIX_ONE_BWD = True


def _one_backward(low, do, q, k, v, out, lse, p, kw):
    """(dq, dk, dv, None, None, None) of the prefix rows from one launch of `low`'s backward with prefix P (its
    launch_prefix_backward, in its BWD_PREFIX_MODE: with bwd_prefix 2 the fixed-point dQ, deterministic)."""
    return (*low.launch_prefix_backward(do, q, k, v, out, lse, p, scale=kw.get("scale")), None, None, None)


def _prefix_class():
    import torch

    class Prefix(torch.autograd.Function):
        """out of the prefix rows ([Note] Prefix rows) as one autograd node ([Note] Split gradients): mods = the
        bwd modules of the "none" call (rows and keys [0, P)) and of the "causal" call (rows [P, S), all keys)."""

        @staticmethod
        def forward(ctx, q, k, v, p, mods, kw):
            top, low = mods
            out_t, lse_t = top.forward(q[:, :, :p], k[:, :, :p], v[:, :, :p], **kw)
            out_b, lse_b = low.forward(q[:, :, p:], k, v, **kw)
            out = torch.cat([out_t, out_b], dim=2)
            ctx.one = PREFIX_ONE_BWD and getattr(low, "BWD_PREFIX", 0) == 1  # [Note] Prefix rows in one backward
            if ctx.one:
                ctx.save_for_backward(q, k, v, out, torch.cat([lse_t, lse_b], dim=2))
            else:
                ctx.save_for_backward(q, k, v, out_t, lse_t, out_b, lse_b)
            ctx.p, ctx.mods, ctx.kw = p, mods, kw
            return out

        @staticmethod
        def backward(ctx, do):
            if ctx.one:
                return _one_backward(ctx.mods[1], do, *ctx.saved_tensors, ctx.p, ctx.kw)
            q, k, v, out_t, lse_t, out_b, lse_b = ctx.saved_tensors
            p, (top, low), kw = ctx.p, ctx.mods, ctx.kw
            do = do.to(q.dtype)
            dq_t, dk_t, dv_t = top.backward(do[:, :, :p], q[:, :, :p], k[:, :, :p], v[:, :, :p], out_t, lse_t,
                                            **kw)[:3]
            dq_b, dk, dv = low.backward(do[:, :, p:], q[:, :, p:], k, v, out_b, lse_b, **kw)[:3]
            dk[:, :, :p] += dk_t
            dv[:, :, :p] += dv_t
            return torch.cat([dq_t, dq_b], dim=2), dk, dv, None, None, None

    return Prefix


class _Lazy:
    """_Prefix: the autograd.Function made on first use (`import fagen` must not import torch)."""
    cls = None

    def apply(self, *args):
        if _Lazy.cls is None:
            _Lazy.cls = _prefix_class()
        return _Lazy.cls.apply(*args)


_Prefix = _Lazy()


def _strided(x, d: int):
    """[B, H, S, D] as [B * H, d, S / d, D]: element (b * H + h, r, i) is x[b, h, d * i + r] (a view)."""
    b, h, s, e = x.shape
    return x.view(b * h, s // d, d, e).transpose(1, 2)
