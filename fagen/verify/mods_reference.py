"""Float64 evaluation of a user's own score_mod / mask_mod, for the reference: the functions run on broadcast
index tensors as written, with no tracing and nothing shared with the kernels."""

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


def index_grid(batch: int, heads: int, seq_q: int, seq_k: int, device="cpu"):
    """b [B,1,1,1], h [1,H,1,1], q_idx [1,1,Sq,1], kv_idx [1,1,1,Sk]: int64, broadcasting to [B, H, Sq, Sk].
    h is the query head; q_idx and kv_idx are positions within the sequence (FlexAttention's meaning)."""
    ar = lambda n, dim: torch.arange(n, device=device).view([-1 if d == dim else 1 for d in range(4)])  # noqa: E731
    return ar(batch, 0), ar(heads, 1), ar(seq_q, 2), ar(seq_k, 3)


def score_mod_scores(score_mod, s: torch.Tensor) -> torch.Tensor:
    """score_mod(s, b, h, q_idx, kv_idx) over s [B, H, Sq, Sk] (float64), broadcast to s's shape."""
    with _float64_default():
        out = score_mod(s, *index_grid(*s.shape, device=s.device))
    out = torch.as_tensor(out, device=s.device)
    return (out if out.dtype == torch.float64 else out.double()).expand(s.shape)


def mask_mod_visible(mask_mod, batch: int, heads: int, seq_q: int, seq_k: int, device="cpu") -> torch.Tensor:
    """bool [B, H, Sq, Sk]: mask_mod(b, h, q_idx, kv_idx), True where visible."""
    with _float64_default():
        out = mask_mod(*index_grid(batch, heads, seq_q, seq_k, device=device))
    out = torch.as_tensor(out, device=device)
    if out.dtype != torch.bool:
        raise TypeError(f"mask_mod returned {out.dtype}; it must return a bool tensor (True: visible)")
    return out.expand(batch, heads, seq_q, seq_k)
