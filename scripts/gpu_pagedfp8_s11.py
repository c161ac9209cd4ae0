"""Paged fp8 KV-cache decode bandwidth, eleventh session (issue 27; docs/serving.md "fp8 KV decode, eleventh
session"): several KV heads a program ([Note] Paged KV heads together, PAGED_HEADS) against the default (one head a
program) and the dense fp8 cache, each checked against float64, timed three ways.

    PYTHONPATH=$PWD python3 scripts/gpu_pagedfp8_s11.py      # ~75 s on an H100; one table; $OUTX/gpu_pagedfp8_s11.md
    GPU_PAGEDFP8_S11_DRY=1 PYTHONPATH=$PWD python3 scripts/gpu_pagedfp8_s11.py   # the CPU interpreter, tiny shapes

Phases, each in a child process with a timeout (a kernel that faults or hangs loses its phase, not the table):
1. check: d128 h32/8 paged (pages of 16 and 64), each candidate against the float64 reference on the dequantized
   cache (reference.dequantize) at lengths 1..1200 (multiples of neither the page nor the key tile; 28 sequences;
   and 3 splits), per-head and per-tensor scales; the result must FAIL against the reference on the cache's bytes
   read as bf16 and on the cache without its scales (the check can fail). Batch invariance: with
   batch_invariant=True out and lse of 3 sequences equal, bitwise, those of the sequence run alone (its own pages).
2. paged: d128 h32/8 sq1, page 16 at b32 / b128 kv8192 and b32 kv32768, page 64 at b32 kv8192: the dense fp8 cache,
   the paged fp8 candidates; GB/s of the bytes read (K and V, 1 byte an element) and % of a device copy (torch copy_
   of 1 GB, same process), each timed (a) back to back on two copies of the inputs (a decode loop, host launch
   included), (b) replayed from a CUDA graph of 20 calls (% of the back-to-back copy: a captured copy_ is a memcpy
   node) and (c) under do_bench (its L2 flush costs ~17-21 us a call).
Candidates: text replacements on the render: "hN" PAGED_HEADS = N (N KV heads a program, BLOCK_N / N keys a step);
"hN s2" the same at num_stages 2 (less shared memory: two programs an SM); "h4 fill" with PAGED_HEADS_FILL (fewer heads
a program where h would leave the GPU's program slots idle).
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/, for _phases
from _phases import child_env, run_phase as run_child  # noqa: E402

DRY = os.environ.get("GPU_PAGEDFP8_S11_DRY") == "1"
if DRY:
    os.environ.setdefault("TRITON_INTERPRET", "1")
PHASES = {"check": 22, "paged": 38, "splits": 14} if not DRY else {"check": 1800, "paged": 1800, "splits": 1800}
if os.environ.get("GPU_PAGEDFP8_S11_PHASES"):  # "name:seconds,..." (phases: check, paged, splits, bench)
    PHASES = {n: float(t) for n, t in (p.split(":") for p in os.environ["GPU_PAGEDFP8_S11_PHASES"].split(","))}
H = lambda n: [("\nPAGED_HEADS = 1\n", f"\nPAGED_HEADS = {n}\n")]  # noqa: E731 (the default: 1)
T = lambda n, w, s: dict(block_m=64, block_n=n, num_warps=w, num_stages=s)  # noqa: E731
# sm_90 ptxas (triton 3.6, e4m3, ROWS32 1, one split, compiled on the CPU; the split kernel at m64n128w8s3): h1 176
# registers, 104 KB of shared memory; h2 168, 106 KB; h4 154, 113 KB; h8 255 (128 bytes spilled), 161 KB (one
# program an SM). cp.async of 16 bytes in every case.
CANDS = {"default": ([], {}), "h2": (H(2), {}), "h4": (H(4), {}), "h8": (H(8), {}),
         "h4 s2": (H(4), T(128, 8, 2)), "h8 s2": (H(8), T(128, 8, 2)),
         "h4 fill": (H(4) + [("\nPAGED_HEADS_FILL = False\n", "\nPAGED_HEADS_FILL = True\n")], {})}
# The bench phase: the serving rows (the product's default, then PAGED_HEADS set on the loaded module, in one process)
BENCH_ROWS = (("decode-d128-kv8k-b32-fp8-paged16", None), ("decode-d128-kv8k-b32-fp8", None),
              ("decode-d128-kv8k-b32-fp8-paged16", 2))
DEFAULT_HEADS = {}
# Round A timed ("default", "h4", "h2", "h4 s2", "h8") and split h1 / h2 / h4 at b8 kv32k: every h > 1 lost (58-74% of
# copy against 90-94%). Round B (GPU_PAGEDFP8_S11_ROUND=B): the default and h2 again beside the serving bench's rows.
ROUND_B = os.environ.get("GPU_PAGEDFP8_S11_ROUND") == "B"
# The lab phase (round B): lab/paged_heads3d.py at (heads, keys a step, warps, stages); sm_90 ptxas (CPU): h4 n32 w8 s3
# 224 registers, 64 KB; h8 n16 w8 s3 192 registers, 80 KB (one program an SM by registers, both)
LAB_RUNS = ((4, 32, 8, 3), (8, 16, 8, 3))
TIMED = ("default", "h2") if ROUND_B else ("default", "h4", "h2", "h4 s2", "h8")
SPLIT_RUNS = (("default", ("rule",)), ("h2", ("rule",)), ("h4", ("rule", 8)))  # the splits phase: b8 kv32k
SHAPES = ((32, 8192, 16), (128, 8192, 16), (32, 32768, 16), (32, 8192, 64))  # (batch, keys, page)
SHAPES = SHAPES[:2] if ROUND_B else SHAPES
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def phase(name):  # noqa: C901 - one phase in this process
    import torch

    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from gpu_rows import T0, row
    from gpu_rows import bench as _bench

    import fagen
    from fagen.runtime.loader import load_source
    from fagen.verify import reference
    from fagen.verify.tolerances import LSE_TOLERANCE, TOLERANCE, compare

    dev = "cpu" if DRY else "cuda"
    E4M3 = torch.float8_e4m3fn
    HD, HKV, G = (32, 8, 4) if DRY else (128, 8, 4)

    def emit(section, case, impl, value, unit, ms, note=""):
        row(section, case, impl, value, unit, ms, note)
        print("ROW " + json.dumps([section, case, impl, "-" if value is None else f"{value:.1f} {unit}",
                                   "" if ms is None else f"{ms:.4f}", note]), flush=True)

    def guarded(section, case, impl, fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - a failure is a row, never the end of the phase
            import traceback
            emit(section, case, impl, None, "", None, f"ERROR {type(e).__name__}: {str(e).splitlines()[0][:150]}")
            traceback.print_exc(file=sys.stdout)

    def bench(fn):
        return _bench(fn, DRY, warmup=10, rep=30)

    def loop(fns, total_ms=20.0):
        """ms a call, back to back with no L2 flush, alternating between the fns (each on its own copy of the
        inputs, larger than the L2): what a decode loop sees, the host's launch included."""
        if DRY:
            return bench(fns[0])
        for f in fns:
            f()
        torch.cuda.synchronize()
        t = time.perf_counter()
        fns[0]()
        torch.cuda.synchronize()
        n = max(8, min(400, int(total_ms / max((time.perf_counter() - t) * 1e3, 1e-3))))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(n):
            fns[i % len(fns)]()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / n

    def graphed(fns, calls=20, reps=3):
        """ms a call replayed from a CUDA graph of `calls` calls alternating between the fns: the kernels alone."""
        if DRY:
            return bench(fns[0])
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for f in fns:
                f()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(calls):
                fns[i % len(fns)]()
        g.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        del g
        return start.elapsed_time(end) / (reps * calls)

    mods = {}

    def module(spec_kw, text):
        """The module of this spec with `text` ((old, new) replacements on the render) applied."""
        key = (json.dumps(spec_kw, sort_keys=True), tuple(text))
        if key not in mods:
            spec = fagen.KernelSpec(**spec_kw)
            if not text:
                mods[key] = fagen.load(spec)
            else:
                src = fagen.generate(spec)
                for old, new in text:
                    if old not in src:
                        raise RuntimeError(f"{old!r} not in the render")
                    src = src.replace(old, new)
                mods[key] = load_source(src, f"{spec.name}_{abs(hash(tuple(text))) % 10**8}")
        return mods[key]

    def spec_kw(kv, layout, **tiles):
        return dict(head_dim=HD, gqa=G, dtype="bf16", kind="decode", kv_dtype=kv, layout=layout,
                    **(dict(tiles, block_n=128) if DRY else tiles))

    def scales(shape, gen):
        return torch.exp2(torch.rand(shape, device=dev, generator=gen) * 6 - 3)  # log-uniform 1/8 .. 8

    def to_pages(x, page, order="", gen=None):
        """[B, H, S, D] (S a multiple of page) -> pages [B*S/page, page, H, D] in a random order and the table
        [B, S/page]; "dense bytes": the dense cache itself viewed as pages (the dense kernel's bytes and order)."""
        b, h, s, d = x.shape
        n = s // page
        if order == "dense bytes":
            x = x.clone()
            cache = x.as_strided((b * h * n - (h - 1) * n, page, h, d), (page * d, d, s * d, 1))
            table = (torch.arange(b, device=dev)[:, None] * h * n + torch.arange(n, device=dev)).to(torch.int32)
            return cache, table
        if order == "in order":
            perm = torch.arange(b * n, device=dev)
        elif order == "seq shuffle":  # each sequence's pages shuffled among its own slots
            perm = (torch.argsort(torch.rand(b, n, device=dev, generator=gen), 1)
                    + torch.arange(b, device=dev)[:, None] * n).reshape(-1)
        else:
            perm = torch.randperm(b * n, device=dev, generator=gen)
        inv = perm.argsort()
        if order == "hnd":  # page p stored [H, page, D], viewed [page, H, D]
            cache = x.view(b, h, n, page, d).permute(0, 2, 1, 3, 4).reshape(b * n, h, page, d)[inv].transpose(1, 2)
        else:
            cache = x.view(b, h, n, page, d).permute(0, 2, 3, 1, 4).reshape(b * n, page, h, d)[inv]
        return cache, perm.to(torch.int32).view(b, n)

    def gathered(cache, table, i, n):
        """Sequence i's first n keys of a paged cache as [1, H, n, D] (float64 when cache is)."""
        return cache[table[i].long()].reshape(-1, cache.shape[2], cache.shape[3])[:n].transpose(0, 1)[None]

    def misread_bf16(x):
        """x's bytes read two at a time as bf16 (each value twice, to keep the width): a kernel reading the cache
        as bf16."""
        return x.view(torch.uint8).view(torch.bfloat16).double().nan_to_num(0.0).clamp(-1e4, 1e4)\
            .repeat_interleave(2, -1)

    def problem(page, b=None, seed=None):
        b = b or (3 if DRY else 28)  # 28 x 8 KV heads: one split, as at the timed shapes (the same kernels)
        gen = torch.Generator(device=dev).manual_seed(page if seed is None else seed)
        lens = torch.randint(1, (100 if DRY else 1200) + 1, (b,), device=dev, generator=gen, dtype=torch.int32)
        lens[0], lens[1] = (100, 7) if DRY else (1000, 77)  # neither a multiple of a page nor of a key tile
        width = -(-int(lens.max()) // page) + 1
        q = torch.randn(b, HKV * G, 1, HD, device=dev, generator=gen).mul(2).bfloat16()
        kc = torch.randn(b * width + 3, page, HKV, HD, device=dev, generator=gen).to(E4M3)
        vc = torch.randn(b * width + 3, page, HKV, HD, device=dev, generator=gen).to(E4M3)
        table = torch.randperm(b * width + 3, device=dev, generator=gen)[:b * width].to(torch.int32).view(b, width)
        return gen, lens, q, kc, vc, table

    def check(cand, page, form, splits=None):
        gen, lens, q, kc, vc, table = problem(page)
        b = q.shape[0]
        ks, vs = (0.7, 1.6) if form == "tensor" else (scales((HKV,), gen), scales((HKV,), gen))
        m = module(spec_kw("fp8_e4m3", "paged", **CANDS[cand][1]), CANDS[cand][0])
        if splits:
            out, lse = m.forward_split(q, kc, vc, num_splits=splits, block_table=table, seqlens_k=lens, k_scale=ks,
                                       v_scale=vs)
        else:
            out, lse = m.forward(q, kc, vc, block_table=table, seqlens_k=lens, k_scale=ks, v_scale=vs)
        kd, vd = reference.dequantize(kc, ks, head_dim_axis=2), reference.dequantize(vc, vs, head_dim_axis=2)
        worst, far = 0.0, []
        for i in (0, 1, 2, b - 1):
            n = int(lens[i])
            k, v = gathered(kd, table, i, n), gathered(vd, table, i, n)
            want, wlse = reference.attention(q[i:i + 1].double(), k, v)
            terms, _ = reference.attention(q[i:i + 1].double(), k, v.abs())
            unit = terms.clamp(min=1.0)
            got = out[i:i + 1].double() / unit
            worst = max(worst, compare(f"out {i}", got, want / unit, **TOLERANCE["bf16"]))
            compare(f"lse {i}", lse[i:i + 1], wlse, **LSE_TOLERANCE)
            if i == 0:  # the check can fail: the cache read as bf16, or its scales dropped, is far from the result
                kb, vb = gathered(misread_bf16(kc), table, i, n), gathered(misread_bf16(vc), table, i, n)
                for what, (k2, v2) in (("read as bf16", (kb, vb)),
                                       ("no scales", (gathered(kc.double(), table, i, n),
                                                      gathered(vc.double(), table, i, n)))):
                    wrong, _ = reference.attention(q[i:i + 1].double(), k2, v2)
                    try:
                        compare(what, got, wrong / unit, **TOLERANCE["bf16"])
                    except AssertionError:
                        far.append(what)
                    else:
                        raise AssertionError(f"the result also matches the reference on the cache {what}")
        return worst, far

    def invariant(cand, page):
        """batch_invariant=True: sequences 0, 1 and the last give the same bits alone (their own pages) as in the
        batch."""
        gen, lens, q, kc, vc, table = problem(page, seed=99)
        ks, vs = scales((HKV,), gen), scales((HKV,), gen)
        m = module(spec_kw("fp8_e4m3", "paged", **CANDS[cand][1]), CANDS[cand][0])
        out, lse = m.forward(q, kc, vc, block_table=table, seqlens_k=lens, k_scale=ks, v_scale=vs,
                             batch_invariant=True)
        for i in (0, 1, q.shape[0] - 1):
            n_pages = -(-int(lens[i]) // page)
            own = table[i, :n_pages].long()
            o1, l1 = m.forward(q[i:i + 1], kc[own], vc[own],
                               block_table=torch.arange(n_pages, device=dev, dtype=torch.int32)[None],
                               seqlens_k=lens[i:i + 1], k_scale=ks, v_scale=vs, batch_invariant=True)
            if not (torch.equal(o1, out[i:i + 1]) and torch.equal(l1, lse[i:i + 1])):
                raise AssertionError(f"sequence {i} ({int(lens[i])} keys): not the same bits alone, max diff "
                                     f"{(o1.float() - out[i:i + 1].float()).abs().max().item():.2e}")
        return "bitwise: 3 sequences alone = in the batch of 28"

    if name == "check":
        # (the default is unchanged since the tenth session; the s2 candidates are checked where they are timed)
        runs = [("default", 16, "head", None), ("h2", 16, "head", None)] if ROUND_B else \
            [("h4", 16, "head", None), ("h2", 16, "head", None), ("h4", 64, "tensor", None), ("h4", 16, "head", 3)]

        def checks(runs):
            for cand, page, form, splits in runs:
                case = f"d128 h32/8 b28 paged page{page} e4m3 per-{form} scales, lengths 1..1200" \
                    + (f", {splits} splits" if splits else "")

                def run():
                    err, far = check(cand, page, form, splits)
                    emit("check", case, cand, None, "", None, f"ok, err {err:.1e}; fails as {' and as '.join(far)}")
                guarded("check", case, cand, run)
        checks(runs)
        for cand in () if ROUND_B else ("h4",):
            case = "d128 h32/8 b28 paged page16 e4m3, batch_invariant=True"
            guarded("check", case, cand, lambda cand=cand: emit("check", case, cand, None, "", None,
                                                                invariant(cand, 16)))
        checks([] if ROUND_B else [("h8", 16, "head", None)])  # last: its ptxas is the slowest (255 registers)
        return

    x = torch.empty(1 << (20 if DRY else 30), dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    cp = [lambda: y.copy_(x)]
    peak = {"loop": 2 * x.numel() / loop(cp) / 1e6, "graph": 2 * x.numel() / graphed(cp) / 1e6,
            "bench": 2 * x.numel() / bench(cp[0]) / 1e6}
    g_copy = peak["graph"]  # a captured copy_ is a memcpy node, not the kernel (round A: 2434 against 3009 GB/s)
    peak["graph"] = peak["loop"]
    del x, y
    emit(name, "device copy (read + write)", "torch copy_", peak["loop"], "GB/s", None,
         f"back to back; graph (a memcpy node) {g_copy:.1f}, do_bench {peak['bench']:.1f} GB/s; graph rows' % "
         f"are of the back-to-back copy")

    def timed(case, impl, read, fns, err):
        ms = {"loop": loop(fns), "graph": graphed(fns), "bench": bench(fns[0])}
        pct = {k: 100 * read / v / 1e6 / peak[k] for k, v in ms.items()}
        emit(name, case, impl, read / ms["loop"] / 1e6, "GB/s", ms["loop"],
             f"{pct['loop']:.1f}% of copy back to back; graph {ms['graph']:.4f} ms {pct['graph']:.1f}%; "
             f"do_bench {ms['bench']:.4f} ms {pct['bench']:.1f}%; err {err:.1e}")

    def inputs(b, sk, seed=0):
        gen = torch.Generator(device=dev).manual_seed(seed)
        q = torch.randn(b, HKV * G, 1, HD, device=dev, generator=gen).mul(3).bfloat16()
        kb = torch.randn(b, HKV, sk, HD, device=dev, generator=gen, dtype=torch.bfloat16)
        vb = torch.randn(b, HKV, sk, HD, device=dev, generator=gen, dtype=torch.bfloat16)
        sc = dict(k_scale=scales((HKV,), gen), v_scale=scales((HKV,), gen))
        return q, kb, vb, sc

    def paged_calls(q, k, v, kw, page, order, lens):
        pk = []
        for seed in (1, 2):  # two copies, each its own page order
            g = torch.Generator(device=dev).manual_seed(seed)
            kc, table = to_pages(k, page, order, g)
            vc, _ = to_pages(v, page, order, g.manual_seed(seed))
            pk.append(((q, kc, vc), dict(kw, block_table=table, seqlens_k=lens)))
        return pk

    def last_err(out, q, k, v, kw):
        """The last sequence's first and last KV heads' query rows against float64 (a head mix-up fails)."""
        worst = 0.0
        for h in (0, HKV - 1):
            ref, _ = reference.attention(q[-1:, h * G:(h + 1) * G].double(),
                                         reference.dequantize(k[-1:, h:h + 1], kw["k_scale"][h:h + 1]),
                                         reference.dequantize(v[-1:, h:h + 1], kw["v_scale"][h:h + 1]))
            worst = max(worst, compare(f"out kv head {h}", out[-1:, h * G:(h + 1) * G], ref, **TOLERANCE["bf16"]))
        return worst

    if name == "paged":
        rows = [("fp8_e4m3", "dense", "default")] + [("fp8_e4m3", "paged", c) for c in TIMED]
        for shape, (b, sk, page) in enumerate(SHAPES):
            b, sk = (2, 128) if DRY else (b, sk)
            case = f"d128 h32/8 b{b} kv{sk} page{page}"
            q, kb, vb, sc = inputs(b, sk)
            caches = {"fp8_e4m3": (kb.to(E4M3), vb.to(E4M3), sc)}
            del kb, vb
            lens = torch.full((b,), sk, dtype=torch.int32, device=dev)
            calls = {}
            for kv, layout, _ in rows:
                k, v, kw = caches[kv]
                if layout == "dense":
                    calls[kv, layout] = [((q, k, v), kw), ((q, k.clone(), v.clone()), kw)]
                elif (kv, layout) not in calls:
                    calls[kv, layout] = paged_calls(q, k, v, kw, page, layout[len("paged "):], lens)
            for kv, layout, cand in rows:
                impl = f"{'fp8 ' if kv != 'bf16' else 'bf16 '}{layout} {cand}"
                if time.time() - T0 > PHASES[name] - 4:
                    emit(name, case, impl, None, "", None, "skipped: time budget")
                    continue

                def run():
                    k, v, kw = caches[kv]
                    tx, tiles = CANDS[cand] if kv != "bf16" and layout.startswith("paged") else ([], {})
                    m = module(spec_kw(None if kv == "bf16" else kv, layout.split()[0], **tiles), tx)
                    (a, w), _ = calls[kv, layout]
                    out, _ = m.forward(*a, **w)
                    err = last_err(out, q, k, v, kw)
                    read = k.numel() * k.element_size() + v.numel() * v.element_size()
                    timed(case, impl, read, [lambda a=a, w=w: m.forward(*a, **w) for a, w in calls[kv, layout]], err)
                guarded(name, case, impl, run)
            del caches, calls
        return

    if name == "lab":  # lab/paged_heads3d.py (the heads as a 3-D dot's batch dim) beside the product's default
        sys.path.insert(0, ROOT)
        from lab import paged_heads3d
        b, sk, page = (2, 128, 16) if DRY else (128, 8192, 16)
        case = f"d128 h32/8 b{b} kv{sk} page{page}"
        q, kb, vb, sc = inputs(b, sk)
        k, v = kb.to(E4M3), vb.to(E4M3)
        del kb, vb
        lens = torch.full((b,), sk, dtype=torch.int32, device=dev)
        read = k.numel() + v.numel()
        pc = paged_calls(q, k, v, sc, page, "", lens)
        m = module(spec_kw("fp8_e4m3", "paged"), [])
        runs = [("fp8 paged default", lambda a, w: m.forward(*a, **w)[0])] + [
            (f"lab heads3d h{h} n{n} w{w_} s{s_}",
             lambda a, w, h=h, n=n, w_=w_, s_=s_: paged_heads3d.forward(
                 *a, w["block_table"], w["seqlens_k"], w["k_scale"], w["v_scale"], heads=h,
                 block_n=min(n, 16) if DRY else n, num_warps=w_, num_stages=s_))
            for h, n, w_, s_ in LAB_RUNS]
        for impl, call in runs:
            if time.time() - T0 > PHASES[name] - 3:
                emit(name, case, impl, None, "", None, "skipped: time budget")
                continue

            def run(call=call, impl=impl):
                (a, w), _ = pc
                out = call(a, w)
                timed(case, impl, read, [lambda a=a, w=w: call(a, w) for a, w in pc], last_err(out, q, k, v, sc))
            guarded(name, case, impl, run)
        return

    if name == "splits":  # b8 kv32k: 64 programs a split at one head a program; paged page 16
        b, sk, page = (2, 128, 16) if DRY else (8, 32768, 16)
        case = f"d128 h32/8 b{b} kv{sk} page{page}"
        q, kb, vb, sc = inputs(b, sk, seed=3)
        k, v = kb.to(E4M3), vb.to(E4M3)
        del kb, vb
        lens = torch.full((b,), sk, dtype=torch.int32, device=dev)
        read = k.numel() + v.numel()
        pc = paged_calls(q, k, v, sc, page, "", lens)
        for cand, hows in SPLIT_RUNS:
            m = module(spec_kw("fp8_e4m3", "paged", **CANDS[cand][1]), CANDS[cand][0])
            rule = m._geometry(b, HKV, 1, sk, None, 0, m._heads(HKV, 1, None, None))[3]
            for how in hows:
                impl = f"fp8 paged {cand}, splits {how}" + (f" ({rule})" if how == "rule" else "")
                if time.time() - T0 > PHASES[name] - 3:
                    emit(name, case, impl, None, "", None, "skipped: time budget")
                    continue

                def call(a, w, how=how, m=m):
                    return m.forward(*a, **w) if how == "rule" else m.forward_split(*a, **w, num_splits=how)

                def run():
                    (a, w), _ = pc
                    out, _ = call(a, w)
                    timed(case, impl, read, [lambda a=a, w=w: call(a, w) for a, w in pc], last_err(out, q, k, v, sc))
                guarded(name, case, impl, run)


def bench_phase():
    """The serving bench's own fp8 decode rows (fagen/bench: make_inputs, prepare_fagen, its float64 check and its
    do_bench timing, time_prepared), the product's defaults: GB/s as `fagen bench --suite serving` reports it, and the
    same calls back to back and in a CUDA graph, against the copy of the same process."""
    import torch

    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from gpu_rows import T0, row

    from fagen.bench.cases import BenchOptions, CaseContext
    from fagen.bench.check import check
    from fagen.bench.impls import prepare_fagen
    from fagen.bench.serving import serving_rows
    from fagen.bench.timing import time_prepared
    from fagen.bench.workloads import kv_bytes

    dev = torch.device("cpu" if DRY else "cuda")
    rows = {c.name: c for c in serving_rows(quick=DRY)}

    def emit(case, impl, value, ms, note):
        row("bench", case, impl, value, "GB/s", ms, note)
        print("ROW " + json.dumps(["bench", case, impl, "-" if value is None else f"{value:.1f} GB/s",
                                   "" if ms is None else f"{ms:.4f}", note]), flush=True)

    def loop(fn, n=200):
        if DRY:
            return 1.0
        for _ in range(3):
            fn(0)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(n):
            fn(i)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / n

    opts = BenchOptions(device=str(dev))
    if not DRY:
        x = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
        y = torch.empty_like(x)
        from triton.testing import do_bench
        copy = {"loop": 2 * x.numel() / loop(lambda i: y.copy_(x)) / 1e6,
                "bench": 2 * x.numel() / do_bench(lambda: y.copy_(x), warmup=25, rep=100, return_mode="median") / 1e6}
        del x, y
    else:
        copy = {"loop": 1.0, "bench": 1.0}
    emit("device copy (read + write)", "torch copy_", copy["bench"], None,
         f"do_bench {copy['bench']:.1f} GB/s; back to back {copy['loop']:.1f} GB/s")
    from fagen.runtime.loader import load

    for name, heads in BENCH_ROWS:
        impl = "fagen (product default)" if heads is None else f"fagen, PAGED_HEADS = {heads}"
        if time.time() - T0 > PHASES["bench"] - 6:
            emit(name, impl, None, None, "skipped: time budget")
            continue
        try:
            case = rows[name]
            cc = CaseContext(case, dev, opts.sets)
            module = load(case.spec(dev)[0])
            if hasattr(module, "PAGED_HEADS"):  # the product's module: set (or reset) the switch, drop kept steps
                module.PAGED_HEADS = DEFAULT_HEADS.setdefault(name, module.PAGED_HEADS) if heads is None else heads
                module._STEPS.clear()
            prep = prepare_fagen(case, cc)
            status, message, err = check("fagen", prep, cc)
            if status != "ok":
                raise AssertionError(f"check {status}: {message}")
            ms = time_prepared(prep, cc, opts)["ms"]
            with torch.no_grad():
                b2b = loop(lambda i: prep.fn(cc.sets[i % len(cc.sets)]))
            read = kv_bytes(case)
            emit(name, impl, read / ms / 1e6, ms,
                 f"do_bench {100 * read / ms / 1e6 / copy['bench']:.1f}% of copy; back to back {b2b:.4f} ms "
                 f"{100 * read / b2b / 1e6 / copy['loop']:.1f}%; {len(cc.sets)} sets; check ok, err {err:.1e}; "
                 f"{prep.spec}")
        except Exception as e:  # noqa: BLE001 - a failure is a row
            import traceback
            emit(name, impl, None, None, f"ERROR {type(e).__name__}: {str(e).splitlines()[0][:150]}")
            traceback.print_exc(file=sys.stdout)


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--phase":
        bench_phase() if sys.argv[2] == "bench" else phase(sys.argv[2])
        return
    t0 = time.time()
    env = child_env("/tmp/fagen-cache-gpu-pagedfp8-s11", ROOT)
    if "TRITON_INTERPRET" in os.environ:  # a dry run keeps its interpreter
        env["TRITON_INTERPRET"] = os.environ["TRITON_INTERPRET"]
    rows, logs = [], []
    for name, limit in PHASES.items():
        print(f"[{time.time() - t0:6.1f}s] #### phase {name} (timeout {limit}s)", flush=True)
        rc, lines = run_child(os.path.abspath(__file__), name, limit, env,
                              lambda line: line.startswith("ROW ") or print(line, end="", flush=True))
        rows += [json.loads(line[4:]) for line in lines if line.startswith("ROW ")]
        logs += lines
        print(f"[{time.time() - t0:6.1f}s] #### phase {name}: rc={rc}", flush=True)
        if rc != 0:
            rows.append([name, "(phase)", "-", "-", "", f"ERROR rc={rc}"])
    text = "\n".join(["| section | case | impl | value | ms | note |", "|---|---|---|---|---|---|"]
                     + ["| " + " | ".join(r) + " |" for r in rows])
    print("\n" + text, flush=True)
    out = os.environ.get("OUTX") or os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "gpu_pagedfp8_s11.md"), "w") as f:
            f.write(text + "\n\n" + "".join(logs))
    failed = [r for r in rows if "ERROR" in r[5]]
    print(f"done in {time.time() - t0:.0f} s; {len(failed)} failures", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
