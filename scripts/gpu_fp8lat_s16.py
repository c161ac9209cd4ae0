"""MLA absorbed decode over an fp8 latent cache, sixteenth session (issue 27; docs/serving.md, "MLA fp8 latent decode
(sixteenth session)"): the product against the dependent merge (variant fp8lat_pdl; one render, its module global
PDL switched per call, so that PDL 0 is the product's launch), the per-tensor gap's data test (the product's per-token
kernel with every scale 0.7, the per-tensor kernel with k_scale 0.7 and 4.0) and FlashMLA's fp8 decode, per token and
per tensor, in one process. Reuses scripts/gpu_fp8lat_s12.py's inputs, float64 checks, CUDA-graph timing and FlashMLA
module, scripts/gpu_fp8lat_s13.py's checks and scripts/gpu_fp8lat_s15.py's structure.

    FLASHMLA_DIR=/tmp/fm PYTHONPATH=$PWD python3 scripts/gpu_fp8lat_s16.py  # < 58 s on an H100; $OUTX/table.txt

Rows (backend names; forms: token, tensor, token-flat = per-token scales all 0.7, tensor-4 = k_scale 4.0):
  gluon           the product (fagen.load);
  nomerge         the product with its merge launch replaced by nothing (split launches: the merge's cost; wrong
                  output, not checked);
  last            the candidate render with LAST_MERGE 1, PDL 0 ([Note] Last split merges: the last split's program
                  of a tile merges it, no merge launch);
  pdl:P           the candidate render (variant fp8lat_pdl 2, fp8lat_last_merge 1; LAST_MERGE 0 here) with PDL
                  P ([Note] Dependent merge: 1 the merge by a programmatic dependent launch, 2 and the decode's
                  programs trigger it at their start; 0 the product's launch).
Phases (children with timeouts, scripts/_phases.py); the checks run side by side and warm the builds:
1. check-*: against float64 on the dequantized cache (NaN past the lengths 1000/77/513/0 in bytes and per-token
   scales, pages shuffled; the split rule, three splits, batch_invariant bitwise alone and with a wider table; dense
   per KV head), bad pages and lengths (no fault, sequence 0 keeps its bits); FlashMLA warmed.
2. time: Hq 16 Sq 1 page 64 at b32 kv4k, b128 kv4k, b32 kv32k, b128 kv32k: % of copy over the bytes read (per token
   580 B a key, per tensor 576), 8 calls in a CUDA graph, PASSES passes, the rows shuffled each pass; each
   candidate's per-pass ratio of the product's time (same form, same pass) to its own: median and range; max |diff|
   to the product (0: same bits).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/, for _phases
from _phases import child_env, run_phase as run_child  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import scripts.gpu_fp8lat_s12 as s12  # noqa: E402
import scripts.gpu_fp8lat_s13 as s13  # noqa: E402

D, DV, PAGE, SCALE = s12.D, s12.DV, s12.PAGE, s12.SCALE
emit = s12.emit
ROUND = os.environ.get("GPU_FP8LAT_S16_ROUND", "A")
PASSES = 5 if ROUND == "A" else 7
LIMITS = dict(check=22, time=33, bench=0 if ROUND == "A" else 12)
CAND = {"fp8lat_pdl": 2, "fp8lat_last_merge": 1}
T_START = time.time()

# (label, backend, form, shapes or None for all)
ROWS = [
    ("product", "gluon", "token", None),
    ("dependent merge 1", "pdl:1", "token", None),
    ("dependent merge 2", "pdl:2", "token", None),
    ("last split merges", "last", "token", None),
    ("product, scales all 0.7", "gluon", "token-flat", None),
    ("product, 4 splits (rule: 2)", "gluon%4", "token", ((128, 4096), )),
    ("decode only, no merge (the merge's cost; wrong output)", "nomerge", "token", None),
    ("product", "gluon", "tensor", None),
    ("dependent merge 1", "pdl:1", "tensor", None),
    ("dependent merge 2", "pdl:2", "tensor", None),
    ("last split merges", "last", "tensor", None),
    ("product, k_scale 4.0", "gluon", "tensor-4", None),
    ("decode only, no merge (the merge's cost; wrong output)", "nomerge", "tensor", None),
    ("FlashMLA fp8 (q e4m3)", "flashmla8", "tensor", None),
]
SHAPES = ((32, 4096), (128, 4096), (32, 32768), (128, 32768))
# round B (2026-11-28 06:20 UTC): round A's one winner, the last split merges per tensor (+0.6 to +2.1% at the three
# large shapes, -7.4% at b32 kv4k; per token -12 to -17%), again against the product with the decode alone (no
# merge) and FlashMLA; the dependent merge (nothing measurable, PDL 2 -5% at b32 kv4k) and the data rows (no
# difference) dropped
ROWS_B = [
    ("product", "gluon", "token", None),
    ("last split merges", "last", "token", None),
    ("decode only, no merge (the merge's cost; wrong output)", "nomerge", "token", None),
    ("product", "gluon", "tensor", None),
    ("last split merges", "last", "tensor", None),
    ("decode only, no merge (the merge's cost; wrong output)", "nomerge", "tensor", None),
    ("FlashMLA fp8 (q e4m3)", "flashmla8", "tensor", None),
]
if ROUND == "B":
    ROWS = ROWS_B


class _With:
    """A gluon fp8 module with module globals set around each call (SHORT_PER, MERGE_COLS) and, with `splits`, every
    forward a forward_split of that many splits."""

    def __init__(self, mod, splits=None, **globs):
        self.mod, self.splits, self.globs = mod, splits, globs

    def _call(self, fn, *args, **kw):
        keep = {k: getattr(self.mod, k) for k in self.globs}
        for k, v in self.globs.items():
            setattr(self.mod, k, v)
        try:
            return fn(*args, **kw)
        finally:
            for k, v in keep.items():
                setattr(self.mod, k, v)

    def forward(self, *args, **kw):
        if self.splits is not None and not kw.get("batch_invariant"):
            kw.pop("batch_invariant", None)
            return self._call(self.mod.forward_split, *args, num_splits=self.splits, **kw)
        return self._call(self.mod.forward, *args, **kw)

    def forward_split(self, *args, **kw):
        return self._call(self.mod.forward_split, *args, **kw)


def _new_module(backend, hq, layout, mask):
    import fagen
    base, _, splits = backend.partition("%")
    splits = int(splits) if splits else None
    if base == "gluon-pdlmod":
        from fagen import backends
        from fagen.codegen.render import render
        from fagen.runtime.loader import load_source
        keep = backends.GLUON.variant
        spec = s12._spec("gluon", hq, layout, mask)
        try:
            backends.GLUON.variant = {**keep, **CAND}
            render.cache_clear()
            src = render(spec).source
            mod = load_source(src, f"{spec.name}_pdlmod")
        finally:
            backends.GLUON.variant = keep
            render.cache_clear()
        assert mod.PDL == 2 and "gdc_wait()" in src and "_launch_dependents()" in src and mod.LAST_MERGE == 1
        return mod
    if base.startswith("pdl:"):
        return _With(s12._module("gluon-pdlmod", hq, layout, mask), splits, PDL=int(base[4:]), LAST_MERGE=0)
    if base == "last":  # [Note] Last split merges
        return _With(s12._module("gluon-pdlmod", hq, layout, mask), splits, PDL=0, LAST_MERGE=1)
    if base == "nomerge":  # the product's split launches without their merge: a bound on any merge lever
        return _With(s12._module("gluon", hq, layout, mask), splits, _fast_merge=_NoMerge())
    if base == "gluon" and splits is not None:
        return _With(s12._module("gluon", hq, layout, mask), splits)
    if base == "gluon":
        return fagen.load(s12._spec("gluon", hq, layout, mask))
    return _s12_new(backend, hq, layout, mask)


class _NoMerge:
    """A launcher that launches nothing (the 'nomerge' rows: the decode's split launches alone)."""

    def __getitem__(self, grid):
        return lambda *a, **kw: None


_s12_new = s13._s12_new  # s12's own
s12._new_module = _new_module

GROUPS = {
    "check-prod": ("gluon", [("token", "paged", 16, 1, "rule"), ("tensor", "paged", 16, 1, "s3")]),
    "check-pdl1-tok": ("pdl:1", [("token", "paged", 16, 1, f) for f in ("rule", "s3", "inv")]),
    "check-pdl1-ten": ("pdl:1", [("tensor", "paged", 16, 1, "s3"), ("head", "dense", 16, 1, "rule")]),
    "check-pdl2-tok": ("pdl:2", [("token", "paged", 16, 1, f) for f in ("rule", "s3", "inv")]),
    "check-pdl2-ten": ("pdl:2", [("tensor", "paged", 16, 1, "s3"), ("head", "dense", 16, 1, "rule")]),
    "check-pdl2-sq3": ("pdl:2", [("token", "paged", 16, 3, "rule")]),
    "check-last-tok": ("last", [("token", "paged", 16, 1, f) for f in ("rule", "s3", "inv")]),
    "check-last-ten": ("last", [("tensor", "paged", 16, 1, "s3"), ("head", "dense", 16, 1, "rule"),
                                ("token", "paged", 16, 3, "rule")]),
}


def _safety(backend):
    """Bad pages (-7, 10^9) and lengths (10^6, -5) in sequences 1 and 2: no fault, sequence 0 keeps its bits."""
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
                 f"no fault; sequence 0 same bits {torch.equal(out[0], good[0])}; {time.time() - t:.1f} s")
        except Exception as e:  # noqa: BLE001
            emit("check", f"bad pages/lengths {form}", backend, "FAIL", None,
                 f"ERROR {type(e).__name__}: {str(e)[:150]}")


WARM = {"warm-a": [("gluon", (2, 4, 8))], "warm-b": [("pdl:1", (2, 8))], "warm-c": [("pdl:2", (2, 8))], "warm-d": [("last", (2, 8))]}


def _warm(name):
    """The time phase's merges (NUM_SPLITS and COLS are constexprs), compiled here beside the checks."""
    import torch
    t = time.time()
    try:
        q, cache, table, lens, kw = s12._inputs("tensor", 2, 64 * PAGE, [64 * PAGE] * 2, 2)
        for backend, splits in WARM[name]:
            m = s12._module(backend, 16)
            for n in splits:
                m.forward_split(q, cache, None, num_splits=n, block_table=table, seqlens_k=lens, scale=SCALE, **kw)
        torch.cuda.synchronize()
        emit("check", "warm merges", name, "ok", None, f"{time.time() - t:.1f} s")
    except Exception as e:  # noqa: BLE001
        emit("check", "warm merges", name, "FAIL", None, f"ERROR {type(e).__name__}: {str(e)[:150]}")


def check_phase(name):
    if name in WARM:
        _warm(name)
        return
    if name.startswith("check-safety-"):
        _safety(name[len("check-safety-"):])
        return
    if name == "check-warm":
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


CHECKS = list(GROUPS) + ["check-safety-pdl:2", "check-safety-last", "check-warm"] + list(WARM)
if ROUND == "B":
    CHECKS = [c for c in CHECKS if "pdl" not in c and c not in ("warm-b", "warm-c")]


def _form_inputs(form, b, n):
    """s12's inputs of `form`, or token-flat (per-token scales, all 0.7) / tensor-4 (one float, 4.0)."""
    q, cache, table, lens, kw = s12._inputs(form.split("-")[0], b, n, [n] * b, 5)
    if form == "token-flat":
        kw["k_scale"].fill_(0.7)
    elif form == "tensor-4":
        kw = {"k_scale": 4.0}
    return q, cache, table, lens, kw


def time_phase(deadline):  # noqa: C901
    import torch
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        y.copy_(x)
    end.record()
    torch.cuda.synchronize()
    copy_ms = start.elapsed_time(end) / 20
    peak = 2 * x.numel() / copy_ms / 1e6
    x = y = None
    emit("time", "device copy (read + write)", "torch copy_", f"{peak:.0f} GB/s", copy_ms, "20 back to back")
    rng = random.Random(15)
    for b, n in SHAPES:
        if time.time() > deadline - 6:
            emit("time", "(rest)", "-", "-", None, "stopped: the phase's time")
            break
        case = f"h16 sq1 page{PAGE} b{b} kv{n}"
        m = s12._MODS.get(("flashmla8", 16, "paged", "causal"))
        if m is not None:  # FlashMLA keeps metadata per lengths tensor address
            for cache_name in ("meta", "prep"):
                getattr(m, cache_name, {}).clear()
        made, fns, read, ref = {}, {}, {}, {}
        rows = [r for r in ROWS if r[3] is None or (b, n) in r[3]]
        try:
            for label, backend, form, _ in rows:
                key = f"{form}, {label}"
                if form not in made:
                    q, cache, table, lens, kw = _form_inputs(form, b, n)
                    made[form] = (q, cache, cache.clone(), table, lens, kw)
                q, cache, cache2, table, lens, kw = made[form]
                mod = s12._module(backend, 16)
                c1 = (lambda m=mod, q=q, c=cache, t=table, ln=lens, k=kw:  # noqa: E731
                      m.forward(q, c, None, block_table=t, seqlens_k=ln, scale=SCALE, **k))
                c2 = (lambda m=mod, q=q, c=cache2, t=table, ln=lens, k=kw:  # noqa: E731
                      m.forward(q, c, None, block_table=t, seqlens_k=ln, scale=SCALE, **k))
                out = c1()[0].float()
                diff = ""
                if "-" in form:  # other data: no bits to compare
                    pass
                elif form in ref:
                    diff = f"; max |diff| to product {(out - ref[form]).abs().max().item():.1e}"
                else:
                    ref[form] = out
                fns[key] = ([c1, c2], diff, form, label)
                read[key] = b * n * D + (b * n * 4 if form.startswith("token") else 0) + q.numel() * 2 * (1 + DV / D)
        except Exception as e:  # noqa: BLE001
            import traceback
            traceback.print_exc(file=sys.stdout)
            emit("time", case, "(inputs)", "-", None, f"ERROR {type(e).__name__}: {str(e)[:150]}")
        times = {k: [] for k in fns}
        for p in range(PASSES):
            order = list(fns)
            rng.shuffle(order)
            for k in order:
                try:
                    times[k].append(s12.graph_ms(fns[k][0]))
                except Exception as e:  # noqa: BLE001
                    emit("time", case, k, "-", None, f"ERROR {type(e).__name__}: {str(e)[:150]}")
                    fns[k] = ([], "", fns[k][2], fns[k][3])
                    times[k].append(float("nan"))
            if time.time() > deadline - 4 and p >= 2:
                break
        for k, ts in times.items():
            ok = [t for t in ts if t == t]
            if not ok:
                continue
            ms = statistics.median(ok)
            form, label = fns[k][2], fns[k][3]
            prod = times.get(f"{form.split('-')[0]}, product", [])
            ratio = ""
            if label != "product" and len(prod) == len(ts):
                rs = [a / c for a, c in zip(prod, ts) if a == a and c == c]
                if rs:
                    ratio = (f"; product/this per pass median {statistics.median(rs):.3f} "
                             f"[{min(rs):.3f}, {max(rs):.3f}]")
            emit("time", case, k, f"{100 * read[k] / ms / 1e6 / peak:.1f}%", ms,
                 f"{read[k] / ms / 1e6:.0f} GB/s, median of {len(ok)} ({'/'.join(f'{t:.4f}' for t in ok)} ms)"
                 f"{ratio}{fns[k][1]}")
        del made, fns, ref
        torch.cuda.empty_cache()


BENCH_LEVERS = {"gluon fp8 (product)": {}, "dependent merge 2": {"fp8lat_pdl": 2}}


def bench_phase(deadline):
    """The serving bench's fp8 latent rows (fagen.bench's run_case, impl fagen, the gluon fp8 decode selected; dense,
    one scale a KV head, do_bench) with the product's render and with BENCH_LEVERS' variant keys, passes in rotated
    order until the deadline, the median GB/s and each pass's ratio to the product's."""
    from fagen import backends
    from fagen.bench.cases import BenchOptions
    from fagen.bench.impls import run_case
    from fagen.bench.serving import serving_rows
    from fagen.codegen.render import render
    cases = {c.name: c for c in serving_rows()}
    res, keep = {}, (backends.GLUON.variant, backends.GLUON.select_fp8_latent)
    names = list(BENCH_LEVERS)
    try:
        backends.GLUON.select_fp8_latent = True
        for p in range(PASSES):
            for name in s12.BENCH_ROWS:
                for lever in names[p % len(names):] + names[:p % len(names)]:
                    if time.time() > deadline - 2:
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
        gbs = [r.get("gbs") for r in recs]
        ok = [g for g in gbs if g]
        r0 = recs[0]
        prod = [r.get("gbs") for r in res.get((name, names[0]), [])]
        ratio = ""
        rs = [g / p for g, p in zip(gbs, prod) if g and p]
        if lever != names[0] and rs:
            ratio = f"; this/product per pass median {statistics.median(rs):.3f} [{min(rs):.3f}, {max(rs):.3f}]"
        emit("bench", name, lever, f"{statistics.median(ok):.0f} GB/s" if ok else r0["status"],
             statistics.median([r["ms"] for r in recs if r.get("ms")]) if ok else None,
             f"{len(ok)} passes {'/'.join(f'{g:.0f}' for g in ok)}{ratio}; check {r0.get('check')} err "
             f"{r0.get('max_err')}; spec {r0.get('spec')}")


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--phase":
        name = sys.argv[2]
        if name == "time":
            time_phase(float(sys.argv[3]))
        elif name == "bench":
            bench_phase(float(sys.argv[3]))
        else:
            check_phase(name)
        return
    env = child_env("/tmp/fagen-cache-gpu-fp8lat-s16", ROOT)
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

    def run(name, limit, extra=()):
        print(f"[{time.time() - T_START:6.1f}s] #### phase {name} (timeout {limit:.0f}s)", flush=True)
        rc, _ = run_child(os.path.abspath(__file__), name, limit, env, on_line, extra)
        rcs[name] = rc
        print(f"[{time.time() - T_START:6.1f}s] #### phase {name}: rc={rc}", flush=True)

    threads = [threading.Thread(target=run, args=(g, LIMITS["check"])) for g in CHECKS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    limit = max(5, min(LIMITS["time"], (55 - LIMITS["bench"]) - (time.time() - T_START)))
    run("time", limit, (str(time.time() + limit - 1), ))
    if LIMITS["bench"]:
        limit = max(4, min(LIMITS["bench"], 56 - (time.time() - T_START)))
        run("bench", limit, (str(time.time() + limit - 1), ))
    for n, rc in rcs.items():
        if rc != 0:
            rows.append([n, "(phase)", "-", "-", "", f"ERROR rc={rc}"])
    text = "\n".join(["| section | case | impl | value | ms | note |", "|---|---|---|---|---|---|"]
                     + ["| " + " | ".join(r) + " |" for r in rows])
    print("\n" + text, flush=True)
    if os.environ.get("OUTX"):
        with open(os.path.join(os.environ["OUTX"], "table.txt"), "w") as f:
            f.write(text + "\n")
        with open(os.path.join(os.environ["OUTX"], "gpu_fp8lat_s16.md"), "w") as f:
            f.write(text + "\n\n" + "".join(logs))
    bad = [r for r in rows if "ERROR" in r[5] or r[3] == "FAIL"]
    print(f"done in {time.time() - T_START:.0f} s; {len(bad)} failures", flush=True)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
