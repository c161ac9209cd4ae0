"""Properties of generated kernels, checked against the float64 reference, and their registry."""

from __future__ import annotations

import dataclasses
import math
from types import ModuleType
from typing import Callable

import torch
from hypothesis import strategies as st

from fagen.runtime.loader import load
from fagen.spec.axes import DType, Kind, Mask
from fagen.spec.kernel import KernelSpec
from fagen.spec.tables import TORCH_DTYPE
from fagen.verify import reference, strategies
from fagen.verify.strategies import Problem
from fagen.verify.tolerances import (GRAD_TOLERANCE, LSE_TOLERANCE, PAIR, TOLERANCE, Outcome, PropertyFailure, compare,
                                     compare_grad, compare_pair, compare_pair_lse, check_finite)

SCORE_KWARGS = ("window", "softcap", "alibi_slopes", "sinks")


def _scale_of(kwargs: dict) -> dict:
    """The problem's softmax scale and score inputs as kwargs for a related run: every half, twin or slice uses
    the same scale, window, cap, slopes and sinks."""
    return {key: kwargs[key] for key in ("scale", *SCORE_KWARGS, "k_scale", "v_scale") if key in kwargs}


def _run(module, q, k, v, what="forward", **kwargs):
    out, lse = module.forward(q, k, v, **kwargs)
    check_finite(out, lse, what)
    return out, lse


def check_forward(module, spec: KernelSpec, problem: Problem, device: str = "cpu") -> Outcome:
    """forward() of a loaded module matches the float64 reference, with no NaN or inf, on one problem."""
    (q, k, v), kwargs = problem.inputs(spec, device)
    ref_kwargs = kwargs
    if spec.shared_kv:  # one latent cache: V is k's first head_dim_v columns, under k's scale (README "MLA ...")
        v, kwargs = None, {name: value for name, value in kwargs.items() if name != "v_scale"}
        ref_kwargs = dict(kwargs, head_dim_v=spec.head_dim_v)
    out, lse = _run(module, q, k, v, **kwargs)
    if out.dtype != q.dtype or lse.dtype != torch.float32:
        raise PropertyFailure(f"dtypes: out {out.dtype} (want {q.dtype}), lse {lse.dtype} (want float32)")
    ref_out, ref_lse = reference.attention(q, k, v, mask=spec.mask, **ref_kwargs)  # kwargs carry the scale too
    err = compare("out", out, ref_out, **TOLERANCE[spec.dtype])
    lse_err = compare("lse", lse, ref_lse, **LSE_TOLERANCE)
    return Outcome(max_err=err, max_lse_err=lse_err if math.isfinite(lse_err) else 0.0)


# -- properties beyond "matches the reference" -----------------------------------------------------------
# Each takes (module, spec, problem, device), returns the Outcome (worst errors) and raises PropertyFailure
# with a precise message. Kernels other than `module` that a property compares against are plain renders
# loaded through fagen.runtime.loader. Properties that need a particular problem shape (a chain, a star) say so
# with ValueError; fagen.verify.engine draws problems of that shape.

def _related(spec: KernelSpec, **fields):
    """The plain kernel of `spec` with some fields changed (the MHA twin, the causal twin, ...)."""
    return load(dataclasses.replace(spec, **fields))


def check_gqa(module, spec: KernelSpec, problem: Problem, device: str = "cpu") -> Outcome:
    """A gqa-g kernel equals the MHA kernel (gqa=1, same other fields) on K/V repeated g times."""
    if spec.gqa == 1:
        raise ValueError("the gqa property needs a spec with gqa > 1")
    (q, k, v), kwargs = problem.inputs(spec, device)
    out, lse = _run(module, q, k, v, **kwargs)
    rep = lambda t: t.repeat_interleave(spec.gqa, dim=1)  # noqa: E731 - query head h meets KV head h // g
    twin_kwargs = {name: (value.repeat_interleave(spec.gqa) if name in ("k_scale", "v_scale")
                          and isinstance(value, torch.Tensor) else value) for name, value in kwargs.items()}
    want, want_lse = _run(_related(spec, gqa=1), q, rep(k), rep(v), "MHA twin", **twin_kwargs)
    return Outcome(compare_pair(f"out vs the MHA kernel on K/V repeated {spec.gqa}x", out, want, spec.dtype),
                   compare_pair_lse("lse vs the MHA kernel", lse, want_lse))


def chain(n: int) -> tuple[int, ...]:
    """Parent pointers of a chain: node i's parent is i - 1."""
    return tuple(range(-1, n - 1))


def check_tree_chain(module, spec: KernelSpec, problem: Problem, device: str = "cpu") -> Outcome:
    """A chain-shaped tree is causal attention: node i sees the prefix and nodes 0..i, i.e. j <= i + Sk - Sq."""
    if problem.parents is None or any(p != chain(problem.seq_q) for p in problem.parents):
        raise ValueError("the tree-chain property needs chain-shaped parents")
    (q, k, v), kwargs = problem.inputs(spec, device)
    out, lse = _run(module, q, k, v, **kwargs)
    want, want_lse = _run(_related(spec, mask=Mask.CAUSAL), q, k, v, "causal twin", **_scale_of(kwargs))
    return Outcome(compare_pair("out vs the causal kernel on a chain-shaped tree", out, want, spec.dtype),
                   compare_pair_lse("lse vs the causal kernel", lse, want_lse))


def star_kind(parents: tuple[int, ...]) -> str | None:
    """'roots' (every node a root), 'fan' (every node a child of node 0), or None for any other shape."""
    if all(p == -1 for p in parents):
        return "roots"
    if parents[0] == -1 and all(p == 0 for p in parents[1:]):
        return "fan"
    return None


def check_tree_star(module, spec: KernelSpec, problem: Problem, device: str = "cpu") -> Outcome:
    """A star-shaped tree sees only the prefix, node 0 (for a fan) and itself: against a direct computation."""
    kinds = [star_kind(p) for p in problem.parents or ()]
    if not kinds or None in kinds:
        raise ValueError("the tree-star property needs star-shaped parents (all roots, or all children of 0)")
    (q, k, v), kwargs = problem.inputs(spec, device)
    out, lse = _run(module, q, k, v, **kwargs)
    prefix, n = problem.seq_k - problem.seq_q, problem.seq_q
    vis = torch.zeros(problem.batch, n, problem.seq_k, dtype=torch.bool, device=q.device)
    vis[:, :, :prefix] = True
    nodes = torch.arange(n, device=q.device)
    vis[:, nodes, prefix + nodes] = True  # itself
    for b, kind in enumerate(kinds):
        vis[b, :, prefix] |= kind == "fan"  # node 0, the root of a fan
    # Direct float64 softmax: every row sees at least itself, so no row is empty.
    q64, k64, v64 = (t.double() for t in (q, k, v))
    s = q64 @ k64.repeat_interleave(spec.gqa, 1).transpose(-1, -2) * kwargs.get("scale", spec.head_dim ** -0.5)
    s = s.masked_fill(~vis[:, None], float("-inf"))
    want = torch.softmax(s, -1) @ v64.repeat_interleave(spec.gqa, 1)
    return Outcome(compare(f"out vs direct attention on star trees {kinds}", out, want, **TOLERANCE[spec.dtype],
                           expected="direct"),
                   compare("lse vs direct attention", lse, torch.logsumexp(s, -1), **LSE_TOLERANCE, expected="direct"))


def _valid_rows(problem: Problem, device) -> torch.Tensor:
    """bool [B, 1, Sq]: query rows inside each sequence's length."""
    rows = torch.arange(problem.seq_q, device=device)
    return (rows[None, :] < torch.tensor(problem.seqlens_q, device=device)[:, None]).unsqueeze(1)


def _check_padded_rows(out, lse, problem: Problem, what: str) -> None:
    """Padded query rows give exactly out = 0 and lse = -inf."""
    pad = ~_valid_rows(problem, out.device)
    bad = pad.unsqueeze(-1) & (out != 0)
    if bad.any():
        idx = tuple(bad.nonzero()[0].tolist())
        raise PropertyFailure(f"{what}: padded row {idx[:3]} has out {out[idx].item():.6g} (must be 0; "
                              f"seqlens_q {problem.seqlens_q})")
    bad = pad.expand_as(lse) & (lse != float("-inf"))
    if bad.any():
        idx = tuple(bad.nonzero()[0].tolist())
        raise PropertyFailure(f"{what}: padded row {idx} has lse {lse[idx].item():.6g} (must be -inf)")


def check_padding_split(module, spec: KernelSpec, problem: Problem, device: str = "cpu") -> Outcome:
    """A padded batch equals each sequence run alone at its own lengths (padding -> none, causal+padding -> causal)."""
    (q, k, v), kwargs = problem.inputs(spec, device)
    out, lse = _run(module, q, k, v, **kwargs)
    _check_padded_rows(out, lse, problem, "padded batch")
    alone = _related(spec, mask=Mask.CAUSAL if spec.mask.causal else Mask.NONE)
    err = lse_err = 0.0
    for b, (lq, lk) in enumerate(zip(problem.seqlens_q, problem.seqlens_k)):
        o, lo = _run(alone, q[b:b + 1, :, :lq], k[b:b + 1, :, :lk], v[b:b + 1, :, :lk], f"sequence {b} alone",
                     **_scale_of(kwargs))
        where = f"batch entry {b} (seqlens_q {lq}, seqlens_k {lk})"
        err = max(err, compare_pair(f"out of {where} vs the sequence alone", out[b:b + 1, :, :lq], o, spec.dtype))
        lse_err = max(lse_err, compare_pair_lse(f"lse of {where} vs the sequence alone", lse[b:b + 1, :, :lq], lo))
    return Outcome(err, lse_err)


def check_padding_garbage(module, spec: KernelSpec, problem: Problem, device: str = "cpu") -> Outcome:
    """Garbage in the padded part of q, k, v (random values, then NaN) never changes a valid output bit."""
    runs = []
    for poison in (False, True):
        (q, k, v), kwargs = dataclasses.replace(problem, poison=poison).inputs(spec, device)
        out, lse = _run(module, q, k, v, "NaN-padded inputs" if poison else "forward", **kwargs)
        _check_padded_rows(out, lse, problem, "NaN-padded inputs" if poison else "random-padded inputs")
        runs.append((out, lse))
    (out, lse), (out_nan, lse_nan) = runs
    valid = _valid_rows(problem, out.device)
    for name, a, b in (("out", out, out_nan), ("lse", lse, lse_nan)):
        differ = (a != b) & (valid.unsqueeze(-1) if name == "out" else valid)
        if differ.any():
            idx = tuple(differ.nonzero()[0].tolist())
            raise PropertyFailure(f"{name} at valid position {idx} is {a[idx].item():.6g} with random padding but "
                                  f"{b[idx].item():.6g} with NaN padding ({int(differ.sum())} entries differ)")
    return Outcome(0.0, 0.0)


def _interpreted(module) -> bool:
    """Whether a loaded module runs through Triton's interpreter (its _INTERPRET flag, read at import)."""
    return bool(getattr(module, "_INTERPRET", False))


def check_nan_propagates(module, spec: KernelSpec, problem: Problem, device: str = "cpu") -> Outcome:
    """NaN in one valid key reaches exactly the rows that see it, as NaN in out and lse (as in the float64
    reference and SDPA); every other row is unchanged. Silent zeros would hide a caller's bug."""
    (q, k, v), kwargs = problem.inputs(spec, device)
    limit = problem.seqlens_k[0] if problem.seqlens_k is not None else problem.seq_k
    if not (problem.batch and problem.heads_kv and limit and problem.seq_q):
        return Outcome(0.0, 0.0)  # no valid key to poison: nothing to show
    j = problem.seed % limit
    k = k.clone()
    k[0, 0, j, problem.seed % spec.head_dim] = float("nan")
    out, lse = module.forward(q, k, v, **kwargs)
    ref_out, ref_lse = reference.attention(q, k, v, mask=spec.mask, **kwargs)
    if not torch.isnan(ref_lse).any() and torch.isnan(lse).any():
        raise PropertyFailure("lse: NaN although no row sees the NaN key")
    err = compare("out (NaN in one valid key)", out, ref_out, **TOLERANCE[spec.dtype])
    lse_err = compare("lse (NaN in one valid key)", lse, ref_lse, **LSE_TOLERANCE)
    return Outcome(max_err=err, max_lse_err=lse_err if math.isfinite(lse_err) else 0.0)


def check_permutation(module, spec: KernelSpec, problem: Problem, device: str = "cpu") -> Outcome:
    """Non-causal attention is a sum over keys: permuting keys and values together changes nothing."""
    if spec.mask is not Mask.NONE:
        raise ValueError("the permutation property holds for mask 'none' only")
    (q, k, v), kwargs = problem.inputs(spec, device)
    out, lse = _run(module, q, k, v, **_scale_of(kwargs))
    perm = torch.randperm(problem.seq_k, generator=torch.Generator().manual_seed(problem.seed)).to(k.device)
    got, got_lse = _run(module, q, k[:, :, perm], v[:, :, perm], "permuted keys", **_scale_of(kwargs))
    return Outcome(compare_pair("out with keys and values permuted", got, out, spec.dtype),
                   compare_pair_lse("lse with keys and values permuted", got_lse, lse))


def lse_split(spec: KernelSpec, problem: Problem) -> int:
    """Where check_lse_merge cuts the keys: halfway, but for causal and tree masks only inside the part that
    every valid row sees in full (keys before Sk - Sq; with padding, before min over sequences of lk - lq)."""
    half = problem.seq_k // 2
    if spec.mask in (Mask.NONE, Mask.PADDING):
        return half
    if spec.mask is Mask.CAUSAL_PADDING:
        rooms = [lk - lq for lq, lk in zip(problem.seqlens_q, problem.seqlens_k) if lq > 0]
        return max(0, min([half, *rooms]))
    return max(0, min(half, problem.seq_k - problem.seq_q))


def check_lse_merge(module, spec: KernelSpec, problem: Problem, device: str = "cpu") -> Outcome:
    """(out, lse) of keys [0, s) and [s, Sk), merged with the log-sum-exp rule, give the whole result.

    Keys [0, s) are seen by every valid row (lse_split), so that half is plain non-causal attention ('none', or
    'padding' with lengths min(lk, s)); keys [s, Sk) are the spec's own mask with Sk - s keys and lengths lk - s.
    """
    (q, k, v), kwargs = problem.inputs(spec, device)
    out, lse = _run(module, q, k, v, **kwargs)
    s = lse_split(spec, problem)
    head_mask = Mask.PADDING if spec.mask.padded else Mask.NONE
    head = module if spec.mask is head_mask else _related(spec, mask=head_mask)
    head_kw = _scale_of(kwargs)
    tail_kw = dict(kwargs)
    if spec.mask.padded:
        lk = kwargs["seqlens_k"].long()
        head_kw.update(seqlens_q=kwargs["seqlens_q"], seqlens_k=lk.clamp(max=s).int())
        tail_kw["seqlens_k"] = (lk - s).clamp(min=0).int()
    o1, l1 = _run(head, q, k[:, :, :s], v[:, :, :s], f"keys [0, {s})", **head_kw)
    o2, l2 = _run(module, q, k[:, :, s:], v[:, :, s:], f"keys [{s}, {problem.seq_k})", **tail_kw)
    l1, l2 = l1.double(), l2.double()
    merged_lse = torch.logaddexp(l1, l2)  # log(e^l1 + e^l2); -inf when both halves are empty
    empty = merged_lse == float("-inf")
    w1 = torch.where(empty, 0.0, torch.exp(l1 - merged_lse)).unsqueeze(-1)  # softmax weight of each half
    w2 = torch.where(empty, 0.0, torch.exp(l2 - merged_lse)).unsqueeze(-1)
    merged = w1 * o1.double() + w2 * o2.double()
    where = f"split at key {s} of {problem.seq_k}"
    return Outcome(compare_pair(f"out merged from two halves ({where}) vs whole", merged, out, spec.dtype),
                   compare_pair_lse(f"lse merged from two halves ({where}) vs whole", merged_lse, lse))


# -- backward (modules with `backward`); gradient values against autograd are check_backward's job --------

def _gradients(module, spec: KernelSpec, problem: Problem, device: str):
    """A backward run on the problem's inputs (the same dO as check_backward), and the mask kwargs."""
    (q, k, v), kwargs = problem.inputs(spec, device)
    out, lse = module.forward(q, k, v, **kwargs)
    do = grad_output(problem, spec, device)
    return (lambda: module.backward(do, q, k, v, out, lse, **kwargs)), kwargs


def check_bwd_deterministic(module, spec: KernelSpec, problem: Problem, device: str = "cpu") -> Outcome:
    """Two backward runs on the same inputs give bitwise equal dq, dk, dv (no atomics-order drift)."""
    run, _ = _gradients(module, spec, problem, device)
    first, second = run(), run()
    for name, a, b in zip(("dq", "dk", "dv"), first, second):
        differ = (a != b) & ~(torch.isnan(a) & torch.isnan(b))
        if differ.any():
            idx = tuple(differ.nonzero()[0].tolist())
            raise PropertyFailure(f"{name} differs between two identical backward runs at {idx}: "
                                  f"{a[idx].item():.6g} then {b[idx].item():.6g} ({int(differ.sum())} entries)")
    return Outcome(0.0, 0.0)


def check_bwd_masked_rows(module, spec: KernelSpec, problem: Problem, device: str = "cpu") -> Outcome:
    """Gradients are finite; dq of a row that sees no key and dk, dv of a key that no row sees are exactly 0."""
    run, kwargs = _gradients(module, spec, problem, device)
    grads = run()
    dq, dk, dv = grads[:3]
    if spec.sinks and not torch.isfinite(grads[3]).all():
        raise PropertyFailure(f"dsinks is not finite: {grads[3].tolist()}")
    mask_kw = {k: v for k, v in kwargs.items() if k in ("seqlens_q", "seqlens_k", "tree_mask", "window")}
    vis = reference.visible(spec.mask, problem.batch, problem.seq_q, problem.seq_k, device=dq.device, **mask_kw)
    unseen_rows, unseen_keys = ~vis.any(-1), ~vis.any(-2)  # [B, Sq], [B, Sk]
    for name, g, unseen, what in (("dq", dq, unseen_rows, "query row that sees no key"),
                                  ("dk", dk, unseen_keys, "key that no query sees"),
                                  ("dv", dv, unseen_keys, "key that no query sees")):
        bad = ~torch.isfinite(g) | (unseen[:, None, :, None] & (g != 0))
        if bad.any():
            idx = tuple(bad.nonzero()[0].tolist())
            kind = "not finite" if not torch.isfinite(g[idx]) else f"nonzero for a {what}"
            raise PropertyFailure(f"{name} is {g[idx].item():.6g} at {idx}: {kind} ({int(bad.sum())} entries)")
    return Outcome(0.0, 0.0)


@dataclasses.dataclass
class GradOutcome(Outcome):
    max_dq_err: float  # worst |kernel - reference| over dq, dk, dv
    max_dk_err: float
    max_dv_err: float


def grad_output(problem: Problem, spec: KernelSpec, device: str = "cpu") -> torch.Tensor:
    """dO for a problem: fresh normal data from its seed (not the inputs' stream); NaN in padded rows if poisoned."""
    gen = torch.Generator().manual_seed(problem.seed ^ 0x5EED)
    do = torch.randn(problem.batch, problem.heads_kv * spec.gqa, problem.seq_q, spec.head_dim_v, generator=gen)
    if problem.poison and problem.seqlens_q is not None:
        for b, lq in enumerate(problem.seqlens_q):
            do[b, :, lq:] = float("nan")
    return do.to(getattr(torch, TORCH_DTYPE[spec.dtype])).to(device)


def reference_gradients(q, k, v, do, mask, *, out=None, **kwargs):
    """(out, lse, dq, dk, dv) in float64: autograd through the reference. dO rows past seqlens_q are ignored.
    With sinks in kwargs, a sixth entry: dsinks, their gradient.

    With `out` (the output a backward kernel is given), the softmax backward uses delta = rowsum(dO * out) as the
    kernel does: see [Note] Delta from the saved output.
    """
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    sinks64 = None
    if kwargs.get("sinks") is not None:
        sinks64 = kwargs["sinks"].detach().double().requires_grad_()
        kwargs = dict(kwargs, sinks=sinks64)
    ref_out, lse = reference.attention(q64, k64, v64, mask=mask, **kwargs)
    do64 = do.detach().double()
    if kwargs.get("seqlens_q") is not None:  # padded rows of dO are garbage by contract: they carry no gradient
        rows = torch.arange(do64.shape[2], device=do64.device)
        valid = rows[None, :] < kwargs["seqlens_q"].long()[:, None]  # [B, Sq]
        do64 = torch.where(valid[:, None, :, None], do64, 0.0)
    loss = (ref_out * do64).sum()
    if out is not None:
        # [Note] Delta from the saved output
        # The softmax backward needs delta_i = rowsum(dP * P)_i = rowsum(dO * O)_i. A flash backward only has O
        # rounded to the output dtype, so its delta is off by d_i = rowsum(dO * (out - O))_i, which moves dQ and dK
        # by -scale * d_i * (PK)_i and -scale * (P^T (d * Q)): for bf16 that is ~1e-2 of a unit-sized gradient,
        # more than the rounding of the kernel's own arithmetic, and for large-magnitude q it scales with |q|.
        # It is a property of the saved output, not of the backward kernels, and out itself is checked against the
        # reference. Subtracting sum_i d_i * lse_i from the loss gives d(loss)/dS_ij = P_ij (dP_ij - delta_i - d_i):
        # the exact gradient under the kernel's delta (d(lse_i)/dS_ij = P_ij), so the kernel's own error remains.
        d = (do64 * (out.detach().double() - ref_out.detach())).sum(-1)
        d = torch.where(torch.isfinite(lse), d, 0.0)
        loss = loss - (d * torch.where(torch.isfinite(lse), lse, 0.0)).sum()
    loss.backward()
    if sinks64 is not None:
        return ref_out.detach(), lse.detach(), q64.grad, k64.grad, v64.grad, sinks64.grad
    return ref_out.detach(), lse.detach(), q64.grad, k64.grad, v64.grad


def check_backward(module, spec: KernelSpec, problem: Problem, device: str = "cpu") -> GradOutcome:
    """forward() and backward() of a loaded bwd module match float64 autograd, with no NaN, on one problem."""
    (q, k, v), kwargs = problem.inputs(spec, device)
    do = grad_output(problem, spec, device)
    out, lse = module.forward(q, k, v, **kwargs)
    grads = module.backward(do, q, k, v, out, lse, **kwargs)
    dq, dk, dv = grads[:3]
    for name, got, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        if got.dtype != like.dtype or got.shape != like.shape:
            raise PropertyFailure(f"{name}: {got.dtype} {tuple(got.shape)}, want {like.dtype} {tuple(like.shape)}")
    ref = reference_gradients(q, k, v, do, spec.mask, out=out, **kwargs)
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = ref[:5]
    err = compare("out", out, ref_out, **TOLERANCE[spec.dtype])
    lse_err = compare("lse", lse, ref_lse, **LSE_TOLERANCE)
    pairs = [("dq", dq, ref_dq), ("dk", dk, ref_dk), ("dv", dv, ref_dv)]
    if spec.sinks:
        if len(grads) != 4 or grads[3].shape != kwargs["sinks"].shape:
            raise PropertyFailure("backward of a sinks kernel must return (dq, dk, dv, dsinks [Hq])")
        pairs.append(("dsinks", grads[3], ref[5]))
    grad_errs = [compare_grad(name, got, want, spec.dtype) for name, got, want in pairs]
    return GradOutcome(err, lse_err if math.isfinite(lse_err) else 0.0, *grad_errs[:3])


# -- properties ------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Property:
    name: str
    what: str  # the claim, in words
    check: Callable  # (module, spec, problem, device) -> Outcome; raises PropertyFailure
    applies: Callable[[KernelSpec, ModuleType], bool]
    bound: str  # what "equal" means: "tol" (TOLERANCE vs float64), "2·tol" (kernel vs kernel), "bitwise", "exact"
    shape: Callable | None = None  # (draw, problem) -> the problem this property needs (a chain, a star, ...)

    def problems(self, spec: KernelSpec, scale: str) -> st.SearchStrategy[Problem]:
        draw_problems = strategies.decode_problems if spec.kind is Kind.DECODE else strategies.problems
        base = draw_problems(spec, scale)
        if self.shape is None:
            return base
        return st.composite(lambda draw: self.shape(draw, draw(base)))()


def _chain(draw, p: Problem) -> Problem:
    return dataclasses.replace(p, parents=(chain(p.seq_q),) * p.batch)


def _star(draw, p: Problem) -> Problem:
    fan = lambda n: (-1,) + (0,) * (n - 1)  # noqa: E731 - every node a child of node 0
    return dataclasses.replace(p, parents=tuple(
        draw(st.sampled_from([(-1,) * p.seq_q, fan(p.seq_q)])) for _ in range(p.batch)))


def _has_backward(spec, module) -> bool:
    return callable(getattr(module, "backward", None))


def _positional(spec) -> bool:
    """Scores depend on key positions (window, ALiBi): permuting or slicing keys changes them. User mods see
    positions and batch entries too: the properties that move keys or split a batch skip modded specs."""
    return spec.window or spec.alibi


PROPERTIES = (
    Property("reference", "out and lse match the float64 reference; out never NaN or inf",
             check_forward, lambda spec, m: True, "tol"),
    Property("gqa", "equals the MHA kernel on K/V repeated gqa times", check_gqa,
             lambda spec, m: spec.gqa > 1, "2·tol"),
    Property("tree-chain", "a chain-shaped tree equals causal attention", check_tree_chain,
             lambda spec, m: spec.mask is Mask.TREE and not spec.modded, "2·tol", _chain),
    Property("tree-star", "a star-shaped tree sees only the prefix and itself", check_tree_star,
             lambda spec, m: spec.mask is Mask.TREE and not spec.switches and not spec.modded, "tol", _star),
    Property("padding-split", "a padded batch equals each sequence run alone", check_padding_split,
             lambda spec, m: spec.mask.padded and not spec.modded, "2·tol"),
    Property("padding-garbage", "garbage (NaN) in padding never changes a valid output",
             check_padding_garbage, lambda spec, m: spec.mask.padded, "bitwise"),
    # Triton's interpreter converts fp8 e4m3's NaN (0x7F) to 480 (a GPU keeps it NaN): fp8 caches there are skipped.
    Property("nan-propagates", "NaN in a valid key reaches the rows that see it, and only those",
             check_nan_propagates, lambda spec, m: spec.kv_dtype is None or not _interpreted(m), "tol"),
    Property("permutation", "permuting keys and values together changes nothing", check_permutation,
             lambda spec, m: spec.mask is Mask.NONE and not _positional(spec) and not spec.modded, "2·tol"),
    # Sinks join each half's denominator, so halves do not merge; window and ALiBi move with the split.
    Property("lse-merge", "two halves of the keys merged by log-sum-exp give the whole", check_lse_merge,
             lambda spec, m: not (_positional(spec) or spec.sinks or spec.modded), "2·tol"),
    Property("bwd-deterministic", "two backward runs are bitwise equal", check_bwd_deterministic,
             _has_backward, "bitwise"),
    Property("bwd-masked-rows", "gradients finite; zero for rows and keys that see nothing",
             check_bwd_masked_rows, _has_backward, "exact"),
    Property("bwd-reference", "gradients match float64 autograd", check_backward, _has_backward, "tol"),
)
BY_NAME = {p.name: p for p in PROPERTIES}
