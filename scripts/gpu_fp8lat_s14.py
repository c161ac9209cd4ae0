"""MLA absorbed decode over an fp8 latent cache, fourteenth session (issue 27: >= 95% of copy; docs/serving.md, "MLA
fp8 latent decode (fourteenth session)"): the thirteenth session's two round-A winners alone and together against the
product, per token and per tensor, at the four shapes, FlashMLA's fp8 decode in the same process; and FlashMLA's fp8
kernels' resources (cuobjdump -res-usage over its extension, SASS into $OUTX). Reuses scripts/gpu_fp8lat_s13.py's
checks and CUDA-graph timing (and through it s12's inputs, float64 checks and FlashMLA module).

    FLASHMLA_DIR=/tmp/fm PYTHONPATH=$PWD python3 scripts/gpu_fp8lat_s14.py  # < 70 s on an H100; $OUTX/gpu_fp8lat_s14.md

Levers (backend "gluon-<key>"):
  l2pro: fp8lat_l2_prefetch 2 with fp8lat_l2_first 1 (block 1 asked for in the prologue: commit 6f56f93's form,
         [Note] L2 prefetch's block 1);
  ef:    fp8lat_ld 2 (evict_first on the block's byte loads; [Note] Cache load hints);
  both:  the two together;
  st7:   fp8lat_stage 7 (chunks 0..6 of block j + 1 by cp.async into shared memory at step j's start; [Note] Staged
         chunks); st7ef: st7 with evict_first on the copies and the loads; st7l2: st7 with the L2 prefetch 2 in
         its step-0 form (the prologue form spills per token with st7); st7l2t (round B): st7l2 with the L2 prefetch
         only in the per-tensor kernels ([Note] L2 prefetch per tensor only).
Phases (children with timeouts, scripts/_phases.py); the checks run side by side and warm the builds:
1. check-*: each module against float64 on the dequantized cache (NaN past the lengths 1000/77/513/0 in bytes and
   per-token scales, pages shuffled; the split rule, three splits, batch_invariant bitwise alone and with a wider
   table), bad pages and lengths for the prefetching levers (no fault, sequence 0 keeps its bits); fm-res: FlashMLA.
2. time: Hq 16 Sq 1 page 64 at b128 kv4k / b32 kv32k / b128 kv32k / b32 kv4k: % of copy over the bytes read, 8 calls
   in a CUDA graph, PASSES passes in rotated order, the median; each lever's max |diff| to the product (0: the levers
   move no arithmetic).
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/, for _phases
from _phases import child_env, run_phase as run_child  # noqa: E402
from _removed import refuse_removed  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import scripts.gpu_fp8lat_s12 as s12  # noqa: E402
import scripts.gpu_fp8lat_s13 as s13  # noqa: E402

SCALE, PAGE = s12.SCALE, s12.PAGE
emit = s12.emit
LIMITS = dict(check=24, time=30, bench=14)
# GPU_FP8LAT_S14_ROUND: A (2026-11-27 23:25 UTC, results/fp8lat-A.txt: the checks, the time phase and FlashMLA's
# resources) or B (the default: round A's checks and time phase again, then the serving bench's fp8 rows with the
# product, staged 7 and staged 7 with the step-0 L2 prefetch)
ROUND = os.environ.get("GPU_FP8LAT_S14_ROUND", "B")

LEVERS = {"l2pro": {"fp8lat_l2_prefetch": 2, "fp8lat_l2_first": 1}, "ef": {"fp8lat_ld": 2},
          "both": {"fp8lat_l2_prefetch": 2, "fp8lat_l2_first": 1, "fp8lat_ld": 2}, "st7": {"fp8lat_stage": 7},
          "st7ef": {"fp8lat_stage": 7, "fp8lat_ld": 2}, "st7l2": {"fp8lat_stage": 7, "fp8lat_l2_prefetch": 2},
          "st7l2t": {"fp8lat_stage": 7, "fp8lat_l2_prefetch": 2, "fp8lat_l2_tensor": 1}}
BENCH_LEVERS = {"gluon fp8 (product)": {}, "gluon fp8, staged 7": LEVERS["st7"],
                "gluon fp8, staged 7 + L2 prefetch 2 per tensor": LEVERS["st7l2t"]}
VARIANTS = {
    "gluon token (product)": ("gluon", "token"),
    "gluon tensor (product)": ("gluon", "tensor"),
    "gluon token, L2 prefetch 2 prologue": ("gluon-l2pro", "token"),
    "gluon tensor, L2 prefetch 2 prologue": ("gluon-l2pro", "tensor"),
    "gluon token, evict_first": ("gluon-ef", "token"),
    "gluon tensor, evict_first": ("gluon-ef", "tensor"),
    "gluon token, prologue D2 + evict_first": ("gluon-both", "token"),
    "gluon tensor, prologue D2 + evict_first": ("gluon-both", "tensor"),
    "gluon token, staged chunks 7": ("gluon-st7", "token"),
    "gluon tensor, staged chunks 7": ("gluon-st7", "tensor"),
    "gluon token, staged 7 + evict_first": ("gluon-st7ef", "token"),
    "gluon tensor, staged 7 + evict_first": ("gluon-st7ef", "tensor"),
    "gluon token, staged 7 + L2 prefetch 2 (step 0)": ("gluon-st7l2", "token"),
    "gluon tensor, staged 7 + L2 prefetch 2 (step 0)": ("gluon-st7l2", "tensor"),
    "gluon token, staged 7 + L2 prefetch 2 per tensor only": ("gluon-st7l2t", "token"),
    "gluon tensor, staged 7 + L2 prefetch 2 per tensor only": ("gluon-st7l2t", "tensor"),
    "FlashMLA fp8 (q e4m3)": ("flashmla8", "tensor"),
}
if os.environ.get("GPU_FP8LAT_S14_ROUND", "B") == "A":  # round A had no st7l2t
    VARIANTS = {k: v for k, v in VARIANTS.items() if v[0] != "gluon-st7l2t"}


def _new_module(backend, hq, layout, mask):
    """s12's modules plus "gluon-<lever>" (LEVERS: the gluon render with those variant keys)."""
    import fagen
    name = backend[len("gluon-"):]
    if backend.startswith("gluon-") and name in LEVERS:
        from fagen import backends
        from fagen.codegen.render import render
        from fagen.runtime.loader import load_source
        var = LEVERS[name]
        keep = backends.GLUON.variant
        spec = s12._spec("gluon", hq, layout, mask)
        try:
            backends.GLUON.variant = {**keep, **var}
            render.cache_clear()
            src = render(spec).source
            mod = load_source(src, f"{spec.name}_{name}")
        finally:
            backends.GLUON.variant = keep
            render.cache_clear()
        assert ("_l2_prefetch(" in src) == bool(var.get("fp8lat_l2_prefetch", 0))
        assert ("(j == 0) & (j + 1 < n_blocks))  # block 1" in src) == (var.get("fp8lat_l2_prefetch", 0) > 0
                                                                      and not var.get("fp8lat_l2_first", 0))
        assert ('eviction_policy="evict_first"' in src) == (var.get("fp8lat_ld") == 2)
        assert ("async_copy.commit_group()" in src) == bool(var.get("fp8lat_stage", 0))
        assert ("[Note] L2 prefetch per tensor only\n" in src) == bool(var.get("fp8lat_l2_tensor", 0))
        return mod
    if backend == "gluon":
        return fagen.load(s12._spec("gluon", hq, layout, mask))
    return _s12_new(backend, hq, layout, mask)


_s12_new = s13._s12_new  # s12's own (s13 wrapped it at import)
s12._new_module = _new_module


def _safety(backend):
    """Bad pages (-7, 10^9) and lengths (10^6, -5) in sequences 1 and 2: no fault, sequence 0 keeps its bits
    (s12._safety for any module)."""
    import torch
    m = s12._module(backend, 16)
    for form in ("token", "tensor"):
        t = time.time()
        try:
            q, cache, table, lens, kw = s12._inputs(form, 3, 8 * PAGE, [300, 300, 300], 4)
            good, _ = m.forward(q, cache, None, block_table=table, seqlens_k=lens, scale=SCALE, **kw)
            bt, ln = table.clone(), lens.clone()
            bt[1, 0], bt[1, 2], bt[2, 1] = -7, 10**9, 10**9
            ln[1], ln[2] = 10**6, -5
            out, lse = m.forward(q, cache, None, block_table=bt, seqlens_k=ln, scale=SCALE, **kw)
            m.forward_split(q, cache, None, num_splits=3, block_table=bt, seqlens_k=ln, scale=SCALE, **kw)
            torch.cuda.synchronize()
            ok = torch.equal(out[0], good[0]) and (out[2] == 0).all() and (lse[2] == float("-inf")).all()
            emit("check", f"bad pages/lengths {form}", backend, "ok" if ok else "FAIL", None,
                 f"no fault; sequence 0 same bits {torch.equal(out[0], good[0])}; length -5: out 0 "
                 f"{bool((out[2] == 0).all())}; {time.time() - t:.1f} s")
        except Exception as e:  # noqa: BLE001
            emit("check", f"bad pages/lengths {form}", backend, "FAIL", None,
                 f"ERROR {type(e).__name__}: {str(e)[:150]}")


GROUPS = {
    "check-prod": ("gluon", [("token", "paged", 16, 1, "rule"), ("tensor", "paged", 16, 1, "rule"),
                             ("head", "dense", 16, 1, "rule")]),
    "check-l2pro-tok": ("gluon-l2pro", [("token", "paged", 16, 1, f) for f in ("rule", "s3", "inv")]),
    "check-l2pro-ten": ("gluon-l2pro", [("tensor", "paged", 16, 1, "rule"), ("tensor", "paged", 16, 1, "s3")]),
    "check-ef": ("gluon-ef", [("token", "paged", 16, 1, "s3"), ("tensor", "paged", 16, 1, "rule")]),
    "check-both-tok": ("gluon-both", [("token", "paged", 16, 1, "rule"), ("token", "paged", 16, 1, "inv")]),
    "check-both-ten": ("gluon-both", [("tensor", "paged", 16, 1, "rule"), ("tensor", "paged", 16, 1, "s3")]),
    "check-st7-tok": ("gluon-st7", [("token", "paged", 16, 1, f) for f in ("rule", "s3", "inv")]),
    "check-st7-ten": ("gluon-st7", [("tensor", "paged", 16, 1, "rule")]),
    "check-st7-dense": ("gluon-st7", [("head", "dense", 16, 1, "rule")]),
    "check-st7-sq3": ("gluon-st7", [("token", "paged", 16, 3, "rule")]),
    "check-st7ef": ("gluon-st7ef", [("token", "paged", 16, 1, "rule"), ("tensor", "paged", 16, 1, "s3")]),
    "check-st7l2": ("gluon-st7l2", [("token", "paged", 16, 1, "s3"), ("tensor", "paged", 16, 1, "rule")]),
    "check-st7l2t": ("gluon-st7l2t", [("token", "paged", 16, 1, "rule"), ("head", "dense", 16, 1, "rule")]),
    "check-st7l2t-ten": ("gluon-st7l2t", [("tensor", "paged", 16, 1, "s3"), ("token", "paged", 16, 1, "inv")]),
}


def check_phase(name):
    if name.startswith("check-safety-"):
        _safety("gluon-" + name[len("check-safety-"):])
        return
    if name == "check-warm":  # FlashMLA, built for the time phase
        try:
            m = s12._module("flashmla8", 16)
            q, cache, table, lens, kw = s12._inputs("tensor", 2, 4096, [4096, 4096], 1)
            m.forward(q, cache, None, block_table=table, seqlens_k=lens, scale=SCALE, **kw)
            emit("check", "warm", "flashmla8", "ok", None, "")
        except Exception as e:  # noqa: BLE001
            emit("check", "warm", "flashmla8", "FAIL", None, f"ERROR {type(e).__name__}: {str(e)[:150]}")
        return
    backend, cases = GROUPS[name]
    s13._checks(backend, cases)


def fm_res():
    """FlashMLA's extension: cuobjdump -res-usage (registers, shared memory a kernel), the fp8 kernels' lines on
    stdout, everything and their SASS under $OUTX."""
    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    where = os.environ.get("FLASHMLA_DIR", "/tmp/fm")
    so = (glob.glob(os.path.join(where, "sgl_kernel", "*flashmla*.so")) or [None])[0]
    if so is None:
        emit("fm", "res-usage", "FlashMLA", "FAIL", None, f"no flashmla .so under {where}")
        return
    out = os.environ.get("OUTX") or "/tmp"
    res = subprocess.run([tool, "-res-usage", so], capture_output=True, text=True, timeout=40).stdout
    with open(os.path.join(out, "flashmla_res_usage.txt"), "w") as f:
        f.write(res)
    lines = res.splitlines()
    fns = []
    for i, line in enumerate(lines):
        want = ("flash_fwd_splitkv_mla_kernel", "float_e4m3") if ROUND != "A" else None  # B: the dense fp8 decode
        if line.strip().startswith("Function") and (all(k in line for k in want) if want else any(
                k in line.lower() for k in ("fp8", "e4m3", "float_e4m3"))):
            fns.append(line.split()[1].rstrip(":"))
            print(f"FMRES {line.strip()[:400]} || {lines[i + 1].strip() if i + 1 < len(lines) else ''}", flush=True)
    print(f"FMRES {len(fns)} fp8 kernels of {sum(1 for x in lines if x.strip().startswith('Function'))}", flush=True)
    for k, fn in enumerate(fns[:4]):
        sass = subprocess.run([tool, "-sass", "-fun", fn, so], capture_output=True, text=True, timeout=30).stdout
        ops, kept = {}, []
        for line in sass.splitlines():
            parts = line.split("*/")
            if len(parts) > 1 and "/*" in parts[0] and parts[1].split("/*")[0].strip():
                kept.append(parts[0].strip() + "*/ " + parts[1].split("/*")[0].strip())  # no encodings
                words = parts[1].split()
                words = words[1:] if words and words[0].startswith("@") else words  # a predicate
                op = words[0].split(".")[0] if words else ""
                if op and op[0].isalpha():
                    ops[op] = ops.get(op, 0) + 1
        with open(os.path.join(out, f"flashmla_fp8_{k}.sass"), "w") as f:
            f.write(fn + "\n" + "\n".join(kept) + "\n")
        top = sorted(ops.items(), key=lambda x: -x[1])[:60]
        print(f"FMSASS {k} {fn[:120]}: {sum(ops.values())} instr; " + " ".join(f"{a}:{b}" for a, b in top), flush=True)


CHECKS = list(GROUPS) + ["check-safety-l2pro", "check-safety-both", "check-safety-st7", "check-warm"] + (
    ["fm-res"] if ROUND == "A" else ["check-safety-st7l2t", "fm-res"])


def bench_phase():
    """The serving bench's fp8 latent rows (fagen.bench's run_case, impl fagen, the gluon fp8 decode selected) with
    the product's render and with BENCH_LEVERS' variant keys (the variant is part of the render state: fagen.load
    builds each once), PASSES passes in rotated order, the median GB/s."""
    import statistics

    from fagen import backends
    from fagen.bench.cases import BenchOptions
    from fagen.bench.impls import run_case
    from fagen.bench.serving import serving_rows
    from fagen.codegen.render import render
    cases = {c.name: c for c in serving_rows()}
    res, keep, t0 = {}, (backends.GLUON.variant, backends.GLUON.select_fp8_latent), time.time()
    names = list(BENCH_LEVERS)
    try:
        backends.GLUON.select_fp8_latent = True
        for p in range(PASSES):
            for name in s12.BENCH_ROWS:
                for lever in names[p % len(names):] + names[:p % len(names)]:
                    if time.time() - t0 > LIMITS["bench"] - 3:
                        break
                    backends.GLUON.variant = {**keep[0], **BENCH_LEVERS[lever]}
                    render.cache_clear()
                    opts = BenchOptions(impls=("fagen", ), warmup_ms=10, rep_ms=40, sets=2, check=p == 0)
                    rec = run_case(cases[name], opts, log=lambda s: None)[0]
                    res.setdefault((name, lever), []).append(rec)
    finally:
        backends.GLUON.variant, backends.GLUON.select_fp8_latent = keep
        render.cache_clear()
    for (name, lever), recs in res.items():
        gbs = [r["gbs"] for r in recs if r.get("gbs")]
        r0 = recs[0]
        emit("bench", name, lever, f"{statistics.median(gbs):.0f} GB/s" if gbs else r0["status"],
             statistics.median([r["ms"] for r in recs if r.get("ms")]) if gbs else None,
             f"{len(gbs)} passes {'/'.join(f'{g:.0f}' for g in gbs)}; check {r0.get('check')} err "
             f"{r0.get('max_err')}; spec {r0.get('spec')}; {r0.get('note', '')[:80]}")


def main():
    refuse_removed("gpu_fp8lat_s14.py", {k for v in LEVERS.values() for k in v},
                   'docs/serving.md, "MLA fp8 latent decode (fourteenth session)"')
    if len(sys.argv) > 2 and sys.argv[1] == "--phase":
        name = sys.argv[2]
        if name == "time":
            s13.VARIANTS, s13.PASSES, s13.ONLY_AT = VARIANTS, PASSES, {}
            s13.T0 = time.time() + LIMITS["time"] - 26  # its shapes stop 20 s past this
            s13.time_phase()
        elif name == "fm-res":
            fm_res()
        elif name == "bench":
            bench_phase()
        else:
            check_phase(name)
        return
    env = child_env("/tmp/fagen-cache-gpu-fp8lat-s14", ROOT)
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
        print(f"[{time.time() - T0:6.1f}s] #### phase {name} (timeout {limit:.0f}s)", flush=True)
        rc, _ = run_child(os.path.abspath(__file__), name, limit, env, on_line)
        rcs[name] = rc
        print(f"[{time.time() - T0:6.1f}s] #### phase {name}: rc={rc}", flush=True)

    threads = [threading.Thread(target=run, args=(g, LIMITS["check"])) for g in CHECKS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    run("time", max(5, min(LIMITS["time"], (64 if ROUND == "A" else 52) - (time.time() - T0))))
    if ROUND != "A":
        run("bench", max(3, min(LIMITS["bench"], 67 - (time.time() - T0))))
    for n, rc in rcs.items():
        if rc != 0:
            rows.append([n, "(phase)", "-", "-", "", f"ERROR rc={rc}"])
    text = "\n".join(["| section | case | impl | value | ms | note |", "|---|---|---|---|---|---|"]
                     + ["| " + " | ".join(r) + " |" for r in rows])
    print("\n" + text, flush=True)
    if os.environ.get("OUTX"):
        with open(os.path.join(os.environ["OUTX"], "gpu_fp8lat_s14.md"), "w") as f:
            f.write(text + "\n\n" + "".join(logs))
    bad = [r for r in rows if "ERROR" in r[5] or r[3] == "FAIL"]
    print(f"done in {time.time() - T0:.0f} s; {len(bad)} failures", flush=True)
    sys.exit(1 if bad else 0)


PASSES = 3
T0 = time.time()
if __name__ == "__main__":
    main()
