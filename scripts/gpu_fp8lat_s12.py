"""MLA absorbed decode over an fp8 latent cache, twelfth session (issue 27 part 2): the product's Gluon fp8 latent
decode (fagen/templates/gluon/mla_decode_fp8.py.j2, [Note] Gluon fp8 latent decode) against the Triton decode and
FlashMLA's fp8 decode, in one process; the serving bench's fp8 latent rows through the bench's own functions with
the selection (GluonBackend.select_fp8_latent) off and on.

    FLASHMLA_DIR=/tmp/fm PYTHONPATH=$PWD python3 scripts/gpu_fp8lat_s12.py  # < 70 s on an H100; $OUTX/gpu_fp8lat_s12.md

Phases, each a child process with a timeout (scripts/_phases.py); the checks run side by side and warm the builds:
1. check-*: the gluon module against float64 on the dequantized cache (passed as float8_e4m3fn: a kernel reading it
   as bf16 fails), NaN past the lengths 1000/77/513/0 (keys and per-token scales), pages shuffled; per token, per
   tensor (a float) and per KV head (a float32 [1]); the split rule, one split and three, batch_invariant (bitwise:
   each sequence alone against the batch); dense (Sk 777, the bench's form) and paged; Hq 8 Sq 2, Hq 16 Sq 3 (three
   programs of 16 rows), Hq 128 Sq 2; bad pages and lengths (no fault, another sequence keeps its bits); an empty
   sequence (out 0, lse -inf).
2. time: the bench's fp8 latent rows (fagen.bench run_case, impl fagen: the Triton decode with the selection off,
   the gluon one with it on; passes in rotated order, medians), then Hq 16 Sq 1 page 64 at b128 kv4k, b32 kv32k,
   b128 kv32k, b32 kv4k (% of copy over the bytes read) and Hq 128 Sq 2 b32 kv8k (TF/s): 8 calls in a CUDA graph,
   PASSES passes with the rows' order rotated, the median; FlashMLA fp8 (q e4m3) in the same process.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/, for _phases
from _phases import child_env, run_phase as run_child  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
D, DV, PAGE = 576, 512, 64
SCALE = 192 ** -0.5
PASSES = 3
LIMITS = dict(check=27, time=36, ncu=34)
CHECK_LENS = [1000, 77, 513, 0]
# name -> (backend, scale form, module kwargs): the timed rows at Hq 16 (H128: also at Hq 128 Sq 2)
VARIANTS = {
    "triton token": ("triton", "token", {}),
    "triton tensor": ("triton", "tensor", {}),
    "gluon token": ("gluon", "token", {}),
    "gluon tensor": ("gluon", "tensor", {}),
    "FlashMLA fp8 (q e4m3)": ("flashmla8", "tensor", {}),
    "gluon tensor lazy6": ("gluon-lazy6", "tensor", {}),
    "gluon token early": ("gluon-early", "token", {}),
    "gluon tensor early": ("gluon-early", "tensor", {}),
    "gluon token, 1 program an SM": ("gluon#1", "token", {}),
    "gluon token, 3 programs an SM": ("gluon#3", "token", {}),
}
# Round A (2026-11-27 16:58 UTC, results/fp8lat-A.txt) dropped: lazy6 per token (4-7% slower than the product),
# 4 programs an SM (7-40% slower).
H128 = ["triton tensor", "gluon tensor", "FlashMLA fp8 (q e4m3)"]
SHAPES = ((128, 4096, 16, 1), (32, 32768, 16, 1), (128, 32768, 16, 1), (32, 4096, 16, 1), (32, 8192, 128, 2))
BENCH_ROWS = ["decode-mla-absorbed-h16-kv4k-b128-fp8", "decode-mla-absorbed-h16-kv32k-b32-fp8"]
T0 = time.time()


def emit(section, case, impl, value, ms, note):
    print("ROW " + json.dumps([section, case, impl, value, "" if ms is None else f"{ms:.4f}", note]), flush=True)


sys.path.insert(0, ROOT)
from scripts.gpu_fp8lat_s11 import FlashMLA  # noqa: E402  (FlashMLA's fp8 and bf16 decode as a module)


def _spec(backend, hq, layout="paged", mask="causal"):
    import fagen
    return fagen.KernelSpec(head_dim=D, head_dim_v=DV, shared_kv=True, kind="decode", gqa=hq, dtype="bf16",
                            mask=mask, layout=layout, backend=backend, kv_dtype="fp8_e4m3")


_MODS = {}


def _module(backend, hq, layout="paged", mask="causal"):
    """A decode module (one a process and case): "triton", "gluon" (the product's), "gluon-lazyT" (the gluon one
    with the variant's fp8lat_lazy T: [Note] Lazy block max), "flashmla8"."""
    key = (backend, hq, layout, mask)
    if key not in _MODS:
        _MODS[key] = _new_module(backend, hq, layout, mask)
    return _MODS[key]


class _PerSM:
    """A gluon fp8 module whose split rule fills `n` programs an SM (its CTAS_PER_SM) instead of 2."""

    def __init__(self, mod, n):
        self.mod, self.n = mod, n

    def forward(self, *args, **kw):
        keep, self.mod.CTAS_PER_SM = self.mod.CTAS_PER_SM, self.n
        try:
            return self.mod.forward(*args, **kw)
        finally:
            self.mod.CTAS_PER_SM = keep


def _new_module(backend, hq, layout, mask):
    import fagen
    if "#" in backend:  # "gluon#N": the split rule at N programs an SM
        base, n = backend.split("#")
        return _PerSM(_module(base, hq, layout, mask), int(n))
    if backend.startswith("flashmla"):
        return FlashMLA(mask == "causal", "fp8" if backend == "flashmla8" else "bf16")
    if backend.startswith("gluon-"):  # a variant of the gluon render: gluon-lazyT, gluon-early
        from fagen import backends
        from fagen.codegen.render import render
        from fagen.runtime.loader import load_source
        var = {"fp8lat_lazy": int(backend[len("gluon-lazy"):])} if backend.startswith("gluon-lazy") else \
            {"fp8lat_early_fetch": 1}
        keep = backends.GLUON.variant
        spec = _spec("gluon", hq, layout, mask)
        try:
            backends.GLUON.variant = {**keep, **var}
            render.cache_clear()
            src = render(spec).source
            mod = load_source(src, f"{spec.name}_{backend[len('gluon-'):]}")
        finally:
            backends.GLUON.variant = keep
            render.cache_clear()
        assert "fp8lat_lazy" not in var or mod.LAZY == var["fp8lat_lazy"]
        assert "fp8lat_early_fetch" not in var or "[Note] Early first block" in src
        return mod
    return fagen.load(_spec(backend, hq, layout, mask))


def _inputs(form, b, n_max, lens, seed, hq=16, sq=1, tails=False, layout="paged"):
    import torch
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, hq, sq, D, device="cuda", generator=gen).bfloat16()
    if layout == "dense":
        cache = torch.randn(b, 1, n_max, D, device="cuda", generator=gen).to(torch.float8_e4m3fn)
        kw = {"token": lambda: torch.exp2(torch.rand(b, 1, n_max, device="cuda", generator=gen) * 6 - 3),
              "tensor": lambda: 0.7, "head": lambda: torch.tensor([1.3], device="cuda")}[form]()
        return q, cache, None, None, {"k_scale": kw}
    pages = b * -(-n_max // PAGE)
    cache = torch.randn(pages, PAGE, 1, D, device="cuda", generator=gen).to(torch.float8_e4m3fn)
    table = torch.randperm(pages, device="cuda", generator=gen).to(torch.int32).view(b, -1)
    kw = {"token": lambda: torch.exp2(torch.rand(cache.shape[:-1], device="cuda", generator=gen) * 6 - 3),
          "tensor": lambda: 0.7, "head": lambda: torch.tensor([1.3], device="cuda")}[form]()
    if tails:  # keys past each length hold NaN (the byte 0x7f), their per-token scales too
        for i, n in enumerate(lens):
            for p in range(table.shape[1]):
                if n - p * PAGE < PAGE:
                    pg, lo = int(table[i, p]), max(0, n - p * PAGE)
                    cache.view(torch.uint8)[pg, lo:] = 0x7F
                    if form == "token":
                        kw[pg, lo:] = float("nan")
    return q, cache, table, torch.tensor(lens, dtype=torch.int32, device="cuda"), {"k_scale": kw}


def _check(m, q, cache, table, lens, kw, form, layout="paged", sq=1):
    """max error against float64 on the dequantized cache (raises past bf16's tolerance); an empty row's out 0 and
    lse -inf."""
    import torch
    from fagen.verify import reference
    from fagen.verify.tolerances import LSE_TOLERANCE, TOLERANCE, compare
    call = dict(scale=SCALE, **kw) if layout == "dense" else dict(block_table=table, seqlens_k=lens, scale=SCALE, **kw)
    if form == "rule":
        out, lse = m.forward(q, cache, None, **call)
    elif form == "inv":
        out, lse = m.forward(q, cache, None, batch_invariant=True, **call)
    else:
        out, lse = m.forward_split(q, cache, None, num_splits=int(form[1:]), **call)
    ks = kw["k_scale"]
    keys_all = reference.dequantize(cache, ks, head_dim_axis=1 if layout == "dense" else 2)
    worst = 0.0
    n_seq = q.shape[0]
    for i in range(n_seq):
        if layout == "dense":
            keys, n = keys_all[i:i + 1], cache.shape[2]
        else:
            n = int(lens[i])
            keys = keys_all[table[i].long()].reshape(-1, 1, D)[:n].transpose(0, 1)[None]
        qi = q[i:i + 1].double()
        if n == 0:
            assert (out[i] == 0).all() and (lse[i] == float("-inf")).all(), "an empty sequence: out 0, lse -inf"
            continue
        want, wlse = reference.attention(qi, keys, None, head_dim_v=DV, mask="causal", scale=SCALE)
        terms, _ = reference.attention(qi, keys, keys[..., :DV].abs(), mask="causal", scale=SCALE)
        unit = terms.clamp(min=1.0)
        worst = max(worst, compare(f"out {i}", out[i:i + 1].double() / unit, want / unit, **TOLERANCE["bf16"]))
        compare(f"lse {i}", lse[i:i + 1].double(), wlse, **LSE_TOLERANCE)
    return worst, out, lse


def check_phase(name):  # noqa: C901
    import torch
    groups = {
        "check-tok": [("token", "paged", 16, 1, f) for f in ("rule", "s1", "s3", "inv")],
        "check-tensor": [("tensor", "paged", 16, 1, f) for f in ("rule", "s1", "s3")] + [("head", "paged", 16, 1,
                                                                                          "rule")],
        "check-dense": [("head", "dense", 16, 1, "rule"), ("head", "dense", 16, 1, "s3"),
                        ("token", "dense", 16, 1, "rule"), ("tensor", "dense", 16, 1, "s1")],
        "check-lazy": [("tensor", "paged", 16, 1, "rule"), ("tensor", "paged", 16, 1, "s3"),
                       ("token", "paged", 16, 1, "inv")],
        "check-early": [("token", "paged", 16, 1, "rule"), ("tensor", "paged", 16, 1, "s3"),
                        ("token", "paged", 16, 1, "inv"), ("head", "dense", 16, 1, "rule")],
        "check-rows": [("tensor", "paged", 8, 2, "rule"), ("token", "paged", 16, 3, "rule"),
                       ("tensor", "paged", 128, 2, "rule"), ("tensor", "paged", 128, 2, "s1")],
    }
    if name == "check-warm":  # the Triton decode and FlashMLA, built for the time phase
        warm = (("triton", "token", "paged", 16, 1), ("triton", "tensor", "paged", 16, 1),
                ("flashmla8", "tensor", "paged", 16, 1), ("triton", "head", "dense", 16, 1),
                ("triton", "tensor", "paged", 128, 2))
        for backend, form, layout, hq, sq in warm:
            t = time.time()
            try:
                m = _module(backend, hq, layout, "none" if layout == "dense" else "causal")
                q, cache, table, lens, kw = _inputs(form, 2, 4096, [4096, 4096], 1, hq, sq, layout=layout)
                if layout == "dense":
                    m.forward(q, cache, None, scale=SCALE, **kw)
                else:
                    m.forward(q, cache, None, block_table=table, seqlens_k=lens, scale=SCALE, **kw)
                torch.cuda.synchronize()
                emit("check", f"warm h{hq} sq{sq} b2 kv4k", f"{backend} {form} {layout}", "built", None,
                     f"{time.time() - t:.1f} s")
            except Exception as e:  # noqa: BLE001
                emit("check", "warm", f"{backend} {form}", "FAIL", None, f"ERROR {type(e).__name__}: {str(e)[:150]}")
        return
    if name == "check-safety":
        _safety()
        return
    for form, layout, hq, sq, how in groups[name]:
        case = f"{layout} h{hq} sq{sq} {form} {how}"
        t = time.time()
        try:
            backend = {"check-lazy": "gluon-lazy6", "check-early": "gluon-early"}.get(name, "gluon")
            m = _module(backend, hq, layout, "none" if layout == "dense" else "causal")  # dense: the bench's spec
            if layout == "dense":
                q, cache, table, lens, kw = _inputs(form, 3, 777, None, 3, hq, sq, layout="dense")
            else:
                q, cache, table, lens, kw = _inputs(form, len(CHECK_LENS), 16 * PAGE, CHECK_LENS, 3, hq, sq,
                                                    tails=True)
            err, out, lse = _check(m, q, cache, table, lens, kw, how, layout, sq)
            note = ""
            if how == "inv":  # each sequence alone: the same bits
                same = True
                for i in range(q.shape[0]):
                    kwi = kw
                    o1, l1 = m.forward(q[i:i + 1], cache, None, block_table=table[i:i + 1],
                                       seqlens_k=lens[i:i + 1], scale=SCALE, batch_invariant=True, **kwi)
                    same &= torch.equal(o1, out[i:i + 1]) and torch.equal(l1, lse[i:i + 1])
                wide = torch.cat([table, torch.zeros_like(table)], 1)
                o2, l2 = m.forward(q, cache, None, block_table=wide, seqlens_k=lens, scale=SCALE,
                                   batch_invariant=True, **kw)
                same &= torch.equal(o2, out) and torch.equal(l2, lse)
                note = f"; bitwise alone and with a 2x wider table: {'yes' if same else 'NO'}"
                if not same:
                    raise AssertionError("batch_invariant: not the same bits")
            emit("check", case, backend, "ok", None, f"err {err:.1e}; cache {cache.dtype}{note}; "
                 f"{time.time() - t:.1f} s")
        except Exception as e:  # noqa: BLE001 - a failure is a row
            import traceback
            traceback.print_exc(file=sys.stdout)
            emit("check", case, backend, "FAIL", None, f"ERROR {type(e).__name__}: "
                 f"{(str(e).splitlines() or [''])[0][:150]}")


def _safety():
    """Bad pages (-7, 10^9) and lengths (10^6, -5) in sequences 1 and 2: no fault, sequence 0 keeps its bits."""
    import torch
    m = _module("gluon", 16)
    for form in ("token", "tensor"):
        t = time.time()
        try:
            q, cache, table, lens, kw = _inputs(form, 3, 8 * PAGE, [300, 300, 300], 4)
            good, lse0 = m.forward(q, cache, None, block_table=table, seqlens_k=lens, scale=SCALE, **kw)
            bt, ln = table.clone(), lens.clone()
            bt[1, 0], bt[1, 2], bt[2, 1] = -7, 10**9, 10**9
            ln[1], ln[2] = 10**6, -5
            out, lse = m.forward(q, cache, None, block_table=bt, seqlens_k=ln, scale=SCALE, **kw)
            out3, _ = m.forward_split(q, cache, None, num_splits=3, block_table=bt, seqlens_k=ln, scale=SCALE, **kw)
            torch.cuda.synchronize()
            ok = torch.equal(out[0], good[0]) and (out[2] == 0).all() and (lse[2] == float("-inf")).all()
            emit("check", f"bad pages/lengths {form}", "gluon fp8 (product)", "ok" if ok else "FAIL", None,
                 f"no fault; sequence 0 same bits {torch.equal(out[0], good[0])}; length -5: out 0 "
                 f"{bool((out[2] == 0).all())}; {time.time() - t:.1f} s")
        except Exception as e:  # noqa: BLE001
            emit("check", f"bad pages/lengths {form}", "gluon fp8 (product)", "FAIL", None,
                 f"ERROR {type(e).__name__}: {str(e)[:150]}")


def graph_ms(fns, calls=8, total_ms=12.0):
    """ms a call of `calls` calls captured in one CUDA graph (alternating between fns) and replayed back to back."""
    import torch
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fns[i % len(fns)]()
    g.replay()
    torch.cuda.synchronize()
    t = time.perf_counter()
    g.replay()
    torch.cuda.synchronize()
    n = max(3, min(200, int(total_ms / max((time.perf_counter() - t) * 1e3, 1e-3))))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (n * calls)


def bench_rows():
    """The serving bench's fp8 latent rows through fagen.bench's run_case (impl fagen): the selection off (the
    Triton decode) and on (the gluon fp8 decode), PASSES passes in rotated order, the median GB/s."""
    from fagen import backends
    from fagen.bench.cases import BenchOptions
    from fagen.bench.impls import run_case
    from fagen.bench.serving import serving_rows
    cases = {c.name: c for c in serving_rows()}
    res, keep = {}, backends.GLUON.select_fp8_latent
    for p in range(PASSES):
        for name in BENCH_ROWS:
            order = [False, True] if p % 2 == 0 else [True, False]
            for sel in order:
                if time.time() - T0 > LIMITS["time"] * 0.45:
                    break
                backends.GLUON.select_fp8_latent = sel
                opts = BenchOptions(impls=("fagen", ), warmup_ms=10, rep_ms=40, sets=2, check=p == 0)
                rec = run_case(cases[name], opts, log=lambda s: None)[0]
                res.setdefault((name, sel), []).append(rec)
    backends.GLUON.select_fp8_latent = keep
    for (name, sel), recs in res.items():
        gbs = [r["gbs"] for r in recs if r.get("gbs")]
        r0 = recs[0]
        emit("bench", name, "gluon fp8 (selected)" if sel else "triton (selection off)",
             f"{statistics.median(gbs):.0f} GB/s" if gbs else r0["status"], statistics.median(
                 [r["ms"] for r in recs if r.get("ms")]) if gbs else None,
             f"{len(gbs)} passes {'/'.join(f'{g:.0f}' for g in gbs)}; check {r0.get('check')} "
             f"err {r0.get('max_err')}; spec {r0.get('spec')}; {r0.get('note', '')[:80]}")


def time_phase():  # noqa: C901
    import torch
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    copy_graph = min(graph_ms([lambda: y.copy_(x)], calls=4, total_ms=10) for _ in range(2))
    for _ in range(3):
        y.copy_(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):  # back to back, as the earlier sessions' 3008 GB/s (round A's graph of 4 copies read 2440)
        y.copy_(x)
    end.record()
    torch.cuda.synchronize()
    copy_ms = start.elapsed_time(end) / 20
    peak = 2 * x.numel() / copy_ms / 1e6
    x = y = None
    emit("time", "device copy (read + write)", "torch copy_", f"{peak:.0f} GB/s", copy_ms,
         f"20 back to back; a CUDA graph of 4: {2 * (1 << 30) / copy_graph / 1e6:.0f} GB/s")
    try:
        bench_rows()
    except Exception as e:  # noqa: BLE001
        import traceback
        traceback.print_exc(file=sys.stdout)
        emit("bench", "(rows)", "-", "-", None, f"ERROR {type(e).__name__}: {str(e)[:150]}")
    mods = {}
    for b, n, hq, sq in SHAPES:
        case = f"h{hq} sq{sq} page{PAGE} b{b} kv{n}"
        names = [v for v in VARIANTS if hq == 16 or v in H128]
        made, fns, read, ref = {}, {}, {}, {}
        try:
            for v in names:
                backend, form, _ = VARIANTS[v]
                if form not in made:
                    q, cache, table, lens, kw = _inputs(form, b, n, [n] * b, 5, hq, sq)
                    made[form] = (q, cache, cache.clone(), table, lens, kw)
                q, cache, cache2, table, lens, kw = made[form]
                if (backend, hq) not in mods:
                    mods[(backend, hq)] = _module(backend, hq)
                m = mods[(backend, hq)]
                kwv = {"k_scale": kw["k_scale"]}
                c1 = (lambda m=m, q=q, c=cache, t=table, ln=lens, k=kwv:  # noqa: E731
                      m.forward(q, c, None, block_table=t, seqlens_k=ln, scale=SCALE, **k))
                c2 = (lambda m=m, q=q, c=cache2, t=table, ln=lens, k=kwv:  # noqa: E731
                      m.forward(q, c, None, block_table=t, seqlens_k=ln, scale=SCALE, **k))
                out = c1()[0].float()
                diff = ""
                if form in ref:
                    diff = f"; max |diff| to {ref[form][0]} {(out - ref[form][1]).abs().max().item():.1e}"
                ref.setdefault(form, (v, out))
                fns[v] = ([c1, c2], diff)
                read[v] = b * n * D + (b * n * 4 if form == "token" else 0) + q.numel() * 2 * (1 + DV / D)
        except Exception as e:  # noqa: BLE001
            import traceback
            traceback.print_exc(file=sys.stdout)
            emit("time", case, "(inputs)", "-", None, f"ERROR {type(e).__name__}: {str(e)[:150]}")
        times = {v: [] for v in fns}
        order = list(fns)
        for p in range(PASSES):  # the first-timed row pays a penalty (last session: 8-11%): rotate the order
            for v in order[p % len(order):] + order[:p % len(order)]:
                try:
                    times[v].append(graph_ms(fns[v][0]))
                except Exception as e:  # noqa: BLE001
                    emit("time", case, v, "-", None, f"ERROR {type(e).__name__}: {str(e)[:150]}")
                    fns[v] = ([], "")
        flops = 2 * (D + DV) * hq * b * (sq * n - sq * (sq - 1) // 2)
        for v, ts in times.items():
            if not ts:
                continue
            ms = statistics.median(ts)
            value = f"{100 * read[v] / ms / 1e6 / peak:.1f}%" if hq == 16 else f"{flops / ms / 1e9:.0f} TF/s"
            emit("time", case, v, value, ms, f"graph, median of {len(ts)} ({'/'.join(f'{t:.4f}' for t in ts)} ms), "
                 f"{read[v] / ms / 1e6:.0f} GB/s{fns[v][1]}")
        del made, fns, ref
        torch.cuda.empty_cache()
        if time.time() - T0 > LIMITS["time"] - 4:
            emit("time", "(rest)", "-", "-", None, "stopped: the phase's time")
            break


def ncu_target():
    """One launch each of the product's kernel per token and per tensor at Hq 16 Sq 1 b128 kv4k (the ncu phase)."""
    import torch
    only = os.environ.get("FP8LAT_NCU_ONLY")
    calls = []
    for v in ("gluon token", "gluon tensor"):
        if only and v != only:
            continue
        backend, form, _ = VARIANTS[v]
        q, cache, table, lens, kw = _inputs(form, 128, 4096, [4096] * 128, 5)
        m = _module(backend, 16)
        fn = (lambda m=m, q=q, c=cache, t=table, ln=lens, k=kw:  # noqa: E731
              m.forward(q, c, None, block_table=t, seqlens_k=ln, scale=SCALE, **k))
        fn()
        fn()
        calls.append((v, fn))
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for v, fn in calls:
        fn()
        torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print("ncu-target launched: " + "; ".join(v for v, _ in calls), flush=True)


def ncu_phase():
    """ncu over ncu-target (the sections of scripts/gpu_fp8lat_s11.py: occupancy, issue, stalls per issue), then the
    per-token kernel's SASS lines with the most stall samples; raw files under $OUTX."""
    import subprocess
    from scripts.gpu_fp8lat_s11 import NCU, NCU_KEYS, NCU_SECTIONS, _ncu_rows, _num, ncu_source
    out_dir = os.environ.get("OUTX") or "/tmp"
    env = child_env("/tmp/fagen-cache-gpu-fp8lat-s12", ROOT)
    target = [sys.executable, os.path.abspath(__file__), "--phase", "ncu-target"]
    t = time.time()
    cmd = [NCU, "--profile-from-start", "off", "--clock-control", "none", "--csv", "--page", "raw"]
    for sec in NCU_SECTIONS:
        cmd += ["--section", sec]
    try:
        r = subprocess.run(cmd + target, env=env, capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        print("ncu raw: timed out after 20 s", flush=True)
        return
    with open(os.path.join(out_dir, "ncu_raw.csv"), "w") as f:
        f.write(r.stdout)
    print(f"ncu raw: rc {r.returncode}, {time.time() - t:.1f} s; " + " | ".join(
        x for x in (r.stderr + r.stdout).splitlines() if "ncu-target" in x or "==ERROR==" in x)[:400], flush=True)
    for row in _ncu_rows(r.stdout):
        name = row.get("Kernel Name", "?")[:40]
        vals = {k.split(".")[0] if k != "gpu__time_duration.sum" else "us": row.get(k) for k in NCU_KEYS if k in row}
        if "us" in vals and _num(vals["us"]) is not None:
            vals["us"] = f"{_num(vals['us']) / 1e3:.1f}"
        stalls = sorted(((_num(v), k) for k, v in row.items() if "issue_stalled" in k and "per_issue_active" in k
                         and _num(v) is not None), reverse=True)[:8]
        emit("ncu", "h16 sq1 b128 kv4k e4m3", name, vals.get("us", "-"), None,
             "; ".join(f"{k} {v}" for k, v in vals.items() if k != "us") + " || stalls: "
             + ", ".join(f"{k.split('stalled_')[-1].split('_per_issue')[0]} {v:.2f}" for v, k in stalls))
    left = LIMITS["ncu"] - 3 - (time.time() - T0)
    if left > 6:
        ncu_source("gluon token", "_mla_decode_fp8", env, target, out_dir, left)


def phase(name):
    if name == "time":
        time_phase()
    elif name == "ncu":
        ncu_phase()
    elif name == "ncu-target":
        ncu_target()
    else:
        check_phase(name)


CHECKS = ["check-tok", "check-tensor", "check-dense", "check-rows", "check-safety", "check-warm", "check-lazy",
          "check-early"]


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--phase":
        phase(sys.argv[2])
        return
    env = child_env("/tmp/fagen-cache-gpu-fp8lat-s12", ROOT)
    rows, logs, rcs = [], [], {}
    lock = threading.Lock()

    def on_line(line):
        with lock:
            logs.append(line)
            if line.startswith("ROW "):
                rows.append(json.loads(line[4:]))
                print(" | ".join(rows[-1]), flush=True)
            else:
                print(line, end="", flush=True)

    def run(name, limit):
        print(f"[{time.time() - T0:6.1f}s] #### phase {name} (timeout {limit}s)", flush=True)
        rc, _ = run_child(os.path.abspath(__file__), name, limit, env, on_line)
        rcs[name] = rc
        print(f"[{time.time() - T0:6.1f}s] #### phase {name}: rc={rc}", flush=True)

    threads = [threading.Thread(target=run, args=(g, LIMITS["check"])) for g in CHECKS]
    threads.append(threading.Thread(target=run, args=("ncu", LIMITS["ncu"])))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    run("time", min(LIMITS["time"], 68 - (time.time() - T0)))
    for n, rc in rcs.items():
        if rc != 0:
            rows.append([n, "(phase)", "-", "-", "", f"ERROR rc={rc}"])
    text = "\n".join(["| section | case | impl | value | ms | note |", "|---|---|---|---|---|---|"]
                     + ["| " + " | ".join(r) + " |" for r in rows])
    print("\n" + text, flush=True)
    if os.environ.get("OUTX"):
        with open(os.path.join(os.environ["OUTX"], "gpu_fp8lat_s12.md"), "w") as f:
            f.write(text + "\n\n" + "".join(logs))
    bad = [r for r in rows if "ERROR" in r[5] or r[3] == "FAIL"]
    print(f"done in {time.time() - T0:.0f} s; {len(bad)} failures", flush=True)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
