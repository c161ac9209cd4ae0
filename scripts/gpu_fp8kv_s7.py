"""fp8 KV-cache decode bandwidth (issue 27 part 2; docs/serving.md "An fp8 KV cache"), seventh and eighth sessions:
the product default against candidates (text replacements on the render, tiles), each checked against float64.

    PYTHONPATH=$PWD python3 scripts/gpu_fp8kv_s7.py      # at most ~90 s on an H100; one table; $OUT/gpu_fp8kv_s7.md
    GPU_FP8KV_S7_DRY=1 PYTHONPATH=$PWD python3 scripts/gpu_fp8kv_s7.py   # the CPU interpreter, tiny shapes

Eighth session. Round A (03:25 UTC): V converted once and 128-key blocks at d128 (m64n128w4s3 with V converted once
won at b128 and stayed within a point of the best elsewhere: now the dense default, [Note] fp8 decode tiles); MLA's
latent score as a batched dot over 4 or 8 column slices lost (15-28% of copy against 39-44%: dropped), a dense
latent cache ran 42 / 47% against paged 39 / 44%. Round B (65 s in all: the d128 phases only; `--phase mla` and
`--phase check` still run by hand): each row timed two ways, do_bench (which writes 256 MB to flush the L2 before
each call: the call then writes back the dirty lines, ~17 us, a fixed cost that round A showed at every variant,
bf16 too) and back to back on two copies of the inputs (no flush: a decode loop); the product default against the
seventh session's and the 128-key tile without V converted once, dense, and paged (page 16) with V converted once.
Phases, each in a child process with a timeout (a kernel that faults or hangs loses its phase, not the table):
1. d128: h32/8 at b32 kv8192, b128 kv8192, b32 kv32768: bf16, e4m3, e5m2 (per-head scales): GB/s of the bytes read
   and % of a device copy measured the same way in the same phase; every row checked (the last sequence) first.
   paged: the same at page 16, b32 and b128 kv8192, e4m3.
2. mla (by hand: --phase mla): h16 sq1 page 64 at b32 kv32768 and b128 kv4096: bf16, e4m3 per token (the scales'
   4 bytes a token counted).
3. check (by hand: --phase check): against the float64 reference on the dequantized cache (reference.dequantize), out
   within atol * max(1, T) + rtol * |o| (T: the reference on |V|, as gpu_fp8_pertoken.py), lengths not multiples of
   the key block: d128 h8/2 dense (Sk 1000; per-head and per-token scales; e4m3 and e5m2) and paged page 16
   (seqlens 1000/77/513; per-token and per-tensor scales), the product default and the paged candidate.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/, for _phases
from _phases import child_env, run_phase as run_child  # noqa: E402

DRY = os.environ.get("GPU_FP8KV_S7_DRY") == "1"
if DRY:
    os.environ.setdefault("TRITON_INTERPRET", "1")
# timings first (each row is checked before it is timed), then the checks while time is left
PHASES = {"d128": 30, "paged": 22} if not DRY else {p: 600 for p in ("d128", "paged")}  # round B: 65 s in all
# Candidates: name -> (text replacements on the render, spec tile fields). Eighth session, round B: the product
# default is now m64n128w4s3 with V converted once for a dense fp8 cache ([Note] fp8 decode tiles in
# fagen/backends/triton.py); "before" is the seventh session's (m64n64w4s3, V converted in the operand), "n64 v" and
# "n128" the two halves of the change. Paged (page 16): its default m64n128w4s2 (pure conversion) against n128s3 and
# n128s2 with V converted once. MLA: the default against maxnreg 168 with 3 programs an SM in the split rule.
V_ON = [("V_ONCE = tl.constexpr(False and", "V_ONCE = tl.constexpr(True and")]
V_OFF = [("V_ONCE = tl.constexpr(True and", "V_ONCE = tl.constexpr(False and")]
T = lambda n, w, s, m=64: dict(block_m=m, block_n=n, num_warps=w, num_stages=s)  # noqa: E731
D128_CANDS = {"default": ([], {}), "before": (V_OFF, T(64, 4, 3)), "n128": (V_OFF, T(128, 4, 3))}
D128_CANDS["default, batch_invariant"] = D128_CANDS["default"]  # the same kernel under the invariant split rule
D128_ROWS = [(None, "default")] + [("fp8_e4m3", c) for c in D128_CANDS] + [("fp8_e5m2", "default")]
D128_SHAPES = ((32, 8192), (128, 8192), (32, 32768))
PAGED_CANDS = {"default": ([], {}), "n128s3 v": (V_ON, T(128, 4, 3))}
PAGED_SHAPES = ((32, 8192), (128, 8192))
REGS = lambda n, p: [("num_warps=NUM_WARPS, num_stages=NUM_STAGES,",  # noqa: E731
                      f"num_warps=NUM_WARPS, num_stages=NUM_STAGES, maxnreg={n},"),
                     ("PROGRAMS_PER_SM = 2", f"PROGRAMS_PER_SM = {p}")]
# sm_90 ptxas at maxnreg 168: n32s2 312 bytes of spills, 70 KB; n16s3 328 bytes, 53 KB (3 programs an SM fit)
MLA_CANDS = {"default": ([], {}), "n32s2 r168 p3": (REGS(168, 3), T(32, 4, 2, 16)),
             "n16s3 r168 p3": (REGS(168, 3), T(16, 4, 3, 16))}
MLA_ROWS = [(None, "default")] + [("fp8_e4m3", c) for c in MLA_CANDS]
MLA_SHAPES = ((32, 32768), (128, 4096))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def phase(name):  # noqa: C901 - one phase in this process
    import torch
    import triton  # noqa: F401

    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from gpu_rows import T0, log, row  # noqa: F401
    from gpu_rows import bench as _bench

    import fagen
    from fagen.runtime.loader import load_source
    from fagen.verify import reference
    from fagen.verify.tolerances import LSE_TOLERANCE, TOLERANCE, compare

    dev = "cpu" if DRY else "cuda"
    fp8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
    D, DV, PAGE = (48, 32, 16) if DRY else (576, 512, 64)

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
        return _bench(fn, DRY, warmup=10, rep=40)

    def loop(fns, total_ms=25.0):
        """ms a call, calls back to back with no L2 flush, alternating between the fns (each on its own copy of
        the inputs, which are larger than the L2): what a decode loop sees. do_bench's flush writes 256 MB before
        each call, and its dirty L2 lines are written back during the timed call (~17 us at 3 TB/s)."""
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

    def timed(section, case, impl, read, fns, err):
        """One row: GB/s of the bytes read, back to back (the value) and under do_bench (the note)."""
        ms_loop, ms = loop(fns), bench(fns[0])
        emit(section, case, impl, read / ms_loop / 1e6, "GB/s", ms_loop,
             f"{100 * read / ms_loop / 1e6 / peak[1]:.0f}% of copy back to back; do_bench {ms:.4f} ms, "
             f"{100 * read / ms / 1e6 / peak[0]:.0f}%; err {err:.1e}")

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

    def scales(shape, gen):
        return torch.exp2(torch.rand(shape, device=dev, generator=gen) * 6 - 3)  # log-uniform 1/8 .. 8

    def d128_spec(kv, layout="dense", gqa=4, **tiles):
        return dict(head_dim=128 if not DRY else 32, gqa=gqa, dtype="bf16", kind="decode", kv_dtype=kv, layout=layout,
                    **({"block_n": 16} if DRY else tiles))

    def mla_spec(kv, mask="causal", **tiles):
        return dict(head_dim=D, head_dim_v=DV, shared_kv=True, kind="decode", gqa=16, dtype="bf16", mask=mask,
                    layout="paged", kv_dtype=kv, **({"block_n": 16} if DRY else tiles))

    def paged(k, page):
        """[B, H, S, D] -> shuffled pages [B*S/page, page, H, D] and the table."""
        b, h, s, d = k.shape
        n = s // page
        perm = torch.randperm(b * n, device=dev).to(torch.int32)
        cache = k.view(b, h, n, page, d).permute(0, 2, 3, 1, 4).reshape(b * n, page, h, d)[perm.argsort().long()]
        return cache, perm.view(b, n)

    def check_d128(kv, cand, layout, form):  # cand: (text, tiles)
        hd = 128 if not DRY else 32
        b, hkv, g, sk, page = 3, 2, 4, (1000 if not DRY else 100), 16
        gen = torch.Generator(device=dev).manual_seed(1)
        q = torch.randn(b, hkv * g, 1, hd, device=dev, generator=gen).mul(2).bfloat16()
        k = torch.randn(b, hkv, sk if layout == "dense" else 1024 if not DRY else 112, hd, device=dev, generator=gen)
        v = torch.randn_like(k)
        kq, vq = k.to(fp8[kv]), v.to(fp8[kv])
        m = module(d128_spec(kv, layout, **cand[1]), cand[0])
        if layout == "dense":
            ks = scales((hkv,), gen) if form == "head" else scales(kq.shape[:-1], gen)
            vs = scales((hkv,), gen) if form == "head" else scales(vq.shape[:-1], gen)
            out, lse = m.forward(q, kq, vq, k_scale=ks, v_scale=vs)
            kd, vd = reference.dequantize(kq, ks), reference.dequantize(vq, vs)
        else:
            lens = torch.tensor([1000, 77, 513] if not DRY else [100, 7, 53], dtype=torch.int32, device=dev)
            kc, table = paged(kq, page)
            vc = vq.view(b, hkv, -1, page, hd).permute(0, 2, 3, 1, 4).reshape(-1, page, hkv, hd)[
                table.flatten().argsort().long()]
            if form == "tensor":
                ks, vs = 0.7, 1.6
            else:
                ks = scales(kc.shape[:-1], gen)
                vs = scales(vc.shape[:-1], gen)
            out, lse = m.forward(q, kc, vc, block_table=table, seqlens_k=lens, k_scale=ks, v_scale=vs)
            kd = reference.dequantize(kc, ks)[table.long()].permute(0, 3, 1, 2, 4).reshape(b, hkv, -1, hd)
            vd = reference.dequantize(vc, vs)[table.long()].permute(0, 3, 1, 2, 4).reshape(b, hkv, -1, hd)
            kd, vd = ([t[i:i + 1, :, :int(lens[i])] for i in range(b)] for t in (kd, vd))
        if layout == "dense":
            kd, vd = ([t[i:i + 1] for i in range(b)] for t in (kd, vd))
        err = 0.0
        for i in range(b):  # each sequence on its own keys
            want, wlse = reference.attention(q[i:i + 1].double(), kd[i], vd[i])
            terms, _ = reference.attention(q[i:i + 1].double(), kd[i], vd[i].abs())  # weighted |v|: compare_terms
            unit = terms.clamp(min=1.0)
            err = max(err, compare(f"out {i}", out[i:i + 1].double() / unit, want / unit, **TOLERANCE["bf16"]))
            compare(f"lse {i}", lse[i:i + 1], wlse, **LSE_TOLERANCE)
        return err

    def mla_inputs(kv, b, sq, n_max, lens, gen, per_token):
        q = torch.randn(b, 16, sq, D, device=dev, generator=gen).bfloat16()
        pages = -(-n_max // PAGE)
        cache = torch.randn(b * pages, PAGE, 1, D, device=dev, generator=gen).to(fp8[kv] if kv else torch.bfloat16)
        table = torch.randperm(b * pages, device=dev, generator=gen).to(torch.int32).view(b, pages)
        ks = (scales(cache.shape[:-1], gen) if per_token else 0.8) if kv else None
        return q, cache, table, torch.tensor(lens, dtype=torch.int32, device=dev), ks

    def mla_check_rows(m, q, cache, table, lens, ks, which):
        kw = {} if ks is None else dict(k_scale=ks)
        out, lse = m.forward(q, cache, None, block_table=table, seqlens_k=lens, **kw)
        worst = 0.0
        for i in which:
            n = int(lens[i])
            keys = reference.dequantize(cache, ks)[table[i].long()].reshape(-1, 1, D)[:n].transpose(0, 1)[None]
            want, wlse = reference.attention(q[i:i + 1].double(), keys, None, head_dim_v=DV, mask="causal")
            terms, _ = reference.attention(q[i:i + 1].double(), keys, keys[..., :DV].abs(), mask="causal")
            unit = terms.clamp(min=1.0)
            worst = max(worst, compare(f"out {i}", out[i:i + 1].double() / unit, want / unit, **TOLERANCE["bf16"]))
            compare(f"lse {i}", lse[i:i + 1], wlse, **LSE_TOLERANCE)
        return worst

    def copy_bw():
        """(do_bench, back to back) GB/s of a 1 GB device copy, read + write."""
        x = torch.empty(1 << (20 if DRY else 30), dtype=torch.uint8, device=dev)
        y = torch.empty_like(x)
        return 2 * x.numel() / bench(lambda: y.copy_(x)) / 1e6, 2 * x.numel() / loop([lambda: y.copy_(x)]) / 1e6

    if name == "check":  # the product default and the paged candidate at odd shapes (lengths not multiples of a block)
        for layout, kv, form, cand in (("dense", "fp8_e4m3", "head", "default"),
                                       ("dense", "fp8_e4m3", "token", "default"),
                                       ("dense", "fp8_e5m2", "head", "default"),
                                       ("paged", "fp8_e4m3", "token", "default"),
                                       ("paged", "fp8_e4m3", "token", "n128s3 v"),
                                       ("paged", "fp8_e5m2", "tensor", "n128s3 v")):
            case = f"d128 h8/2 {layout} {kv} {form} scales"

            def run():
                err = check_d128(kv, (D128_CANDS if layout == "dense" else PAGED_CANDS)[cand], layout, form)
                emit("check", case, cand, None, "", None, f"ok, err {err:.1e}")
            guarded("check", case, cand, run)
        return

    peak = copy_bw()
    emit(name, "device copy (read + write)", "torch copy_", peak[1], "GB/s", None,
         f"back to back; do_bench {peak[0]:.1f} GB/s")
    if name in ("d128", "paged"):
        hd = 128 if not DRY else 32
        cands, rows = (D128_CANDS, D128_ROWS) if name == "d128" else \
            (PAGED_CANDS, [("fp8_e4m3", c) for c in PAGED_CANDS])
        for b, sk in D128_SHAPES if name == "d128" else PAGED_SHAPES:
            b, sk = (min(b, 2), max(64, sk // 128)) if DRY else (b, sk)
            case = f"d128 h32/8 b{b} kv{sk}" + (" page16" if name == "paged" else "")
            gen = torch.Generator(device=dev).manual_seed(0)
            q = torch.randn(b, 32, 1, hd, device=dev, generator=gen).mul(3).bfloat16()
            kb = torch.randn(b, 8, sk, hd, device=dev, generator=gen, dtype=torch.bfloat16)
            vb = torch.randn(b, 8, sk, hd, device=dev, generator=gen, dtype=torch.bfloat16)
            caches = {None: (kb, vb, {})}
            for kv in fp8 if name == "d128" else ("fp8_e4m3",):
                caches[kv] = (kb.to(fp8[kv]), vb.to(fp8[kv]),
                              dict(k_scale=0.5 + torch.rand(8, device=dev, generator=gen),
                                   v_scale=0.5 + torch.rand(8, device=dev, generator=gen)))
            calls = {}  # kv -> (args, keywords) of the two copies of the inputs (back to back: alternating)
            for kv, (k, v, kw) in caches.items():
                if name == "paged":
                    kc, table = paged(k, 16)
                    vc = v.view(b, 8, -1, 16, hd).permute(0, 2, 3, 1, 4).reshape(-1, 16, 8, hd)[
                        table.flatten().argsort().long()]
                    pk = dict(kw, block_table=table, seqlens_k=torch.full((b,), sk, dtype=torch.int32, device=dev))
                    calls[kv] = [((q, kc, vc), pk), ((q, kc.clone(), vc.clone()), pk)]
                else:
                    calls[kv] = [((q, k, v), kw), ((q, k.clone(), v.clone()), kw)]
            for kv, cand in rows:
                impl = f"{kv or 'bf16'} {cand}"
                if time.time() - T0 > PHASES.get(name, 40) - 4:
                    emit(name, case, impl, None, "", None, "skipped: time budget")
                    continue

                def run():
                    k, v, kw = caches[kv]
                    spec = d128_spec(kv, "dense" if name == "d128" else "paged", **(cands[cand][1] if kv else {}))
                    m = module(spec, cands[cand][0] if kv else [])
                    inv = dict(batch_invariant=True) if "batch_invariant" in cand else {}
                    out, _ = m.forward(*calls[kv][0][0], **calls[kv][0][1], **inv)
                    ref, _ = reference.attention(q[-1:, :4].double(),
                                                 reference.dequantize(k[-1:, :1], kw["k_scale"][:1] if kv else None),
                                                 reference.dequantize(v[-1:, :1], kw["v_scale"][:1] if kv else None))
                    err = compare("out", out[-1:, :4], ref, **TOLERANCE["bf16"])
                    read = k.numel() * k.element_size() + v.numel() * v.element_size()
                    timed(name, case, impl, read, [lambda a=a, w=w: m.forward(*a, **w, **inv) for a, w in calls[kv]],
                          err)
                guarded(name, case, impl, run)
            del caches, calls, kb, vb
    if name == "mla":
        for b, n in MLA_SHAPES:
            b, n = (min(b, 2), max(64, n // 256)) if DRY else (b, n)
            case = f"MLA h16 sq1 page{PAGE} b{b} kv{n}"
            for kv, cand in MLA_ROWS:
                impl = f"{kv or 'bf16'}{' per token' if kv else ''} {cand}"
                if time.time() - T0 > PHASES.get("mla", 40) - 4:
                    emit("mla", case, impl, None, "", None, "skipped: time budget")
                    continue

                def run():
                    gen = torch.Generator(device=dev).manual_seed(5)
                    q, cache, table, lens, ks = mla_inputs(kv, b, 1, n, [n] * b, gen, True)
                    text, tiles = MLA_CANDS[cand] if kv else ([], {})
                    m = module(mla_spec(kv, mask="none", **tiles), text)
                    kw = {} if ks is None else dict(k_scale=ks)
                    cache2 = cache.clone()  # a second copy: back to back, the calls alternate
                    call = lambda: m.forward(q, cache, None, block_table=table, seqlens_k=lens, **kw)  # noqa: E731
                    call2 = lambda: m.forward(q, cache2, None, block_table=table, seqlens_k=lens, **kw)  # noqa: E731
                    out, _ = call()
                    keys = reference.dequantize(cache, ks)[table[-1].long()].reshape(-1, 1, D)[:n].transpose(0, 1)[None]
                    want, _ = reference.attention(q[-1:].double(), keys, None, head_dim_v=DV)
                    terms, _ = reference.attention(q[-1:].double(), keys, keys[..., :DV].abs())
                    unit = terms.clamp(min=1.0)
                    err = compare("out", out[-1:].double() / unit, want / unit, **TOLERANCE["bf16"])
                    read = b * n * D * cache.element_size() + (b * n * 4 if kv else 0) + q.numel() * 2 * (1 + DV / D)
                    timed("mla", case, impl, read, [call, call2], err)
                guarded("mla", case, impl, run)


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--phase":
        phase(sys.argv[2])
        return
    t0 = time.time()
    env = child_env("/tmp/fagen-cache-gpu-fp8kv-s7", ROOT)
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
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_fp8kv_s7.md"), "w") as f:
            f.write(text + "\n\n" + "".join(logs))
    failed = [r for r in rows if "ERROR" in r[5]]
    print(f"done in {time.time() - t0:.0f} s; {len(failed)} failures", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
