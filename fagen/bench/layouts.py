"""`fagen bench --suite layouts`: the serving layouts (README "Layouts") against fagen's dense kernels and the peers
that take the layout, in one run.

[Note] Layout rows. Paged decode is memory-bound: its rate is the bytes it must read (the K/V of every cached token,
q and out) per second, and its yardstick is fagen's dense decode on the same problem (the same tokens in a
[B, Hkv, S, D] cache). Varlen prefill is compute-bound: its rate is the useful FLOPs (4 * D * visible pairs per
head, the causal pairs of each sequence) per second, and its yardstick is fagen's dense causal forward over the
same total tokens (B sequences of the mean length). Peers that take the layout: FlexAttention with a document
mask (the packed rows as one sequence, BlockMask by sequence id) and SDPA over nested (jagged) tensors. Timing is
fagen.bench.timing.measure (CUDA events, L2 flushed, median), a row's implementations in interleaved rounds
(`--rounds`, [Note] Interleaved rounds in fagen/bench/rounds.py; `timed`). Every implementation's output is compared
with fagen's on the timed inputs before any is timed.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Callable

import torch

from fagen.bench.rounds import SUITE_ROUNDS, summarize, time_parts
from fagen.bench.timing import measure
from fagen.runtime.loader import load
from fagen.spec.kernel import KernelSpec
from fagen.verify.layouts import cu_seqlens


@dataclasses.dataclass(frozen=True)
class PagedCase:
    name: str
    batch: int
    seq_k: int
    heads_q: int = 32
    heads_kv: int = 8
    head_dim: int = 128
    page_size: int = 16


@dataclasses.dataclass(frozen=True)
class VarlenCase:
    name: str
    lengths: tuple[int, ...]
    heads: int = 32
    head_dim: int = 128


def _lengths(n: int, lo: int, hi: int, seed: int) -> tuple[int, ...]:
    rnd = random.Random(seed)
    return tuple(rnd.randint(lo, hi) for _ in range(n))


PAGED = (PagedCase("paged-decode-kv8k-b32-p16", 32, 8192), PagedCase("paged-decode-kv32k-b8-p16", 8, 32768))
VARLEN = (VarlenCase("varlen-causal-16seq-512..8192", _lengths(16, 512, 8192, seed=14)),)


def _paged_inputs(c: PagedCase, device, dtype, seed=0):
    """A shuffled page cache holding exactly the dense cache's tokens (equal results, same bytes read)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(c.batch, c.heads_q, 1, c.head_dim, generator=g).to(device, dtype)
    k = torch.randn(c.batch, c.heads_kv, c.seq_k, c.head_dim, generator=g).to(device, dtype)
    v = torch.randn(c.batch, c.heads_kv, c.seq_k, c.head_dim, generator=g).to(device, dtype)
    pages = c.seq_k // c.page_size
    table = torch.randperm(c.batch * pages, generator=g).view(c.batch, pages).to(torch.int32)
    k_cache = torch.empty(c.batch * pages, c.page_size, c.heads_kv, c.head_dim, dtype=dtype, device=device)
    v_cache = torch.empty_like(k_cache)
    paged = lambda t: t.transpose(1, 2).reshape(c.batch * pages, c.page_size, c.heads_kv, c.head_dim)  # noqa: E731
    k_cache[table.view(-1).long().to(device)] = paged(k)
    v_cache[table.view(-1).long().to(device)] = paged(v)
    seqlens = torch.full((c.batch,), c.seq_k, dtype=torch.int32, device=device)
    return q, k, v, k_cache, v_cache, table.to(device), seqlens


def paged_bytes(q, k, v, table) -> int:
    """Bytes a decode step must move: the K/V of every cached token, q and out, and the block table."""
    return (k.numel() + v.numel() + 2 * q.numel()) * k.element_size() + table.numel() * table.element_size()


def paged_rows(device, dtype=torch.bfloat16, cases=PAGED, log=print, rep_ms=200.0, rounds=1) -> list[dict]:
    records = []
    for c in cases:
        q, k, v, k_cache, v_cache, table, seqlens = _paged_inputs(c, device, dtype)
        gqa = c.heads_q // c.heads_kv
        dense = load(KernelSpec(head_dim=c.head_dim, gqa=gqa, dtype="bf16", kind="decode"))
        paged = load(KernelSpec(head_dim=c.head_dim, gqa=gqa, dtype="bf16", kind="decode", layout="paged"))
        want, _ = dense.forward(q, k, v)
        got, _ = paged.forward(q, k_cache, v_cache, block_table=table, seqlens_k=seqlens)
        err = (got.float() - want.float()).abs().max().item()
        if err > 1e-2:
            raise AssertionError(f"{c.name}: paged decode differs from dense decode by {err}")
        nbytes = paged_bytes(q, k, v, table)
        impls: dict[str, Callable[[], object]] = {
            "fagen dense decode": lambda: dense.forward(q, k, v),
            "fagen paged decode": lambda: paged.forward(q, k_cache, v_cache, block_table=table, seqlens_k=seqlens),
        }
        row = {"case": c.name, "kind": "paged-decode", "bytes": nbytes, "max_err_vs_dense": err}
        for name, t in timed(impls, device, rep_ms, rounds, row).items():
            row[name] = {"ms": t["ms"], "GB/s": nbytes / t["ms"] / 1e6} | t
        row["paged/dense"] = row["fagen paged decode"]["GB/s"] / row["fagen dense decode"]["GB/s"]
        log(f"{c.name}: dense {row['fagen dense decode']['GB/s']:.0f} GB/s, paged "
            f"{row['fagen paged decode']['GB/s']:.0f} GB/s ({row['paged/dense']:.3f}x); max |paged - dense| {err:.2e}")
        records.append(row)
    return records


def timed(impls: dict[str, Callable[[], object]], device, rep_ms: float, rounds: int, row: dict) -> dict[str, dict]:
    """{name: {ms}} of each checked implementation of a row: 25 ms of warm-up and rep_ms of repetitions each, in
    turn (rounds 1), or in `rounds` interleaved rounds (fagen.bench.rounds.time_parts; each round a 1/rounds share
    of both), then {ms (the median round), rounds_ms, ms_min, ms_max} and the row's `rounds`. A failure raises."""
    share = max(rounds, 1)

    def part(fn):
        return lambda memo: measure(lambda i: fn(), 1, torch.device(device), 25.0 / (share if memo is not None else 1),
                                    rep_ms / (share if memo is not None else 1), memo=memo)

    times, failed = time_parts({name: (lambda fn=fn: {"ms": part(fn)}) for name, fn in impls.items()}, rounds)
    if failed:
        raise next(iter(failed.values()))
    if rounds > 1:
        row["rounds"] = rounds
        return {name: summarize(times[name]) for name in impls}
    return {name: times[name][0] for name in impls}


def _causal_flops(lengths, heads, d) -> float:
    return sum(4.0 * d * heads * n * (n + 1) / 2 for n in lengths)  # QK^T and PV over the visible pairs


def varlen_rows(device, dtype=torch.bfloat16, cases=VARLEN, log=print, rep_ms=300.0, peers=True,
                rounds=1) -> list[dict]:
    records = []
    for c in cases:
        g = torch.Generator(device="cpu").manual_seed(0)
        total, b = sum(c.lengths), len(c.lengths)
        q, k, v = (torch.randn(total, c.heads, c.head_dim, generator=g).to(device, dtype) for _ in range(3))
        cu = cu_seqlens(c.lengths, device)
        longest = max(c.lengths)
        varlen = load(KernelSpec(head_dim=c.head_dim, mask="causal", dtype="bf16", layout="varlen"))
        dense = load(KernelSpec(head_dim=c.head_dim, mask="causal", dtype="bf16"))
        mean = total // b
        qd, kd, vd = (torch.randn(b, c.heads, mean, c.head_dim, generator=g).to(device, dtype) for _ in range(3))
        run = lambda: varlen.forward(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,  # noqa: E731
                                     max_seqlen_k=longest)
        ours, _ = run()
        impls: dict[str, tuple[Callable[[], object], float]] = {
            "fagen varlen": (run, _causal_flops(c.lengths, c.heads, c.head_dim)),
            "fagen dense (B x mean length)": (lambda: dense.forward(qd, kd, vd),
                                             _causal_flops([mean] * b, c.heads, c.head_dim)),
        }
        notes = {}
        if peers:
            for name, build in (("flex document mask", _flex_document), ("sdpa nested", _sdpa_nested)):
                try:
                    fn = build(q, k, v, c.lengths)
                    err = (fn().float() - ours.float()).abs().max().item()
                    if err > 2e-2:
                        raise AssertionError(f"differs from fagen by {err}")
                    impls[name] = (fn, _causal_flops(c.lengths, c.heads, c.head_dim))
                except Exception as e:  # a peer that cannot run this layout here: recorded, not timed
                    notes[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                    log(f"{c.name}: {name} skipped ({notes[name]})")
        row = {"case": c.name, "kind": "varlen-prefill", "lengths": list(c.lengths), "total_tokens": total,
               "skipped": notes}
        for name, t in timed({n: fn for n, (fn, _) in impls.items()}, device, rep_ms, rounds, row).items():
            row[name] = {"ms": t["ms"], "TF/s": impls[name][1] / t["ms"] / 1e9} | t
        row["varlen/dense"] = row["fagen varlen"]["TF/s"] / row["fagen dense (B x mean length)"]["TF/s"]
        log(f"{c.name}: " + ", ".join(f"{n} {row[n]['TF/s']:.0f} TF/s" for n in impls)
            + f" (varlen/dense {row['varlen/dense']:.3f}x)")
        records.append(row)
    return records


def _flex_document(q, k, v, lengths):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    total = q.shape[0]
    doc = torch.repeat_interleave(torch.arange(len(lengths), device=q.device),
                                  torch.tensor(lengths, device=q.device))

    def mask_mod(b, h, qi, kv):
        return (doc[qi] == doc[kv]) & (kv <= qi)

    block_mask = create_block_mask(mask_mod, None, None, total, total, device=q.device)
    compiled = torch.compile(flex_attention)
    qt, kt, vt = (t.transpose(0, 1)[None] for t in (q, k, v))
    return lambda: compiled(qt, kt, vt, block_mask=block_mask)[0].transpose(0, 1)


def _sdpa_nested(q, k, v, lengths):
    import torch.nn.functional as F

    offsets = cu_seqlens(lengths, q.device).long()
    nq, nk, nv = (torch.nested.nested_tensor_from_jagged(t, offsets).transpose(1, 2) for t in (q, k, v))

    def fn():
        out = F.scaled_dot_product_attention(nq, nk, nv, is_causal=True)
        return out.transpose(1, 2).values()

    return fn


def run(device, log=print, quick=False, rounds=SUITE_ROUNDS) -> list[dict]:
    """The suite's rows, each row's implementations timed in `rounds` interleaved rounds (`--rounds`; at most 2
    with `quick`; 1: in turn, the earlier suite)."""
    if quick:  # a CPU smoke run through the interpreter: tiny shapes, no peers
        paged = (PagedCase("paged-decode-smoke", 2, 64, heads_q=4, heads_kv=2, head_dim=32, page_size=16),)
        varlen = (VarlenCase("varlen-smoke", (17, 5, 30), heads=2, head_dim=32),)
        rounds = min(rounds, 2)
        return (paged_rows(device, cases=paged, log=log, rep_ms=1.0, rounds=rounds)
                + varlen_rows(device, cases=varlen, log=log, rep_ms=1.0, peers=False, rounds=rounds))
    return paged_rows(device, log=log, rounds=rounds) + varlen_rows(device, log=log, rounds=rounds)
