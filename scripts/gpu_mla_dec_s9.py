"""MLA absorbed decode at the memory-bound shapes (issue 27: Hq 16, Sq 1, page 64, KV 4k-32k, batch 32-128; >= 90%
of copy bandwidth for the bf16 latent cache, >= 95% counted in the bytes read for the fp8 one), ninth session.

    PYTHONPATH=$PWD python3 scripts/gpu_mla_dec_s9.py        # under ~70 s on an H100; one table; $OUT/gpu_mla_dec_s9.md
    GPU_MLA_DEC_S9_DRY=1 PYTHONPATH=$PWD python3 scripts/gpu_mla_dec_s9.py   # CPU: interpreter, tiny shapes

Variants (VARIANTS): the product's Triton decode (m16n32w4s3, the split rule), Triton tiles and split counts, and
the Gluon decode with its 64-row tile padded from Hq 16's 16 rows ([Note] Padded row tiles in
fagen/templates/gluon/mla_decode.py.j2); bf16 and fp8 e4m3 latent caches (one scale a token, or one a tensor);
the lab's swap-AB kernels (lab/gluon_mla_decode_fp8.py, [Note] Lab fp8 swap-AB; lab/gluon_mla_decode_sab.py for
bf16).
Phases, each a child process with a timeout (scripts/_phases.py); the check phases run at once (they compile):
1. check-*: each variant against float64 (on the dequantized cache for fp8) at Hq 16 Sq 1, page 64, lengths
   1000/77/513 (not multiples of 64; NaN past them, in the keys and their per-token scales), pages shuffled, the
   split rule and one split and three.
2. time: a device copy (read + write, back to back), then each variant at b32/b128 x kv4096/kv32768: GB/s of the
   bytes read (the cache once, its per-token scales, q and out) as % of the copy, alternating between two copies of
   the inputs (no L2 flush: docs/serving.md "128-key tiles, V converted once, and what do_bench costs"): the value
   from 8 calls captured in a CUDA graph and replayed (no host time: a serving engine's decode step), the note
   eager back to back (host time included: round A's b32 kv4k rows were host time).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/, for _phases
from _phases import child_env, run_phase as run_child  # noqa: E402

DRY = os.environ.get("GPU_MLA_DEC_S9_DRY") == "1"
if DRY:
    os.environ.setdefault("TRITON_INTERPRET", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
D, DV, PAGE = (48, 32, 16) if DRY else (576, 512, 64)
# name -> (kv_dtype, scale form, backend, spec tiles, text replacements on the render)
# Round A (2026-11-27 06:21 UTC, results/mladec-A.txt) dropped: Triton tiles n64w8s3 (bf16) and n64w8s2 (e4m3), more
# splits (PROGRAMS_PER_SM 4), the lab's fp16 dots per tensor (no faster than per token's). Round B: CUDA-graph timing
# (b32 kv4k was host time in every column: ~50 us of GPU work a call) and the lab's page prefetch.
VARIANTS = {
    "bf16 triton": (None, None, "triton", {}, []),
    "bf16 gluon pad64": (None, None, "gluon", {}, []),
    "bf16 lab swap-AB": (None, None, "labsab", {}, []),  # lab/gluon_mla_decode_sab.py
    "e4m3/token triton": ("fp8_e4m3", "token", "triton", {}, []),
    "e4m3/tensor triton": ("fp8_e4m3", "tensor", "triton", {}, []),
    "e4m3/token lab swap-AB": ("fp8_e4m3", "token", "lab", {}, []),  # lab/gluon_mla_decode_fp8.py
    "e4m3/tensor lab swap-AB": ("fp8_e4m3", "tensor", "lab", {}, []),
    "e4m3/token lab swap-AB, 1 CTA/SM splits": ("fp8_e4m3", "token", "lab", {"per_sm": 1}, []),  # fewer partials
    "e4m3/token lab swap-AB fp16": ("fp8_e4m3", "token", "lab", {"f16": True}, []),  # [Note] Lab fp16 dots
}
CHECK_GROUPS = {"check-bf16a": ["bf16 triton"], "check-glu": ["bf16 gluon pad64"], "check-sab": ["bf16 lab swap-AB"],
                "check-fp8a": ["e4m3/token triton"], "check-fp8b": ["e4m3/tensor triton"],
                "check-lab": ["e4m3/token lab swap-AB", "e4m3/tensor lab swap-AB",
                              "e4m3/token lab swap-AB, 1 CTA/SM splits"],
                "check-lab16": ["e4m3/token lab swap-AB fp16"]}  # one child each, at once (the builds)
SHAPES = ((32, 4096), (128, 4096), (32, 32768), (128, 32768)) if not DRY else ((2, 96), (3, 64))
CHECK_LENS = [1000, 77, 513] if not DRY else [200, 7, 53]  # within 16 pages: the timed shapes' integer classes
LIMITS = dict(check=28, time=42) if not DRY else dict(check=900, time=900)
if DRY:  # the interpreter: tiny tiles; the gluon kernel has no interpreter (its sm_90 build is in the tests)
    VARIANTS = {k: (kv, f, be, {"block_n": 16}, tx) for k, (kv, f, be, _, tx) in VARIANTS.items()
                if be == "triton"}  # the gluon and lab kernels: sm_90 builds in the tests
    CHECK_GROUPS = {g: [v for v in vs if v in VARIANTS] for g, vs in CHECK_GROUPS.items()}
SCALE = 192 ** -0.5
T0 = time.time()


def emit(section, case, impl, value, ms, note):
    print("ROW " + json.dumps([section, case, impl, value, "" if ms is None else f"{ms:.4f}", note]), flush=True)


def phase(name):  # noqa: C901 - one phase in this process
    import torch

    import fagen
    from fagen.runtime.loader import load_source
    from fagen.verify import reference
    from fagen.verify.tolerances import LSE_TOLERANCE, TOLERANCE, compare

    dev = "cpu" if DRY else "cuda"
    mods = {}

    def module(variant, mask):
        kv, _, backend, tiles, text = VARIANTS[variant]
        key = (variant, mask)
        if key not in mods and backend in ("lab", "labsab"):
            sys.path.insert(0, ROOT)
            from lab import gluon_mla_decode_fp8, gluon_mla_decode_sab
            mods[key] = (gluon_mla_decode_fp8 if backend == "lab" else gluon_mla_decode_sab).Module(
                causal=mask == "causal", **tiles)
        if key not in mods:
            spec = fagen.KernelSpec(head_dim=D, head_dim_v=DV, shared_kv=True, kind="decode", gqa=16, dtype="bf16",
                                    mask=mask, layout="paged", backend=backend, **({"kv_dtype": kv} if kv else {}),
                                    **tiles)
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

    def inputs(variant, b, n_max, lens, seed, shuffle=True, tails=False):
        kv, form = VARIANTS[variant][:2]
        gen = torch.Generator(device=dev).manual_seed(seed)
        pages = b * -(-n_max // PAGE)
        q = torch.randn(b, 16, 1, D, device=dev, generator=gen).bfloat16()
        cache = torch.randn(pages, PAGE, 1, D, device=dev, generator=gen)
        cache = cache.to(torch.float8_e4m3fn) if kv else cache.bfloat16()
        perm = torch.randperm(pages, device=dev, generator=gen) if shuffle else torch.arange(pages, device=dev)
        table = perm.to(torch.int32).view(b, -1)
        kw = {}
        if form == "token":
            kw["k_scale"] = torch.exp2(torch.rand(cache.shape[:-1], device=dev, generator=gen) * 6 - 3)
        elif form == "tensor":
            kw["k_scale"] = 0.7
        if tails:  # keys past each length hold NaN (fp8: the byte 0x7f), their per-token scales too
            for i, n in enumerate(lens):
                for p in range(table.shape[1]):
                    if n - p * PAGE < PAGE:
                        pg, lo = int(table[i, p]), max(0, n - p * PAGE)
                        if kv:
                            cache.view(torch.uint8)[pg, lo:] = 0x7F
                        else:
                            cache[pg, lo:] = float("nan")
                        if form == "token":
                            kw["k_scale"][pg, lo:] = float("nan")
        return q, cache, table, torch.tensor(lens, dtype=torch.int32, device=dev), kw

    if name == "bench":  # the serving bench's absorbed rows (fagen/bench/serving.py) through the bench's fagen column
        from fagen.bench.cases import BenchOptions
        from fagen.bench.impls import run_case
        from fagen.bench.serving import serving_rows
        rows = sorted((c for c in serving_rows(quick=DRY) if c.shared_kv), key=lambda c: (c.heads_q, c.kv_dtype or ""))
        for c in rows:
            t = time.time()
            r = run_case(c, BenchOptions(device=dev, impls=("fagen", ), rep_ms=20, warmup_ms=5, sets=1),
                         log=lambda *_: None)[0]
            value = "-" if r["ms"] is None else (f"{r['gbs']:.0f} GB/s" if c.metric == "gbs" else f"{r['tflops']:.1f} TF/s")
            emit("bench", c.name, "fagen (bench)", value, r["ms"], f"{r['status']}, check {r['check']}; "
                 f"{r.get('note') or ''} {r.get('spec') or ''}; {time.time() - t:.1f} s (beside the check phases)")
        return
    if name.startswith("check"):
        for variant in CHECK_GROUPS[name]:
            for form in ("rule", "s1", "s3"):
                case = "h16 sq1 page%d lens %s %s" % (PAGE, "/".join(map(str, CHECK_LENS)), form)
                try:
                    t = time.time()
                    m = module(variant, "causal")
                    q, cache, table, lens, kw = inputs(variant, len(CHECK_LENS), 16 * PAGE,
                                                       CHECK_LENS, 3, tails=True)
                    call = dict(block_table=table, seqlens_k=lens, scale=SCALE, **kw)
                    if form == "rule":
                        out, lse = m.forward(q, cache, None, **call)
                    else:
                        out, lse = m.forward_split(q, cache, None, num_splits=int(form[1:]), **call)
                    keys_all = reference.dequantize(cache, kw.get("k_scale"))  # NaN past the lengths: unread
                    worst = 0.0
                    for i, n in enumerate(CHECK_LENS):
                        keys = keys_all[table[i].long()].reshape(-1, 1, D)[:n].transpose(0, 1)[None]
                        qi = q[i:i + 1].double()
                        want, wlse = reference.attention(qi, keys, None, head_dim_v=DV, mask="causal", scale=SCALE)
                        terms, _ = reference.attention(qi, keys, keys[..., :DV].abs(), mask="causal", scale=SCALE)
                        unit = terms.clamp(min=1.0)
                        worst = max(worst, compare(f"out {i}", out[i:i + 1].double() / unit, want / unit,
                                                   **TOLERANCE["bf16"]))
                        compare(f"lse {i}", lse[i:i + 1].double(), wlse, **LSE_TOLERANCE)
                    emit("check", case, variant, "ok", None, f"err {worst:.1e}; {time.time() - t:.1f} s")
                except Exception as e:  # noqa: BLE001 - a failure is a row
                    import traceback
                    traceback.print_exc(file=sys.stdout)
                    emit("check", case, variant, "FAIL", None, f"ERROR {type(e).__name__}: "
                         f"{(str(e).splitlines() or [''])[0][:150]}")
        if name == "check-glu" and not DRY:  # fagen.attention on a dense cache at Hq 16 Sq 1 ([Note] Latent padded
            try:  # tiles: the padded gluon tile where LATENT_PAD_SELECTED), against float64
                from fagen.runtime import hopper
                hopper.LATENT_PAD_SELECTED, hopper.LATENT_MIN_WORK = True, 1
                gen = torch.Generator(device=dev).manual_seed(11)
                qd = torch.randn(3, 16, 1, D, device=dev, generator=gen).bfloat16()
                kd = torch.randn(3, 1, 777, D, device=dev, generator=gen).bfloat16()
                with torch.no_grad():
                    out = fagen.attention(qd, kd, None, head_dim_v=DV, scale=SCALE)
                twin = hopper.latent_decode_spec(fagen.KernelSpec(head_dim=D, head_dim_v=DV, shared_kv=True,
                                                                  kind="decode", gqa=16, dtype="bf16", mask="none"),
                                                 qd.device, 16)
                served = "triton"
                if twin is not None and torch.equal(fagen.load(twin).forward(qd, kd, None, scale=SCALE)[0], out):
                    served = "gluon (padded tile)"
                worst = 0.0
                for i in range(3):
                    want, _ = reference.attention(qd[i:i + 1].double(), kd[i:i + 1].double(), None, head_dim_v=DV,
                                                  scale=SCALE)
                    worst = max(worst, compare(f"out {i}", out[i:i + 1].double(), want, **TOLERANCE["bf16"]))
                emit("check", "fagen.attention dense h16 sq1 sk777", "fagen.attention", "ok", None,
                     f"err {worst:.1e}; served by {served}")
            except Exception as e:  # noqa: BLE001
                import traceback
                traceback.print_exc(file=sys.stdout)
                emit("check", "fagen.attention dense h16 sq1 sk777", "fagen.attention", "FAIL", None,
                     f"ERROR {type(e).__name__}: {(str(e).splitlines() or [''])[0][:150]}")
        return

    from triton.testing import do_bench

    def bench(fn):
        if DRY:
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        return do_bench(fn, warmup=2, rep=10)

    def graph(fns, calls=8, total_ms=15.0):
        """ms a call of `calls` calls captured in one CUDA graph (alternating between fns) and replayed back to
        back: the GPU's time with no host time between calls (a serving engine's decode step); None if capture
        fails."""
        if DRY:
            return None
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for f in fns:
                f()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g):
                for i in range(calls):
                    fns[i % len(fns)]()
        except Exception as e:  # noqa: BLE001 - a path that cannot be captured: eager timings only
            print(f"graph capture failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)
            torch.cuda.synchronize()
            return None
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

    def loop(fns, total_ms=20.0):
        """ms a call, back to back with no L2 flush, alternating between fns on their own copies of the inputs."""
        if DRY:
            return bench(fns[0])
        for f in fns:
            f()
        torch.cuda.synchronize()
        t = time.perf_counter()
        fns[0]()
        torch.cuda.synchronize()
        n = max(8, min(300, int(total_ms / max((time.perf_counter() - t) * 1e3, 1e-3))))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(n):
            fns[i % len(fns)]()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / n

    x = torch.empty(1 << (20 if DRY else 30), dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    peak = (2 * x.numel() / bench(lambda: y.copy_(x)) / 1e6, 2 * x.numel() / loop([lambda: y.copy_(x)]) / 1e6)
    x = y = None  # free the copy buffers
    emit("time", "device copy (read + write)", "torch copy_", f"{peak[1]:.0f} GB/s", None,
         f"back to back; do_bench {peak[0]:.0f} GB/s")
    skip = set(json.loads(os.environ.get("GPU_MLA_DEC_S9_FAILED", "[]")))
    for b, n in SHAPES:
        case = f"h16 sq1 page{PAGE} b{b} kv{n}"
        ref_out = {}
        for variant in VARIANTS:
            if variant in skip:
                emit("time", case, variant, "-", None, "not timed: its check failed")
                continue
            try:
                kv, form = VARIANTS[variant][:2]
                q, cache, table, lens, kw = inputs(variant, b, n, [n] * b, 5)
                m = module(variant, "causal")  # Sq 1: the same keys as "none", and the kernels the checks built
                cache2 = cache.clone()
                c1 = lambda: m.forward(q, cache, None, block_table=table, seqlens_k=lens, scale=SCALE, **kw)  # noqa
                c2 = lambda: m.forward(q, cache2, None, block_table=table, seqlens_k=lens, scale=SCALE, **kw)  # noqa
                out = c1()[0]
                dkey = (kv, form)
                diff = "" if dkey not in ref_out else \
                    f"; max |diff| to {ref_out[dkey][0]} {(out.float() - ref_out[dkey][1]).abs().max().item():.1e}"
                ref_out.setdefault(dkey, (variant, out.float()))
                read = b * n * D * cache.element_size() + (b * n * 4 if form == "token" else 0) \
                    + q.numel() * 2 * (1 + DV / D)
                ms_loop, ms_graph = loop([c1, c2]), graph([c1, c2])
                ms = ms_graph if ms_graph is not None else ms_loop
                emit("time", case, variant, f"{100 * read / ms / 1e6 / peak[1]:.1f}%", ms,
                     ("CUDA graph" if ms_graph is not None else "eager (no graph)")
                     + f", {read / ms / 1e6:.0f} GB/s; eager back to back {ms_loop:.4f} ms "
                     f"{100 * read / ms_loop / 1e6 / peak[1]:.1f}%{diff}")
                q = cache = cache2 = table = lens = kw = c1 = c2 = None  # free the inputs before the next
            except Exception as e:  # noqa: BLE001
                import traceback
                traceback.print_exc(file=sys.stdout)
                emit("time", case, variant, "-", None, f"ERROR {type(e).__name__}: "
                     f"{(str(e).splitlines() or [''])[0][:150]}")
        del ref_out
        if not DRY:
            torch.cuda.empty_cache()


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--phase":
        phase(sys.argv[2])
        return
    env = child_env("/tmp/fagen-cache-gpu-mla-dec-s9", ROOT)
    if "TRITON_INTERPRET" in os.environ:
        env["TRITON_INTERPRET"] = os.environ["TRITON_INTERPRET"]
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

    threads = [threading.Thread(target=run, args=(g, LIMITS["check"])) for g in [*CHECK_GROUPS, "bench"]
               if g == "bench" or CHECK_GROUPS[g]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failed = sorted({r[2] for r in rows if r[0] == "check" and r[3] != "ok"}
                    | {v for g, vs in CHECK_GROUPS.items() if rcs.get(g) not in (0, None) for v in vs
                       if not any(r[0] == "check" and r[2] == v for r in rows)})
    env["GPU_MLA_DEC_S9_FAILED"] = json.dumps(failed)
    run("time", LIMITS["time"])
    for n, rc in rcs.items():
        if rc != 0:
            rows.append([n, "(phase)", "-", "-", "", f"{'stopped' if n == 'bench' else 'ERROR'} rc={rc}"])
    text = "\n".join(["| section | case | impl | value | ms | note |", "|---|---|---|---|---|---|"]
                     + ["| " + " | ".join(r) + " |" for r in rows])
    print("\n" + text, flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_mla_dec_s9.md"), "w") as f:
            f.write(text + "\n\n" + "".join(logs))
    bad = [r for r in rows if "ERROR" in r[5] or r[3] == "FAIL"]
    print(f"done in {time.time() - T0:.0f} s; {len(bad)} failures", flush=True)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
