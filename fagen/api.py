"""fagen.attention: differentiable attention that picks, renders, caches and runs the kernel matching its inputs."""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from fagen import tables
from fagen.enums import Direction, Kind, Mask
from fagen.runtime import load
from fagen.select import prefers_decode
from fagen.spec import KernelSpec, SpecError

_DTYPES = {getattr(torch, name): dtype for dtype, name in tables.TORCH_DTYPE.items()}


class AttentionError(ValueError):
    """The inputs of fagen.attention fit no kernel fagen can generate; the message says what and how to fix it."""


def attention(q, k, v, *, mask: Mask | str = "none", scale: float | None = None, seqlens_q=None, seqlens_k=None,
              tree_mask=None) -> torch.Tensor:
    """Attention over q [B, Hq, Sq, D], k and v [B, Hkv, Sk, D]; returns out like q, differentiable.

    The kernel is chosen from the inputs (dtype, head_dim D, gqa = Hq / Hkv) and `mask`, rendered and loaded once
    per process (then cached on disk). Masks and their inputs follow the generated kernels' contract:
    "causal" is bottom-right aligned, "padding"/"causal+padding" take seqlens_q and seqlens_k (int32 [B]),
    "tree" takes tree_mask (bool [B, Sq, Sq] ancestor-or-self, or int32 parent pointers [B, Sq]).

    Without gradients, a few queries against a long KV cache (fagen.select.prefers_decode) run the split-KV
    decode kernel; both kinds give the same results.
    """
    spec = spec_for(q, k, v, mask=mask)
    kwargs = dict(scale=scale, seqlens_q=seqlens_q, seqlens_k=seqlens_k, tree_mask=tree_mask)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if not needs_grad and prefers_decode(q.shape[2], k.shape[2]):
        decode = KernelSpec(head_dim=spec.head_dim, mask=spec.mask, gqa=spec.gqa, dtype=spec.dtype, kind=Kind.DECODE)
        return _module(decode).forward(q, k, v, **kwargs)[0]
    return _module(spec).attention(q, k, v, **kwargs)


def spec_for(q, k, v, *, mask: Mask | str = "none") -> KernelSpec:
    """The bwd (differentiable) spec whose kernel runs attention on these inputs."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise AttentionError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise AttentionError(f"{name}: expected 4 dims [batch, heads, seq, head_dim], got shape {tuple(t.shape)}")
    if q.dtype not in _DTYPES:
        raise AttentionError(f"q: dtype {q.dtype} is not supported; use torch.float16, torch.bfloat16 or "
                             "torch.float32")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise AttentionError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
    if k.shape[-1] != q.shape[-1] or v.shape[-1] != q.shape[-1]:
        raise AttentionError(f"head_dim: q has {q.shape[-1]}, k {k.shape[-1]}, v {v.shape[-1]}; they must agree")
    hq, hkv = q.shape[1], k.shape[1]
    if hkv == 0 or hq % hkv:
        raise AttentionError(f"heads: q has {hq} heads and k/v have {hkv}; q's heads must be a multiple of k/v's "
                             "(gqa = q heads / kv heads)")
    try:
        mask = Mask(mask)
    except ValueError:
        raise AttentionError(f"mask: got {mask!r}; must be one of " + ", ".join(map(repr, Mask.choices()))) from None
    try:
        return KernelSpec(head_dim=q.shape[-1], mask=mask, gqa=hq // hkv, dtype=_DTYPES[q.dtype],
                          direction=Direction.BWD)
    except SpecError as e:
        raise AttentionError(f"no kernel for these inputs: {e}") from None


@functools.lru_cache(maxsize=None)
def _module(spec: KernelSpec) -> ModuleType:
    return load(spec)  # load() also memoises, but first renders the spec to key it: this skips that per call


__all__ = ["attention", "spec_for", "AttentionError"]
