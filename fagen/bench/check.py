"""Checking one implementation's output on a bench case against the float64 reference slices."""

from __future__ import annotations

import dataclasses

import torch

from fagen.bench.cases import CaseContext, Prepared, out_of
from fagen.spec.axes import Direction
from fagen.verify.tolerances import LSE_TOLERANCE, TOLERANCE, PropertyFailure, compare, compare_grad


def check(impl: str, prepared: Prepared, cc: CaseContext) -> tuple[str, str, float | None]:
    """(check status, message, max error) of one implementation's output on input set 0.

    fagen is held to the whole contract (zeros and -inf on rows that see nothing, lse, gradients); peers are
    compared on the rows that see at least one key, since what they put in empty rows is their own business.
    Large forwards are checked on row slices ([Note] Reference slices in fagen/bench/cases.py).
    """
    c = cc.case
    if impl == "copy":  # [Note] Copy reference in fagen/bench/impls.py: no attention output to check
        return "skipped", "", None
    if not cc.reference_fits():
        return "skipped", "too large for the float64 reference on this device", None
    try:
        refs = cc.references(None if prepared.inputs is None else prepared.inputs(cc.sets[0]))
    except torch.cuda.OutOfMemoryError:
        cc._refs = None
        torch.cuda.empty_cache()
        return "skipped", "out of memory in the float64 reference", None
    s = cc.sets[0]
    grads = None
    if c.direction is Direction.BWD:
        leaves = [t.detach().clone().requires_grad_() for t in (s.q, s.k, s.v)]
        result = prepared.fn(dataclasses.replace(s, q=leaves[0], k=leaves[1], v=leaves[2]))
        grads = torch.autograd.grad(out_of(result), leaves, s.dout)
    else:
        with torch.no_grad():  # as timed: a compiled peer must not compile twice (grad mode is guarded)
            result = prepared.fn(s)
    out = out_of(result).detach()
    lse = result[1] if isinstance(result, (tuple, list)) and len(result) > 1 else None
    tol = TOLERANCE[c.dtype]
    worst = 0.0
    G = c.gqa
    try:
        for (b, g, r0, r1, _), (ref_out, ref_lse, ref_grads) in refs.items():
            got = out[b:b + 1, g * G:(g + 1) * G, r0:r1]
            rows = "" if (r0, r1) == (0, c.seq_q) else f", rows {r0}..{r1 - 1}"
            where = f"[batch {b}, heads {g * G}..{(g + 1) * G - 1}{rows}]"
            if impl in ("fagen", "fagen-nondet"):
                worst = max(worst, compare(f"out{where}", got, ref_out, **tol))
                if lse is not None:
                    compare(f"lse{where}", lse[b:b + 1, g * G:(g + 1) * G, r0:r1], ref_lse,
                                   **LSE_TOLERANCE)
                if grads is not None:
                    mine = (grads[0][b:b + 1, g * G:(g + 1) * G], grads[1][b:b + 1, g:g + 1],
                            grads[2][b:b + 1, g:g + 1])
                    for name, gg, rg in zip(("dq", "dk", "dv"), mine, ref_grads):
                        worst = max(worst, compare_grad(f"{name}{where}", gg, rg, c.dtype))
            else:
                seen = torch.isfinite(ref_lse).unsqueeze(-1)  # rows that see at least one key
                got = torch.where(seen, got.double(), 0.0)
                worst = max(worst, compare(f"out{where}", got, ref_out, **tol))
    except PropertyFailure as e:
        return "fail", str(e), None
    return "ok", "", worst
