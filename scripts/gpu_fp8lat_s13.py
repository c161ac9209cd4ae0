"""MLA absorbed decode over an fp8 latent cache, thirteenth session (issue 27: >= 95% of copy): the product's Gluon
fp8 latent decode ([Note] Gluon fp8 latent decode) with its L2 prefetch (variant fp8lat_l2_prefetch: 2 blocks ahead
since round A; round B times 0 and 3 beside it, [Note] L2 prefetch) against FlashMLA's fp8 decode in one process, the
host time of a call (with and without [Note] Checked signatures), fagen.attention's fp8 latent route on the GPU, and
the serving bench's fp8 latent rows. Reuses scripts/gpu_fp8lat_s12.py's inputs, float64 checks, CUDA-graph
timing and FlashMLA module.

    FLASHMLA_DIR=/tmp/fm PYTHONPATH=$PWD python3 scripts/gpu_fp8lat_s13.py  # < 70 s on an H100; $OUTX/gpu_fp8lat_s13.md

Phases (children with timeouts, scripts/_phases.py); the checks run side by side and warm the builds:
1. check-*: each module against float64 on the dequantized cache (float8_e4m3fn), NaN past the lengths 1000/77/513/0
   in bytes and per-token scales, pages shuffled; the split rule, one split and three, batch_invariant (bitwise alone
   and with a wider table); dense Sk 777; Hq 16 Sq 3; bad pages and lengths (no fault, sequence 0 keeps its bits).
   check-api: fagen.attention(q, fp8 cache, None, block_table=, seqlens_k=, k_scale=) against float64 (per token and
   per tensor), the module it routes to.
2. time: Hq 16 Sq 1 page 64, b128 kv4k / b32 kv32k / b128 kv32k / b32 kv4k: % of copy over the bytes read, 8 calls in
   a CUDA graph, PASSES passes in rotated order, the median; FlashMLA fp8 (q e4m3) the peer.
3. host: the host time of one eager call (the GPU kept busy by a sleep kernel: enqueue time only) for the gluon
   module, the Triton decode and fagen.attention, and a cProfile of the gluon module's forward (top lines).
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
from _removed import refuse_removed  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import scripts.gpu_fp8lat_s12 as s12  # noqa: E402

D, DV, PAGE, SCALE = s12.D, s12.DV, s12.PAGE, s12.SCALE
PASSES = 3
LIMITS = dict(check=24, host=10, time=22, bench=12)
T0 = time.time()
s12.T0 = T0
# backend "gluon-<key>": the gluon render with these variant keys
# Round A (2026-11-27 20:10 UTC, results/fp8lat-A.txt) timed the L2 prefetch at D 2 and 4 (then prefetching block 1
# in the prologue), partials in bf16 and one program an SM at b32 kv4k: D 2 won 2.2-9.5 points but at b32 kv4k (-1.0
# / -1.6), D 4 lost 20-37 points, the partials and one program an SM nothing or less (removed). Round B: the product
# (D 2, block 1 at step 0; fp8lat_l2_prefetch's default since round A) against D 0 (off) and D 3, and the block
# loads with .cg or evict_first ([Note] Cache load hints, variant fp8lat_ld).
LEVERS = {"nol2": {"fp8lat_l2_prefetch": 0}, "l2pf3": {"fp8lat_l2_prefetch": 3}, "cg": {"fp8lat_ld": 1},
          "ef": {"fp8lat_ld": 2}}  # [Note] Cache load hints: .cg, evict_first
VARIANTS = {
    "gluon token (product: L2 prefetch 2)": ("gluon", "token"),
    "gluon tensor (product: L2 prefetch 2)": ("gluon", "tensor"),
    "gluon token, no L2 prefetch": ("gluon-nol2", "token"),
    "gluon tensor, no L2 prefetch": ("gluon-nol2", "tensor"),
    "gluon token, L2 prefetch 3 ahead": ("gluon-l2pf3", "token"),
    "gluon tensor, L2 prefetch 3 ahead": ("gluon-l2pf3", "tensor"),
    "gluon token, .cg loads": ("gluon-cg", "token"),
    "gluon tensor, .cg loads": ("gluon-cg", "tensor"),
    "gluon token, evict_first loads": ("gluon-ef", "token"),
    "gluon tensor, evict_first loads": ("gluon-ef", "tensor"),
    "FlashMLA fp8 (q e4m3)": ("flashmla8", "tensor"),
}
SHAPES = ((128, 4096), (32, 32768), (128, 32768), (32, 4096))
ONLY_AT = {}  # rows timed at one shape only
emit = s12.emit


def _new_module(backend, hq, layout, mask):
    """s12's modules plus "gluon-<lever>" (LEVERS) and "api" (fagen.attention as a module)."""
    import fagen
    if backend == "api":
        return _Api()
    if backend.startswith("gluon-") and backend[len("gluon-"):] in LEVERS:
        from fagen import backends
        from fagen.codegen.render import render
        from fagen.runtime.loader import load_source
        var = LEVERS[backend[len("gluon-"):]]
        keep = backends.GLUON.variant
        spec = s12._spec("gluon", hq, layout, mask)
        try:
            backends.GLUON.variant = {**keep, **var}
            render.cache_clear()
            src = render(spec).source
            mod = load_source(src, f"{spec.name}_{backend[len('gluon-'):]}")
        finally:
            backends.GLUON.variant = keep
            render.cache_clear()
        assert ("_l2_prefetch(" in src) == bool(var.get("fp8lat_l2_prefetch", 2))
        assert ('cache_modifier=".cg"' in src) == (var.get("fp8lat_ld") == 1)
        return mod
    return _s12_new(backend, hq, layout, mask) if backend != "gluon" else fagen.load(s12._spec("gluon", hq, layout,
                                                                                               mask))


_s12_new = s12._new_module
s12._new_module = _new_module


class _Api:
    """fagen.attention with a module's forward signature (paged, causal): its out, and the lse of the product's gluon
    module on the same inputs (fagen.attention returns out only; the checks compare both)."""

    def forward(self, q, k, v, *, block_table, seqlens_k, scale, k_scale=None, batch_invariant=False):
        import fagen
        out = fagen.attention(q, k, None, block_table=block_table, seqlens_k=seqlens_k, scale=scale, mask="causal",
                              head_dim_v=DV, k_scale=k_scale, batch_invariant=batch_invariant)
        lse = s12._module("gluon", q.shape[1]).forward(q, k, None, block_table=block_table, seqlens_k=seqlens_k,
                                                       scale=scale, k_scale=k_scale)[1]
        return out, lse


def _checks(backend, cases):
    import torch
    for form, layout, hq, sq, how in cases:
        case = f"{layout} h{hq} sq{sq} {form} {how}"
        t = time.time()
        try:
            m = s12._module(backend, hq, layout, "none" if layout == "dense" else "causal")
            if layout == "dense":
                q, cache, table, lens, kw = s12._inputs(form, 3, 777, None, 3, hq, sq, layout="dense")
            else:
                q, cache, table, lens, kw = s12._inputs(form, len(s12.CHECK_LENS), 16 * PAGE, s12.CHECK_LENS, 3, hq,
                                                        sq, tails=True)
            err, out, lse = s12._check(m, q, cache, table, lens, kw, how, layout, sq)
            note = ""
            if how == "inv":
                same = True
                for i in range(q.shape[0]):
                    o1, l1 = m.forward(q[i:i + 1], cache, None, block_table=table[i:i + 1], seqlens_k=lens[i:i + 1],
                                       scale=SCALE, batch_invariant=True, **kw)
                    same &= torch.equal(o1, out[i:i + 1]) and torch.equal(l1, lse[i:i + 1])
                wide = torch.cat([table, torch.zeros_like(table)], 1)
                o2, l2 = m.forward(q, cache, None, block_table=wide, seqlens_k=lens, scale=SCALE, batch_invariant=True,
                                   **kw)
                same &= torch.equal(o2, out) and torch.equal(l2, lse)
                note = f"; bitwise alone and with a 2x wider table: {'yes' if same else 'NO'}"
                if not same:
                    raise AssertionError("batch_invariant: not the same bits")
            emit("check", case, backend, "ok", None, f"err {err:.1e}; cache {cache.dtype}{note}; "
                 f"{time.time() - t:.1f} s")
        except Exception as e:  # noqa: BLE001 - a failure is a row
            import traceback
            traceback.print_exc(file=sys.stdout)
            first = (str(e).splitlines() or [""])[0][:150]
            emit("check", case, backend, "FAIL", None, f"ERROR {type(e).__name__}: {first}")


def _api_route():
    """fagen.attention's fp8 latent route: which module serves it (the gluon fp8 decode on sm_90)."""
    import torch

    import fagen
    from fagen.runtime import resolve
    q, cache, table, lens, kw = s12._inputs("token", 32, 8192, [8192] * 31 + [77], 2)  # 2^22 pairs: LATENT_MIN_WORK
    try:
        seen = []
        keep = resolve._module

        def spy(spec):
            seen.append(spec.name)
            return keep(spec)
        resolve._module = spy
        import fagen.runtime.api as api
        keep_api, api._module = api._module, spy
        try:
            fagen.attention(q, cache, None, block_table=table, seqlens_k=lens, scale=SCALE, mask="causal",
                            head_dim_v=DV, **kw)
        finally:
            resolve._module, api._module = keep, keep_api
        torch.cuda.synchronize()
        emit("check", "api route", "fagen.attention", "ok", None, f"modules asked: {seen}")
    except Exception as e:  # noqa: BLE001
        emit("check", "api route", "fagen.attention", "FAIL", None, f"ERROR {type(e).__name__}: {str(e)[:150]}")


def check_phase(name):
    groups = {
        "check-tok": ("gluon", [("token", "paged", 16, 1, f) for f in ("rule", "s1", "s3", "inv")]),
        "check-other": ("gluon", [("tensor", "paged", 16, 1, "rule"), ("tensor", "paged", 16, 1, "s3"),
                                  ("head", "dense", 16, 1, "rule"), ("token", "dense", 16, 1, "s3"),
                                  ("token", "paged", 16, 3, "rule")]),
        "check-rows": ("gluon", [("tensor", "paged", 8, 2, "rule"), ("tensor", "paged", 128, 2, "rule")]),
        "check-l2pf3": ("gluon-l2pf3", [("token", "paged", 16, 1, "rule"), ("tensor", "paged", 16, 1, "s3")]),
        "check-nol2": ("gluon-nol2", [("token", "paged", 16, 1, "rule"), ("tensor", "paged", 16, 1, "rule")]),
        "check-cg": ("gluon-cg", [("token", "paged", 16, 1, "rule"), ("tensor", "paged", 16, 1, "s3")]),
        "check-ef": ("gluon-ef", [("token", "paged", 16, 1, "s3"), ("tensor", "paged", 16, 1, "rule")]),
        "check-api": ("api", [("token", "paged", 16, 1, "rule"), ("head", "paged", 16, 1, "rule"),
                              ("token", "paged", 16, 3, "rule")]),
    }
    if name == "check-route":
        _api_route()
        return
    if name == "check-safety":
        s12._safety()  # the product's module (the L2 prefetch on)
        return
    if name == "check-warm":
        s12.check_phase("check-warm")
        return
    backend, cases = groups[name]
    _checks(backend, cases)


def host_phase():
    """Host time of one eager call: the GPU kept busy (torch.cuda._sleep), N calls enqueued, the wall time / N."""
    import cProfile
    import io
    import pstats

    import torch
    rows = []
    for b, n in ((1, 1024), (32, 4096)):
        q, cache, table, lens, kw = s12._inputs("token", b, n, [n] * b, 5)
        for name in ("gluon", "gluon memo", "triton", "api"):
            try:
                memo = name == "gluon memo"  # [Note] Checked signatures (HOST_MEMO)
                if memo:
                    m = s12._module("gluon", 16)
                    want = m.forward(q, cache, None, block_table=table, seqlens_k=lens, scale=SCALE, **kw)
                    m.HOST_MEMO = True
                    m._MEMO.clear()
                    for _ in range(2):
                        got = m.forward(q, cache, None, block_table=table, seqlens_k=lens, scale=SCALE, **kw)
                    same = torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and len(m._MEMO) == 1
                    emit("check", f"host memo h16 b{b} kv{n}", "gluon memo", "ok" if same else "FAIL", None,
                         f"the same bits as the checked path: {same}; memo entries {len(m._MEMO)}")
                if name == "api":
                    import fagen
                    fn = (lambda q=q, c=cache, t=table, ln=lens, k=kw:  # noqa: E731
                          fagen.attention(q, c, None, block_table=t, seqlens_k=ln, scale=SCALE, mask="causal",
                                          head_dim_v=DV, **k))
                else:
                    m = s12._module(name.split()[0], 16)
                    fn = (lambda m=m, q=q, c=cache, t=table, ln=lens, k=kw:  # noqa: E731
                          m.forward(q, c, None, block_table=t, seqlens_k=ln, scale=SCALE, **k))
                for _ in range(3):
                    fn()
                torch.cuda.synchronize()
                ts = []
                for _ in range(5):
                    torch.cuda._sleep(200_000_000)  # ~100 ms of GPU time: the calls below only enqueue
                    t = time.perf_counter()
                    for _ in range(100):
                        fn()
                    ts.append((time.perf_counter() - t) * 1e4)
                    torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(50):
                    fn()
                end.record()
                torch.cuda.synchronize()
                eager = start.elapsed_time(end) / 50 * 1e3
                rows.append((name, b, n))
                if memo:
                    m.HOST_MEMO = False
                emit("host", f"h16 b{b} kv{n} token", name, f"{statistics.median(ts):.1f} us host", None,
                     f"median host us a call (5 x 100 enqueued) {'/'.join(f'{x:.1f}' for x in ts)}; eager back to back "
                     f"{eager:.1f} us a call")
            except Exception as e:  # noqa: BLE001
                emit("host", f"b{b} kv{n}", name, "FAIL", None, f"ERROR {type(e).__name__}: {str(e)[:150]}")
    try:  # where the gluon module's host time goes
        q, cache, table, lens, kw = s12._inputs("token", 1, 1024, [1024], 5)
        m = s12._module("gluon", 16)
        torch.cuda._sleep(400_000_000)
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(200):
            m.forward(q, cache, None, block_table=table, seqlens_k=lens, scale=SCALE, **kw)
        pr.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14)
        lines = [x for x in s.getvalue().splitlines() if x.strip()][-15:]
        print("PROFILE gluon forward, 200 calls, tottime:\n" + "\n".join(lines), flush=True)
    except Exception as e:  # noqa: BLE001
        emit("host", "profile", "gluon", "FAIL", None, f"ERROR {type(e).__name__}: {str(e)[:150]}")


def time_phase():  # noqa: C901
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
    mods = {}
    for b, n in SHAPES:
        case = f"h16 sq1 page{PAGE} b{b} kv{n}"
        for m in mods.values():  # FlashMLA keeps metadata per lengths tensor address: a recycled one misled it (s12 B)
            for cache_name in ("meta", "prep"):
                getattr(m, cache_name, {}).clear()
        made, fns, read = {}, {}, {}
        ref = {}
        try:
            for v, (backend, form) in VARIANTS.items():
                if ONLY_AT.get(v, (b, n)) != (b, n):
                    continue
                if form not in made:
                    q, cache, table, lens, kw = s12._inputs(form, b, n, [n] * b, 5)
                    made[form] = (q, cache, cache.clone(), table, lens, kw)
                q, cache, cache2, table, lens, kw = made[form]
                if backend not in mods:
                    mods[backend] = s12._module(backend, 16)
                m = mods[backend]
                c1 = (lambda m=m, q=q, c=cache, t=table, ln=lens, k=kw:  # noqa: E731
                      m.forward(q, c, None, block_table=t, seqlens_k=ln, scale=SCALE, **k))
                c2 = (lambda m=m, q=q, c=cache2, t=table, ln=lens, k=kw:  # noqa: E731
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
        for p in range(PASSES):
            for v in order[p % len(order):] + order[:p % len(order)]:
                try:
                    times[v].append(s12.graph_ms(fns[v][0]))
                except Exception as e:  # noqa: BLE001
                    emit("time", case, v, "-", None, f"ERROR {type(e).__name__}: {str(e)[:150]}")
                    fns[v] = ([], "")
        for v, ts in times.items():
            if not ts:
                continue
            ms = statistics.median(ts)
            emit("time", case, v, f"{100 * read[v] / ms / 1e6 / peak:.1f}%", ms,
                 f"graph, median of {len(ts)} ({'/'.join(f'{t:.4f}' for t in ts)} ms), {read[v] / ms / 1e6:.0f} GB/s"
                 f"{fns[v][1]}")
        del made, fns, ref
        torch.cuda.empty_cache()
        if time.time() - T0 > 20:
            emit("time", "(rest)", "-", "-", None, "stopped: the phase's time")
            break


CHECKS = ["check-tok", "check-other", "check-rows", "check-l2pf3", "check-nol2", "check-cg", "check-ef", "check-api",
          "check-route", "check-safety", "check-warm"]


def bench_phase():
    """The serving bench's fp8 latent rows (s12's bench_rows: fagen.bench run_case, the selection off and on)."""
    s12.LIMITS["time"] = LIMITS["bench"] / 0.45
    s12.bench_rows()


def main():
    # its checks and timing stay importable (gpu_fp8lat_s14, gpu_fp8lat_s15)
    refuse_removed("gpu_fp8lat_s13.py", {k for v in LEVERS.values() for k in v},
                   'docs/serving.md, "MLA fp8 latent decode (thirteenth session)"')
    if len(sys.argv) > 2 and sys.argv[1] == "--phase":
        name = sys.argv[2]
        {"time": time_phase, "host": host_phase, "bench": bench_phase}.get(name, lambda: check_phase(name))()
        return
    env = child_env("/tmp/fagen-cache-gpu-fp8lat-s13", ROOT)
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
    run("time", max(5, min(LIMITS["time"], 48 - (time.time() - T0))))
    run("host", max(3, min(LIMITS["host"], 57 - (time.time() - T0))))
    run("bench", max(3, min(LIMITS["bench"], 68 - (time.time() - T0))))
    for n, rc in rcs.items():
        if rc != 0:
            rows.append([n, "(phase)", "-", "-", "", f"ERROR rc={rc}"])
    text = "\n".join(["| section | case | impl | value | ms | note |", "|---|---|---|---|---|---|"]
                     + ["| " + " | ".join(r) + " |" for r in rows])
    print("\n" + text, flush=True)
    if os.environ.get("OUTX"):
        with open(os.path.join(os.environ["OUTX"], "gpu_fp8lat_s13.md"), "w") as f:
            f.write(text + "\n\n" + "".join(logs))
    bad = [r for r in rows if "ERROR" in r[5] or r[3] == "FAIL"]
    print(f"done in {time.time() - T0:.0f} s; {len(bad)} failures", flush=True)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
