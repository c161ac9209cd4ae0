"""fagen::attention: fagen.attention as one torch.library custom operator (with its backward), for torch.compile.

Dynamo sees a single operator call whose fake implementation follows the input shapes: no graph break, and no
recompile when a sequence length changes. The operator's implementation runs eagerly, picks the generated module
(fagen.runtime.resolve.resolve) and launches it; the generated modules register their own per-spec operators too
([Note] Operators in fagen/templates/host/ops.py.j2).
"""

from __future__ import annotations

from typing import Optional

import torch

from fagen.runtime.resolve import resolve


@torch.library.custom_op("fagen::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: str, scale: Optional[float],
              seqlens_q: Optional[torch.Tensor], seqlens_k: Optional[torch.Tensor], tree_mask: Optional[torch.Tensor],
              decode: bool) -> tuple[torch.Tensor, torch.Tensor]:
    module = resolve(q, k, v, mask, decode)
    return module.forward(q, k, v, scale=scale, seqlens_q=seqlens_q, seqlens_k=seqlens_k, tree_mask=tree_mask)


@attention.register_fake
def _attention_fake(q, k, v, mask, scale, seqlens_q, seqlens_k, tree_mask, decode):
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("fagen::attention_backward", mutates_args=())
def attention_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                       lse: torch.Tensor, mask: str, scale: Optional[float], seqlens_q: Optional[torch.Tensor],
                       seqlens_k: Optional[torch.Tensor],
                       tree_mask: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    module = resolve(q, k, v, mask, False)
    return module.backward(do, q, k, v, out, lse, scale=scale, seqlens_q=seqlens_q, seqlens_k=seqlens_k,
                           tree_mask=tree_mask)


@attention_backward.register_fake
def _attention_backward_fake(do, q, k, v, out, lse, mask, scale, seqlens_q, seqlens_k, tree_mask):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup(ctx, inputs, output):
    q, k, v, mask, scale, seqlens_q, seqlens_k, tree_mask, decode = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], seqlens_q, seqlens_k, tree_mask)
    ctx.mask, ctx.scale = mask, scale


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, seqlens_q, seqlens_k, tree_mask = ctx.saved_tensors
    dq, dk, dv = attention_backward(dout.to(q.dtype).contiguous(), q, k, v, out, lse, ctx.mask, ctx.scale, seqlens_q,
                                    seqlens_k, tree_mask)
    return dq, dk, dv, None, None, None, None, None, None


attention.register_autograd(_backward, setup_context=_setup)
