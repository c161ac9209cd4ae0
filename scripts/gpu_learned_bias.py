"""A learned relative-position bias with its gradient (issue 26's "learned-bias+grad" row) on one GPU: attention-gym's
generate_relative_bias over a learned fp32 [H, 2S - 1] table, mask_mod causal with its block mask, B1 H16 d128 bf16,
S 2048 / 4096 / 8192, through fagen's modded kernels ([Note] Deterministic captured-tensor gradients in
fagen/templates/triton/mods.j2: the bias is read at q_idx - kv_idx, a diagonal, so the dK/dV kernel writes one sum
per tile diagonal).

    PYTHONPATH=$PWD python3 scripts/gpu_learned_bias.py            # GPU_LEARNED_DRY=1: CPU interpreter, tiny shapes

Per S:
  1. check (S 2048 only, and the dry run): out, dq, dk, dv and d(bias) against float64 (the same functions over
     broadcast index tensors, autograd), as max |diff| / max |ref|; a dense learned bias [1, H, S, S] (the per-score
     path, S 1024) likewise;
  4. a clamped relative bias at the largest S (its end elements take ~S diagonals each): bwd ms with and without
     the gradient, bitwise repeatability;
  2. repeatability: two backward passes give bitwise equal dq, dk, dv and d(bias);
  3. time: forward alone and backward alone (autograd.grad of out for q, k, v, bias), median ms, L2 flushed
     (fagen.bench.timing.measure), as `fagen bench --suite mods` times them; the same mod with a bias that needs no
     gradient (the reductions' cost is the difference); peak memory of one fwd+bwd. Rates are useful TF/s: 4 * D per
     visible pair forward, 2.5x that backward (causal: S (S + 1) / 2 pairs per head); at the largest S, the CUDA
     kernels of one fwd+bwd under torch's profiler (the dK/dV kernel against the host's sums and index_put_).
$OUT/learned_bias.json (if $OUT is set) holds the records.
"""

from __future__ import annotations

import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

DRY = os.environ.get("GPU_LEARNED_DRY") == "1"
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

import fagen  # noqa: E402
from fagen.bench import gym_mods as g  # noqa: E402
from fagen.bench.timing import measure  # noqa: E402
from fagen.verify import reference  # noqa: E402

DEVICE = "cpu" if DRY else "cuda"
B, H, D = (1, 2, 32) if DRY else (1, 16, 128)
DTYPE = torch.float32 if DRY else torch.bfloat16
SEQS = (40, 80) if DRY else (2048, 4096, 8192)
CHECK_S = SEQS[0]
DENSE_S = 24 if DRY else 1024
REP_MS = 1.0 if DRY else 60.0


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _inputs(s, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(B, H, s, D, generator=gen).to(DEVICE, DTYPE) for _ in range(4))
    bias = (torch.randn(H, 2 * s - 1, generator=gen) * 0.5).to(DEVICE)
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), do, bias


def _rel(got, want):
    return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def _check(s, q, k, v, do, bias, score_mod, block_mask):
    out = fagen.attention(q, k, v, score_mod=score_mod, mask_mod=g.causal_mask, block_mask=block_mask)
    got = torch.autograd.grad(out, (q, k, v, bias), do)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, bias)]
    want = reference.attention(*leaves[:3], mask_mod=g.causal_mask, score_mod=g.generate_relative_bias(leaves[3], s))
    want = want[0] if isinstance(want, tuple) else want
    wants = torch.autograd.grad(want, leaves, do.double())
    rec = {"out": _rel(out, want)}
    rec.update({name: _rel(a, b) for name, a, b in zip(("dq", "dk", "dv", "dbias"), got, wants)})
    del want, wants, leaves
    return rec


def _check_dense(s):
    """The per-score path: a dense learned bias [1, H, S, S] (gym's generate_learned_bias), causal."""
    q, k, v, do, _ = _inputs(s, seed=1)
    dense = (torch.randn(1, H, s, s, generator=torch.Generator().manual_seed(2)) * 0.5).to(DEVICE).requires_grad_()
    mod = g.generate_learned_bias(dense)
    runs = []
    for _ in range(2):
        out = fagen.attention(q, k, v, score_mod=mod, mask="causal")
        runs.append(torch.autograd.grad(out, (q, k, v, dense), do))
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, dense)]
    want = reference.attention(*leaves[:3], mask="causal", score_mod=g.generate_learned_bias(leaves[3]))
    want = want[0] if isinstance(want, tuple) else want
    wants = torch.autograd.grad(want, leaves, do.double())
    rec = {name: _rel(a, b) for name, a, b in zip(("dq", "dk", "dv", "dbias"), runs[0], wants)}
    rec["bitwise"] = all(torch.equal(a, b) for a, b in zip(*runs))
    _sync()
    t0 = time.perf_counter()
    torch.autograd.grad(fagen.attention(q, k, v, score_mod=mod, mask="causal"), (q, k, v, dense), do)
    _sync()
    rec["fwd_bwd_ms"] = (time.perf_counter() - t0) * 1e3
    return rec


def _profile(fn):
    """The top CUDA kernels of one fwd+bwd, [name (60 chars), ms]: the dK/dV kernel against the host's reduction."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    _sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        _sync()
    rows = sorted(((e.key, (getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)) / 1e3)
                   for e in prof.key_averages()), key=lambda r: -r[1])
    return [[name[:60], round(ms, 3)] for name, ms in rows if not name.startswith(("aten::", "autograd"))][:8]


def _bucketed(s):
    """A clamped relative bias t[h, clamp(q_idx - kv_idx, -128, 128) + 128] (a diagonal class whose end elements
    each take ~S diagonals: long runs in index_put_'s sort), causal: bwd ms against the same mod without gradient,
    bitwise repeatability."""
    q, k, v, do, _ = _inputs(s, seed=3)
    table = (torch.randn(H, 257, generator=torch.Generator().manual_seed(4)) * 0.5).to(DEVICE)
    bias = table.clone().requires_grad_()

    def mod_of(t):
        return lambda score, b, h, q_idx, kv_idx: score + t[h, torch.clamp(q_idx - kv_idx, -128, 128) + 128]

    bm = fagen.create_block_mask(g.causal_mask, None, None, s, s, device=DEVICE)
    attend = lambda m: fagen.attention(q, k, v, score_mod=m, mask_mod=g.causal_mask, block_mask=bm)  # noqa: E731
    runs = [torch.autograd.grad(attend(mod_of(bias)), (q, k, v, bias), do) for _ in range(2)]
    rec = {"S": s, "bucketed": True, "bitwise": all(torch.equal(a, b) for a, b in zip(*runs))}
    out, out_f = attend(mod_of(bias)), attend(mod_of(table))
    rec["bwd_ms"] = _time(lambda: torch.autograd.grad(out, (q, k, v, bias), do, retain_graph=True))
    rec["bwd_nograd_ms"] = _time(lambda: torch.autograd.grad(out_f, (q, k, v), do, retain_graph=True))
    return rec


def _time(fn):
    return measure(lambda i: fn(), 1, torch.device(DEVICE), 10.0, REP_MS)


def main() -> int:
    records = []
    for s in SEQS:
        rec = {"S": s}
        q, k, v, do, table = _inputs(s)
        bias = table.clone().requires_grad_()
        mod = g.generate_relative_bias(bias, s)
        frozen = g.generate_relative_bias(table, s)  # the same mod, no gradient asked
        t0 = time.perf_counter()
        bm = fagen.create_block_mask(g.causal_mask, None, None, s, s, device=DEVICE)
        out = fagen.attention(q, k, v, score_mod=mod, mask_mod=g.causal_mask, block_mask=bm)
        first = torch.autograd.grad(out, (q, k, v, bias), do)
        _sync()
        rec["first_call_s"] = time.perf_counter() - t0
        second = torch.autograd.grad(fagen.attention(q, k, v, score_mod=mod, mask_mod=g.causal_mask, block_mask=bm),
                                     (q, k, v, bias), do)
        rec["bitwise"] = all(torch.equal(a, b) for a, b in zip(first, second))
        del first, second
        if s == CHECK_S:
            rec["check"] = _check(s, q, k, v, do, bias, mod, bm)
        attend = lambda m: fagen.attention(q, k, v, score_mod=m, mask_mod=g.causal_mask, block_mask=bm)  # noqa: E731
        with torch.no_grad():
            rec["fwd_ms"] = _time(lambda: attend(mod))
        out = attend(mod)
        rec["bwd_ms"] = _time(lambda: torch.autograd.grad(out, (q, k, v, bias), do, retain_graph=True))
        out_f = attend(frozen)
        rec["bwd_nograd_ms"] = _time(lambda: torch.autograd.grad(out_f, (q, k, v), do, retain_graph=True))
        out = out_f = None  # free them before the next S
        if DEVICE == "cuda":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            torch.autograd.grad(attend(mod), (q, k, v, bias), do)
            _sync()
            rec["peak_extra_GiB"] = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
        if DEVICE == "cuda" and s == SEQS[-1]:
            try:
                rec["profile"] = _profile(lambda: torch.autograd.grad(attend(mod), (q, k, v, bias), do))
            except Exception as e:  # noqa: BLE001 - the table matters more
                rec["profile"] = [[f"profiler failed: {type(e).__name__}", 0]]
        fl = 4.0 * D * B * H * s * (s + 1) / 2
        rec["fwd_TF/s"] = fl / rec["fwd_ms"] / 1e9
        rec["bwd_TF/s"] = 2.5 * fl / rec["bwd_ms"] / 1e9
        rec["bwd_nograd_TF/s"] = 2.5 * fl / rec["bwd_nograd_ms"] / 1e9
        print(json.dumps(rec), flush=True)
        records.append(rec)
    bucket = _bucketed(SEQS[-1])
    print(json.dumps(bucket), flush=True)
    dense = {"S": DENSE_S, "dense": _check_dense(DENSE_S)}
    print(json.dumps(dense), flush=True)
    records += [bucket, dense]

    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (dry)"
    print(f"\nlearned relative bias + grad, B{B} H{H} d{D} {str(DTYPE)[6:]} causal, {name}")
    print("| S | first call s | fwd ms | bwd ms | fwd+bwd ms | bwd TF/s | bwd no-grad ms | grad cost | peak GiB | "
          "bitwise |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in records[:-2]:
        print(f"| {r['S']} | {r['first_call_s']:.1f} | {r['fwd_ms']:.2f} | {r['bwd_ms']:.2f} | "
              f"{r['fwd_ms'] + r['bwd_ms']:.2f} | {r['bwd_TF/s']:.0f} | {r['bwd_nograd_ms']:.2f} | "
              f"{r['bwd_ms'] / r['bwd_nograd_ms']:.2f}x | {r.get('peak_extra_GiB', 0):.2f} | {r['bitwise']} |")
    print(f"bucketed t[h, clamp(q - kv, -128, 128) + 128] S{bucket['S']}: bwd {bucket['bwd_ms']:.2f} ms, no grad "
          f"{bucket['bwd_nograd_ms']:.2f} ms ({bucket['bwd_ms'] / bucket['bwd_nograd_ms']:.2f}x), bitwise "
          f"{bucket['bitwise']}")
    c = records[0]["check"]
    print(f"check S{CHECK_S} vs float64 (max|diff|/max|ref|): " + ", ".join(f"{k} {v:.1e}" for k, v in c.items()))
    d = records[-1]["dense"]
    print(f"dense learned bias [1,H,S,S] S{DENSE_S} (per-score path): " + ", ".join(
        f"{k} {v:.1e}" if isinstance(v, float) and k != "fwd_bwd_ms" else f"{k} {v}" for k, v in d.items()))
    for r in records[:-2]:
        if "profile" in r:
            print(f"S{r['S']} fwd+bwd CUDA kernels (ms): " + "; ".join(f"{n} {ms}" for n, ms in r["profile"]))
    ok = (all(r["bitwise"] for r in records[:-2]) and d["bitwise"] and bucket["bitwise"] and max(c.values()) < 3e-2
          and d["dbias"] < 3e-2)
    print("PASS" if ok else "FAIL")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "learned_bias.json"), "w") as f:
            json.dump(records, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
