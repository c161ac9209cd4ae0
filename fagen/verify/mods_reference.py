"""Float64 evaluation of a user's own score_mod / mask_mod, for the reference: the functions run as written over
the index tensors, with no tracing and nothing shared with the kernels.

[Note] vmap, not broadcasting. Each function is vmapped over kv_idx, q_idx, h and b in turn (as FlexAttention's
own reference does), so inside it every index is a 0-dim tensor, as in a kernel. Plain broadcasting would give
the same values for element-wise mods but not for one that indexes a captured tensor partway:
`interval = intervals[image_boundaries[kv_idx]]; interval[0]` (attention-gym's Flamingo mask) must read column 0.
"""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def _float64_default():
    """int tensor * Python float gives torch's default dtype: float64 here, so the reference stays float64."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _over_grid(fn, score: bool):
    """fn vmapped over (b, h, q_idx, kv_idx) given as 1-d index tensors (and score [B, H, Sq, Sk] first)."""
    for level in range(4):  # kv_idx innermost, b outermost
        dims = tuple(0 if d == 3 - level else None for d in range(4))
        fn = torch.vmap(fn, in_dims=((0,) if score else ()) + dims, out_dims=0)
    return fn


def _indices(batch, heads, seq_q, seq_k, device):
    return [torch.arange(n, device=device) for n in (batch, heads, seq_q, seq_k)]


def score_mod_scores(score_mod, s: torch.Tensor) -> torch.Tensor:
    """score_mod(s, b, h, q_idx, kv_idx) at every element of s [B, H, Sq, Sk] (float64)."""
    with _float64_default():
        out = _over_grid(lambda *a: torch.as_tensor(score_mod(*a), dtype=torch.float64), True)(
            s, *_indices(*s.shape, s.device))
    return out


def mask_mod_visible(mask_mod, batch: int, heads: int, seq_q: int, seq_k: int, device="cpu") -> torch.Tensor:
    """bool [B, H, Sq, Sk]: mask_mod(b, h, q_idx, kv_idx), True where visible."""
    with _float64_default():
        out = _over_grid(lambda *a: torch.as_tensor(mask_mod(*a)), False)(
            *_indices(batch, heads, seq_q, seq_k, device))
    if out.dtype != torch.bool:
        raise TypeError(f"mask_mod returned {out.dtype}; it must return a bool tensor (True: visible)")
    return out
