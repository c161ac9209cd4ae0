"""Verification of the varlen and paged layouts (README "Layouts"): random serving-shaped inputs, the float64
reference run on their gathered dense equivalent, and the checks.

Every case is drawn with Hypothesis from the semantics, not from the kernels: sequence lengths include 0 and 1 and
lengths that are not multiples of the block sizes; pages are shuffled, may be shared between sequences (a shared
prompt prefix), the last page of a sequence is partly filled, page sizes run from 1 up; every cache slot that no
sequence uses holds NaN, which must never reach an output.
"""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import strategies as st

from fagen.spec import tables
from fagen.spec.axes import Kind, Layout, Mask
from fagen.spec.kernel import KernelSpec
from fagen.verify import reference
from fagen.verify.tolerances import compare_grad, compare_pair, compare_pair_lse


@dataclasses.dataclass
class LayoutCase:
    """One drawn input set. lens_q/lens_k per sequence; pages: the block table rows (paged)."""

    lens_q: list[int]
    lens_k: list[int]
    heads_kv: int
    page_size: int = 0
    shared: bool = False  # paged: sequences after the first reuse its first pages (a shared prompt prefix)
    seed: int = 0

    @property
    def batch(self) -> int:
        return len(self.lens_q)


def cases(spec: KernelSpec, max_len: int = 40, max_batch: int = 4) -> st.SearchStrategy[LayoutCase]:
    """Input sets for a varlen or paged spec. Decode specs get one query count (1..16) for every sequence."""
    lens = st.one_of(st.sampled_from([0, 1]), st.integers(0, max_len))

    @st.composite
    def case(draw):
        batch = draw(st.integers(1, max_batch))
        if spec.kind is Kind.DECODE:
            sq = draw(st.integers(1, 16))
            lens_q = [sq] * batch
        else:
            lens_q = [draw(lens) for _ in range(batch)]
        lens_k = [draw(lens) for _ in range(batch)]
        if spec.mask.causal and spec.layout is Layout.PAGED:
            # chunked prefill / decode: the new queries are the last of the cached keys (rows may still be empty)
            lens_k = [max(k, q) if draw(st.booleans()) else k for q, k in zip(lens_q, lens_k)]
        page = draw(st.sampled_from([1, 2, 4, 8, 16])) if spec.layout is Layout.PAGED else 0
        return LayoutCase(lens_q, lens_k, heads_kv=draw(st.integers(1, 2)), page_size=page,
                          shared=spec.layout is Layout.PAGED and draw(st.booleans()),
                          seed=draw(st.integers(0, 2**31 - 1)))

    return case()


def _cu(lens: list[int], device) -> torch.Tensor:
    return torch.tensor([0] + list(torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()), dtype=torch.int32,
                        device=device)


@dataclasses.dataclass
class LayoutInputs:
    """The module's inputs for a case, and each sequence's dense q, k, v (what the reference sees)."""

    args: tuple
    kwargs: dict
    dense: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # per sequence: q [Sq, Hq, D], k/v [Sk, Hkv, D]


def make_inputs(spec: KernelSpec, case: LayoutCase, device) -> LayoutInputs:
    gen = torch.Generator().manual_seed(case.seed)
    dtype = getattr(torch, tables.TORCH_DTYPE[spec.dtype])
    d, hkv = spec.head_dim, case.heads_kv
    hq = hkv * spec.gqa
    rnd = lambda *shape: torch.randn(*shape, generator=gen).to(dtype)  # noqa: E731
    qs = [rnd(n, hq, d) for n in case.lens_q]
    ks = [rnd(n, hkv, d) for n in case.lens_k]
    vs = [rnd(n, hkv, d) for n in case.lens_k]
    if spec.layout is Layout.VARLEN:
        kwargs = dict(cu_seqlens_q=_cu(case.lens_q, device), cu_seqlens_k=_cu(case.lens_k, device),
                      max_seqlen_q=max(case.lens_q), max_seqlen_k=max(case.lens_k))
        args = tuple(torch.cat(t).to(device) for t in (qs, ks, vs))
        return LayoutInputs(args, kwargs, list(zip(qs, ks, vs)))
    # Paged: each sequence's pages, shuffled over a cache with spare pages; a shared prefix reuses sequence 0's.
    page = case.page_size
    n_pages = [-(-n // page) for n in case.lens_k]
    width = max(max(n_pages), 1) + 1  # one spare table column: entries past a sequence's pages are never read
    shared = min(n_pages[0], min(n_pages)) if case.shared and case.batch > 1 else 0
    total = sum(n_pages) - shared * (case.batch - 1) + 2  # two pages no sequence uses
    order = torch.randperm(total, generator=gen)
    table = torch.full((case.batch, width), -1, dtype=torch.int32)  # unused entries: -1, as engines leave them
    k_cache = torch.full((total, page, hkv, d), float("nan"), dtype=dtype)
    v_cache = torch.full((total, page, hkv, d), float("nan"), dtype=dtype)
    nxt = 0
    for b, n in enumerate(n_pages):
        for p in range(n):
            if p < shared and b > 0:
                table[b, p] = table[0, p]  # the shared prompt prefix: same pages, same keys
            else:
                table[b, p] = order[nxt]
                nxt += 1
    for b in range(case.batch):  # later sequences overwrite shared slots; each writes every slot it reads
        for j in range(case.lens_k[b]):
            k_cache[table[b, j // page], j % page] = ks[b][j]
            v_cache[table[b, j // page], j % page] = vs[b][j]
    kwargs = dict(block_table=table.to(device), seqlens_k=torch.tensor(case.lens_k, dtype=torch.int32, device=device))
    if spec.kind is Kind.DECODE:
        q = torch.stack([x.transpose(0, 1) for x in qs]).to(device)  # [B, Hq, Sq, D]
    else:
        q = torch.cat(qs).to(device)
        kwargs.update(cu_seqlens_q=_cu(case.lens_q, device), max_seqlen_q=max(case.lens_q))
    # the dense keys each sequence sees: what its pages hold (shared pages: the last writer's keys)
    dense = []
    for b in range(case.batch):
        idx = torch.arange(case.lens_k[b])
        rows = table[b, idx // page].long()
        dense.append((qs[b], k_cache[rows, idx % page], v_cache[rows, idx % page]))
    return LayoutInputs((q, k_cache.to(device), v_cache.to(device)), kwargs, dense)


def reference_sequence(spec: KernelSpec, q, k, v, scores: dict | None = None):
    """float64 (out [Sq, Hq, D], lse [Hq, Sq]) of one sequence: the dense reference with batch 1."""
    mask = Mask.CAUSAL if spec.mask.causal else Mask.NONE
    out, lse = reference.attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                   mask=mask, **(scores or {}))
    return out[0].transpose(0, 1), lse[0]


def check_forward(module, spec: KernelSpec, case: LayoutCase, device) -> None:
    """Run forward() and compare every sequence's out and lse with the reference; raises PropertyFailure."""
    inputs = make_inputs(spec, case, device)
    out, lse = module.forward(*inputs.args, **inputs.kwargs)
    row = 0
    for b, (q, k, v) in enumerate(inputs.dense):
        want_out, want_lse = reference_sequence(spec, q, k, v)
        n = case.lens_q[b]
        if spec.kind is Kind.DECODE:
            got_out, got_lse = out[b].transpose(0, 1), lse[b]
        else:
            got_out, got_lse = out[row:row + n], lse[:, row:row + n]
            row += n
        compare_pair(f"out (sequence {b})", got_out.cpu(), want_out, spec.dtype)
        compare_pair_lse(f"lse (sequence {b})", got_lse.cpu(), want_lse)


def check_backward(module, spec: KernelSpec, case: LayoutCase, device) -> None:
    """Varlen: gradients of attention() against the reference's, sequence by sequence."""
    inputs = make_inputs(spec, case, device)
    q, k, v = (t.detach().requires_grad_() for t in inputs.args)
    out = module.attention(q, k, v, **inputs.kwargs)
    gen = torch.Generator().manual_seed(case.seed + 1)
    dout = torch.randn(out.shape, generator=gen).to(out.dtype).to(device)
    out.backward(dout)
    wants = []
    for b, (qb, kb, vb) in enumerate(inputs.dense):
        qd, kd, vd = (t.double().requires_grad_() for t in (qb, kb, vb))
        o, _ = reference_sequence(spec, qd, kd, vd)
        wants.append((o, qd, kd, vd))
    cq, ck = inputs.kwargs["cu_seqlens_q"].cpu(), inputs.kwargs["cu_seqlens_k"].cpu()
    for b, (o, qd, kd, vd) in enumerate(wants):
        o.backward(dout[cq[b]:cq[b + 1]].cpu().double())
        for name, got, want in (("dq", q.grad[cq[b]:cq[b + 1]], qd.grad), ("dk", k.grad[ck[b]:ck[b + 1]], kd.grad),
                                ("dv", v.grad[ck[b]:ck[b + 1]], vd.grad)):
            compare_grad(f"{name} (sequence {b})", got.cpu(), want, spec.dtype)
