"""Benchmark inputs: the tensors of one case in the fagen contract's form (split from fagen/bench/workloads.py)."""

from __future__ import annotations

import dataclasses

import torch

from fagen.bench.workloads import Q_MAGNITUDE, BenchCase
from fagen.spec import tables
from fagen.spec.axes import Direction, DType, KVDType, Mask
from fagen.verify import reference


@dataclasses.dataclass
class InputSet:
    """One set of inputs in the fagen contract's form; every implementation reads the same tensors."""

    q: torch.Tensor
    k: torch.Tensor | None  # None in a paged case (case.page_size): its keys live in `paged` only
    v: torch.Tensor | None  # None: a shared latent cache (case.shared_kv), V the first head_dim_v columns of k
    kwargs: dict  # seqlens_q, seqlens_k, tree_mask (bool ancestor-or-self [B, Sq, Sq]) as the mask needs
    dout: torch.Tensor | None = None  # incoming gradient for backward cases
    scores: dict = dataclasses.field(default_factory=dict)  # window, softcap, alibi_slopes [Hq], sinks [Hq]
    # a paged case (case.page_size): k_cache, v_cache [num_pages, page_size, Hkv, D] (the keys, pages in a random
    # order), block_table int32 [B, Sk / page_size], seqlens_k int32 [B]; fagen reads these, and the reference its
    # slices' keys gathered back through the table (CaseContext.slice_of): no dense copy is kept (k, v are None)
    paged: dict | None = None


def alibi_slopes(heads: int) -> torch.Tensor:
    """The ALiBi paper's geometric slopes 2^(-8 (h + 1) / H), float32 [H]."""
    return torch.exp2(-8.0 * torch.arange(1, heads + 1, dtype=torch.float32) / heads)


# Sinks near a row's logsumexp, so that the sink takes a sizeable share of each row (a peer that drops it fails
# the check): with q ~ 3 N(0, 1) the scaled logits have std 3, so a row of n keys has lse ~ ln n + 4.5.
SINK_CENTER, SINK_SPREAD = 9.0, 2.0


def score_inputs(case: BenchCase, device: torch.device, seed: int) -> dict:
    """The switch arguments of fagen.attention for the case (slopes and sinks drawn from `seed`, float32 [Hq])."""
    out: dict = {}
    if case.window is not None:
        out["window"] = case.window
    if case.softcap is not None:
        out["softcap"] = case.softcap
    if case.alibi:
        out["alibi_slopes"] = alibi_slopes(case.heads_q).to(device)
    if case.sinks:
        gen = torch.Generator().manual_seed(seed + 7919)
        sinks = SINK_CENTER + SINK_SPREAD * (2 * torch.rand(case.heads_q, generator=gen) - 1)
        out["sinks"] = sinks.to(device)
    return out


def make_inputs(case: BenchCase, device: torch.device, seed: int) -> InputSet:
    """Fresh normal inputs on the device (padding positions hold data too: masks, not zeros, hide them)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = getattr(torch, tables.TORCH_DTYPE[case.dtype])

    def normal(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device, dtype=torch.float32) * scale).to(dtype)

    q = normal(case.batch, case.heads_q, case.seq_q, case.head_dim, scale=Q_MAGNITUDE)
    k = normal(case.batch, case.heads_kv, case.seq_k, case.head_dim)
    v = None if case.shared_kv else normal(case.batch, case.heads_kv, case.seq_k, case.head_dim_v)
    kwargs: dict = {}
    if case.mask.padded:
        kwargs["seqlens_q"] = torch.tensor(case.seqlens_q, dtype=torch.int32, device=device)
        kwargs["seqlens_k"] = torch.tensor(case.seqlens_k, dtype=torch.int32, device=device)
    if case.mask is Mask.TREE:
        kwargs["tree_mask"] = reference.ancestors_from_parents(torch.tensor(case.parents)).to(device)
    dout = normal(*q.shape[:3], case.head_dim_v) if case.direction is Direction.BWD else None
    scores = score_inputs(case, device, seed)
    if case.kv_dtype is not None or case.dtype is DType.FP8_E4M3:  # fp8 k, v (a cache, or the fp8 forward's
        kv_dtype = getattr(torch, tables.TORCH_KV_DTYPE[KVDType(case.kv_dtype or "fp8_e4m3")])  # k_descale, v_descale)
        k, v = k.to(kv_dtype), None if v is None else v.to(kv_dtype)  # with per-KV-head scales: what k, v mean
        scales = torch.Generator(device="cpu").manual_seed(seed + 8)  # is their product
        for name in ("k_scale", ) if case.shared_kv else ("k_scale", "v_scale"):
            scores[name] = (0.5 + torch.rand(case.heads_kv, generator=scales)).to(device)
    if case.batch_invariant is not None:  # decode rows that ask: True, or False for the split rule
        scores["batch_invariant"] = case.batch_invariant
    paged = None
    if case.page_size is not None:  # the pages alone: the check gathers its slices back from them
        paged, k, v = to_pages(k, v, case.page_size, gen), None, None
    return InputSet(q, k, v, kwargs, dout, scores, paged)


def to_pages(k: torch.Tensor, v: torch.Tensor, page: int, gen: torch.Generator) -> dict:
    """k, v [B, H, S, D] (S a multiple of page) as vLLM's paged caches [B * S / page, page, H, D] in a random page
    order (drawn from gen), with the block table and the lengths that read them back."""
    b, h, s, d = k.shape
    n = s // page
    perm = torch.randperm(b * n, generator=gen, device=k.device)
    inv = perm.argsort()
    pages = lambda x: x.reshape(b, h, n, page, x.shape[-1]).permute(0, 2, 3, 1, 4) \
        .reshape(b * n, page, h, x.shape[-1])[inv]  # noqa: E731
    return dict(k_cache=pages(k), v_cache=pages(v), block_table=perm.to(torch.int32).view(b, n),
                seqlens_k=torch.full((b,), s, dtype=torch.int32, device=k.device))


def set_bytes(case: BenchCase) -> int:
    """Bytes of one input set: q, out (and dO), and the cache at its element size (1 for an fp8 cache; a paged case
    holds its pages only)."""
    rows_q, rows_kv = case.batch * case.heads_q * case.seq_q, case.batch * case.heads_kv * case.seq_k
    per_q = rows_q * (case.head_dim + case.head_dim_v * (2 if case.direction is Direction.BWD else 1))  # q, out, dO
    per_kv = rows_kv * (case.head_dim + case.head_dim_v * (not case.shared_kv))
    return per_q * case.dtype.itemsize + per_kv * (1 if case.kv_dtype is not None else case.dtype.itemsize)
