"""fagen::attention: fagen.attention as one torch.library custom operator (with its backward), for torch.compile.

Dynamo sees a single operator call whose fake implementation follows the input shapes: no graph break, and no
recompile when a sequence length changes. The operator's implementation runs eagerly, picks the generated module
(fagen.runtime.resolve.resolve) and launches it; the generated modules register their own per-spec operators too
([Note] Operators in fagen/templates/host/ops.py.j2). The score inputs travel as operator arguments: window as
[left, right] with -1 for an unbounded side, softcap, alibi_slopes and sinks (whose gradient the backward returns).

[Note] Runtime autograd. A generated bwd module has one autograd, its _Attention ([Note] One autograd in
templates/triton/backward.py.j2). This operator needs its own because it resolves the module at run time (a render,
a compile or a cache lookup that Dynamo cannot trace): its backward is the module's backward(), resolved the same
way. Resolving at trace time instead (torch.compiler.assume_constant_result returning the module) fails inside
Dynamo on torch 2.13 (an InternalTorchDynamoError from the constant's guard).
"""

from __future__ import annotations

from typing import List, Optional

import torch

from fagen.codegen.args import SWITCH_KEYWORD
from fagen.runtime.resolve import resolve


def _scores(window, softcap, alibi_slopes, sinks):
    """(switches, kwargs) of the score inputs given to the operator."""
    kwargs = {}
    if window is not None:
        kwargs["window"] = tuple(None if w < 0 else w for w in window)
    for name, value in (("softcap", softcap), ("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if value is not None:
            kwargs[name] = value
    return tuple(_SWITCH[key] for key in kwargs), kwargs


_SWITCH = {keyword: switch for switch, keyword in SWITCH_KEYWORD.items()}  # "alibi_slopes" -> "alibi"


@torch.library.custom_op("fagen::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: str, scale: Optional[float],
              seqlens_q: Optional[torch.Tensor], seqlens_k: Optional[torch.Tensor], tree_mask: Optional[torch.Tensor],
              decode: bool, window: Optional[List[int]] = None, softcap: Optional[float] = None,
              alibi_slopes: Optional[torch.Tensor] = None,
              sinks: Optional[torch.Tensor] = None, batch_invariant: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    switches, scores = _scores(window, softcap, alibi_slopes, sinks)
    module = resolve(q, k, v, mask, decode, switches)
    if decode and not batch_invariant:
        scores["batch_invariant"] = False
    return module.forward(q, k, v, scale=scale, seqlens_q=seqlens_q, seqlens_k=seqlens_k, tree_mask=tree_mask,
                          **scores)


@attention.register_fake
def _attention_fake(q, k, v, mask, scale, seqlens_q, seqlens_k, tree_mask, decode, window=None, softcap=None,
                    alibi_slopes=None, sinks=None, batch_invariant=True):
    return q.new_empty((*q.shape[:3], v.shape[-1])), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("fagen::attention_backward", mutates_args=())
def attention_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                       lse: torch.Tensor, mask: str, scale: Optional[float], seqlens_q: Optional[torch.Tensor],
                       seqlens_k: Optional[torch.Tensor], tree_mask: Optional[torch.Tensor],
                       window: Optional[List[int]] = None, softcap: Optional[float] = None,
                       alibi_slopes: Optional[torch.Tensor] = None, sinks: Optional[torch.Tensor] = None,
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dsinks); dsinks is empty without sinks."""
    switches, scores = _scores(window, softcap, alibi_slopes, sinks)
    module = resolve(q, k, v, mask, False, switches)
    grads = module.backward(do, q, k, v, out, lse, scale=scale, seqlens_q=seqlens_q, seqlens_k=seqlens_k,
                            tree_mask=tree_mask, **scores)
    return (*grads[:3], grads[3] if sinks is not None else q.new_empty(0, dtype=torch.float32))


@attention_backward.register_fake
def _attention_backward_fake(do, q, k, v, out, lse, mask, scale, seqlens_q, seqlens_k, tree_mask, window=None,
                             softcap=None, alibi_slopes=None, sinks=None):
    dsinks = sinks.new_empty(sinks.shape) if sinks is not None else q.new_empty(0, dtype=torch.float32)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks


def _setup(ctx, inputs, output):
    q, k, v, mask, scale, seqlens_q, seqlens_k, tree_mask, decode, window, softcap, alibi_slopes, sinks = inputs[:13]
    ctx.save_for_backward(q, k, v, output[0], output[1], seqlens_q, seqlens_k, tree_mask, alibi_slopes, sinks)
    ctx.mask, ctx.scale, ctx.window, ctx.softcap = mask, scale, window, softcap


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, seqlens_q, seqlens_k, tree_mask, alibi_slopes, sinks = ctx.saved_tensors
    dq, dk, dv, dsinks = attention_backward(dout.to(q.dtype).contiguous(), q, k, v, out, lse, ctx.mask, ctx.scale,
                                            seqlens_q, seqlens_k, tree_mask, ctx.window, ctx.softcap, alibi_slopes,
                                            sinks)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, dsinks if sinks is not None else None, None


attention.register_autograd(_backward, setup_context=_setup)
