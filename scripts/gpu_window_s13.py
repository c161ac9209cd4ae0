"""Issue 26, thirteenth session (helper window): the sliding-window row's deterministic backward (causal + window
(1024, 0), B1 H16 S8192 d128 bf16); docs/mods.md "The window's backward (thirteenth session)".

    PYTHONPATH=$PWD python3 scripts/gpu_window_s13.py

Round A (window-A.txt; commit 7f72f18) timed the fixed passes' levers (the accumulator's fill in reverse order, the
conversion in reverse order, the fill on a side stream, the workspace kept) and the descending steps: none moved a
kernel; removed. This is round B's script. Variants (module globals of the window render, set before every call):
  api    the product (fagen.attention with the window's mask_mod, the fast path, the bound kernel)
  keep   _BWD_WS_KEEP 2^28: the 68 MB workspace kept per stream instead of allocated per call (lever 3)
  loop   the product with the bound by the twelfth session's loop kernel (removed from the product untimed; here
         defined in this script and launched in place of _fast_kv_bound: 32 programs a KV head, 32-row tiles)
  grid   the product with one program per tile (BWD_GRID_ALL 1, a host constant: 1024 programs, not 132 persistent)
  nondet the product with deterministic=False (the unordered adds: the reference)
Phases (scripts/_phases.py): warm-flex and warm-window at once (the latter then checks at B1 H2 S333, windows
(37, 0) and (130, 0): each variant against float64, repeatable, row 0's dq exactly 0, compared with the product;
the loop's KVB against the product kernel's, NaN in K and V), then `time`: five passes in rotated orders, medians
(do_bench, L2 flushed), host ms a call, the kernels' ms (torch.profiler); the bound alone (the product kernel against
six loop configurations); the main kernel's ms at windows 256 .. 4096 (the same kernels: win_left is a run-time
value), for the per-tile overhead (a + b x steps).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import gpu_mods_bwd_s9 as s9  # noqa: E402
import gpu_window_s12 as s12  # noqa: E402  (module, small, grads, ref64, errs, same, diff, check, kernel_ms)
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

BUDGET = 66.0
SW = "sliding-window+causal"
KEEP = {"_BWD_WS_KEEP": 1 << 28}
VARIANTS = {"api": {}, "keep": KEEP, "loop": {}, "grid": {"BWD_GRID_ALL": 1}}
DEFAULTS: dict = {}
LOOP = (32, 32, 4)  # the bound loop's (programs a KV head, rows a tile, warps): the twelfth session's default
LOOP_CONFIGS = [(32, 32, 4), (16, 64, 4), (8, 64, 8), (64, 32, 4), (8, 32, 4), (16, 32, 4)]
WINDOWS = [256, 512, 1024, 2048, 4096]


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _bwd_kv_bound_loop(K, V, KVB, seq_k, chunk, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    """The twelfth session's bound kernel's loop (removed from the product untimed; commit 2950610): programs of
    (batch, KV head) walk `chunk` rows in tiles, elementwise NaN-propagating maxima in registers, one reduction."""
    p = tl.program_id(0)
    bh = tl.program_id(1)
    cols = tl.arange(0, HEAD_DIM)
    kacc = tl.zeros([BLOCK, HEAD_DIM], tl.float32)
    vacc = tl.zeros([BLOCK], tl.float32)
    for r in range(0, chunk, BLOCK):
        rows = p * chunk + r + tl.arange(0, BLOCK)
        offs = bh.to(tl.int64) * seq_k * HEAD_DIM + rows[:, None] * HEAD_DIM + cols[None, :]
        inside = rows[:, None] < seq_k
        k = tl.abs(tl.load(K + offs, mask=inside, other=0.0).to(tl.float32))
        v = tl.load(V + offs, mask=inside, other=0.0).to(tl.float32)
        kacc = _max_nan(kacc, k)
        vacc = _max_nan(vacc, tl.sum(v * v, 1))
    kmax = tl.reduce(tl.reduce(kacc, 1, _max_nan), 0, _max_nan)
    vmax = tl.reduce(vacc, 0, _max_nan)
    tl.atomic_max(KVB + bh * 2, tl.where(kmax != kmax, float("inf"), kmax))
    tl.atomic_max(KVB + bh * 2 + 1, tl.where(vmax != vmax, float("inf"), tl.sqrt(vmax)))


def loop_launch(k, v, kvb, sk, cfg=LOOP):
    parts, block, warps = cfg
    chunk = -(-(-(-sk // parts)) // block) * block
    _bwd_kv_bound_loop[(-(-sk // chunk), k.shape[0] * k.shape[1])](
        k, v, kvb, sk, chunk, HEAD_DIM=k.shape[-1], BLOCK=block, num_warps=warps)


class LoopBound:
    """In place of the module's _fast_kv_bound: the same call, the loop kernel launched (its own grid)."""

    def __getitem__(self, grid):
        return lambda k, v, kvb, sk, **kw: loop_launch(k, v, kvb, sk)


def levers(mod, variant):
    """mod on the product's path with `variant`'s globals (the others at their defaults); returns mod."""
    if not DEFAULTS:
        DEFAULTS.update({"_BWD_WS_KEEP": mod._BWD_WS_KEEP, "_fast_kv_bound": mod._fast_kv_bound,
                         "BWD_GRID_ALL": mod.BWD_GRID_ALL})
    s12.host(mod, "bk")
    for k, v in {**DEFAULTS, **VARIANTS[variant]}.items():
        setattr(mod, k, v)
    if variant == "loop":
        mod._fast_kv_bound = LoopBound()
    return mod


def check_small():
    import torch

    q, k, v, do = s12.small()
    mod = s12.module("window")
    i, j = torch.arange(333, device="cuda")[:, None], torch.arange(333, device="cuda")[None, :]
    for left in (37, 130):
        def run(left=left):
            ref = s12.ref64(q, k, v, do, (j <= i) & (i - j <= left))
            runs = {name: [s12.grads(lambda a, b, c, n=name: levers(mod, n).attention(a, b, c, window=(left, 0)),
                                     q, k, v, do) for _ in "ab"] for name in VARIANTS}
            levers(mod, "api")
            e = {n: max(s12.errs(r[0], ref)) for n, r in runs.items()}
            rep = all(s12.same(*r) for r in runs.values())
            eq = {n: s12.diff(r[0], runs["api"][0]) for n, r in runs.items() if n != "api"}
            zero = all(bool((r[0][0][:, :, 0] == 0).all()) for r in runs.values())
            ok = rep and zero and max(e.values()) < 3e-2
            return ok, (f"max |err| {max(e.values()):.1e} (api {e['api']:.1e}); repeatable {rep}; row 0 dq == 0 "
                        f"{zero}; vs api: {eq}")
        s12.check(f"variants window ({left}, 0) S333", run)


def bound_alone(k, v, time_it=True):
    """The product's bound kernel (64 x 4) against the loop's configurations: KVB's max|K| bit for bit, the V norms
    to 1e-6, NaN in K (head 0) and in V (the last head) giving +inf there only; do_bench ms where time_it."""
    import torch
    import triton.testing

    mod = s12.module("window")
    b, h, sk, d = k.shape
    kvb = torch.zeros(2 * b * h, device="cuda")

    def rows(kk, vv, out):
        out.zero_()
        mod._bwd_kv_bound_rows[(-(-sk // 64), b * h)](kk, vv, out, sk, HEAD_DIM=d, BLOCK=64, num_warps=4)

    kn, vn = k.clone(), v.clone()
    kn[0, 0, 5, 3], vn[-1, -1, sk - 7, 1] = float("nan"), float("nan")
    rows(k, v, kvb)
    res, runs = {}, [("rows 64x4", lambda: rows(k, v, kvb))]
    for cfg in LOOP_CONFIGS:
        got, nan = torch.zeros_like(kvb), torch.zeros_like(kvb)
        loop_launch(k, v, got, sk, cfg)
        loop_launch(kn, vn, nan, sk, cfg)
        torch.cuda.synchronize()
        g, n, w = got.view(-1, 2), nan.view(-1, 2), kvb.view(-1, 2)
        ok = bool(torch.equal(g[:, 0], w[:, 0])) and float(((g[:, 1] - w[:, 1]).abs() / w[:, 1]).max()) < 1e-6
        nan_ok = bool(n[0, 0] == float("inf") and n[-1, 1] == float("inf") and torch.isfinite(n[1:, 0]).all()
                      and torch.isfinite(n[:-1, 1]).all())
        name = "loop %dx%dw%d" % cfg
        res[name + " ok"] = (ok and nan_ok, "bitwise" if torch.equal(g, w) else "norms within 1e-6")

        def one(cfg=cfg, o=got):
            o.zero_()
            loop_launch(k, v, o, sk, cfg)
        runs.append((name, one))
    if time_it:
        for name, fn in runs:
            res[name] = round(float(triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median")), 4)
    return res


def step_of(variant, tensors, window=(1024, 0)):
    import torch

    import fagen

    q, k, v, do = tensors
    if variant == "own":  # the module's own attention (no fagen.attention dispatch), at `window`
        mod = levers(s12.module("window"), "api")
        out = mod.attention(q, k, v, window=window)

        def own():
            levers(mod, "api")
            return torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
        return own
    shape = s9.shape_of()
    sm, mm = s9.row_mods(SW, shape)
    if variant == "flex":
        out = s9.flex_call(sm, mm, shape)(q, k, v)
        return lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
    mod = s12.module("window")
    bm = s9.fagen_mask(mm, shape)
    s9.selection(True)
    lev = "api" if variant == "nondet" else variant
    levers(mod, lev)
    out = fagen.attention(q, k, v, mask_mod=mm, block_mask=bm, deterministic=variant != "nondet")

    def step():
        levers(mod, lev)
        return torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
    return step


def phase_warm(name):
    import torch

    t0 = time.perf_counter()
    try:
        tensors = s12.window_inputs()
        if name == "flex":  # then the bound kernels (compiled here, beside the window child's module)
            step_of("flex", tensors)()
            print(f"CHECK INFO bound alone: {bound_alone(*(t.detach() for t in tensors[1:3]), time_it=False)}",
                  flush=True)
        else:
            base = [g.clone() for g in step_of("api", tensors)()]
            got = {n: [g.clone() for g in step_of(n, tensors)()] for n in VARIANTS if n != "api"}
            torch.cuda.synchronize()
            print(f"CHECK INFO timed shape, vs api: {({n: s12.diff(g, base) for n, g in got.items()})}", flush=True)
        torch.cuda.synchronize()
        print(f"warm {name}: {time.perf_counter() - t0:.1f} s", flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"warm {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    if name == "window":
        check_small()


def phase_time():
    import torch

    from fagen.bench.timing import measure

    t_end = float(os.environ.get("S13_TIME_END", time.time() + 50))
    tensors = s12.window_inputs()
    names = ["flex", *VARIANTS, "nondet"]
    steps = {}
    for p in range(5):
        for item in names[p % len(names):] + names[:p % len(names)]:
            rec = {"variant": item, "pass": p}
            if time.time() > t_end - 12:
                continue
            try:
                if item not in steps:
                    steps[item] = step_of(item, tensors)
                step = steps[item]
                step()
                rec["ms"] = measure(lambda i: step(), 1, torch.device("cuda"), 10.0, 25.0)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(20):
                    step()
                rec["host_ms"] = (time.perf_counter() - t0) * 50.0
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001
                rec["error"] = f"{type(e).__name__}: {str(e)[:160]}"
            print("REC " + json.dumps(rec), flush=True)
    for item in ["api", "loop", "grid"]:
        if time.time() > t_end or item not in steps:
            continue
        try:
            ms, top = s12.kernel_ms(steps[item])
            print("REC " + json.dumps({"variant": item, "kernel_ms": ms, "top": top}), flush=True)
        except Exception as e:  # noqa: BLE001
            print("REC " + json.dumps({"variant": item, "error": f"kernels {type(e).__name__}"}), flush=True)
    if time.time() < t_end:
        try:
            k, v = (t.detach() for t in tensors[1:3])
            print("REC " + json.dumps({"variant": "bound alone", "bound": bound_alone(k, v)}), flush=True)
        except Exception as e:  # noqa: BLE001
            print("REC " + json.dumps({"variant": "bound alone", "error": f"{type(e).__name__}: {e}"[:160]}))
    for w in WINDOWS:  # the main kernel's ms by window (run-time win_left: the same kernels), per-tile overhead
        if time.time() > t_end:
            break
        try:
            ms, top = s12.kernel_ms(step_of("own", tensors, (w, 0)))
            main = [t for n, t in top if n.startswith("_attn_bwd")]
            print("REC " + json.dumps({"variant": f"window {w}", "window": w, "kernel_ms": ms, "main_ms": main[0],
                                       "top": top}), flush=True)
        except Exception as e:  # noqa: BLE001
            print("REC " + json.dumps({"variant": f"window {w}", "error": f"{type(e).__name__}: {e}"[:160]}))


def summary(recs):
    by, hosts = {}, {}
    for r in recs:
        if r.get("error"):
            print(f"ERROR {r['variant']}: {r['error']}")
        elif "ms" in r:
            by.setdefault(r["variant"], []).append(r["ms"])
            hosts.setdefault(r["variant"], []).append(r["host_ms"])
    med = {k: sorted(v)[len(v) // 2] for k, v in by.items()}
    flex = med.get("flex")
    print("\n| variant | median ms | x Flex | each pass (run order) | host ms a call |")
    print("|---|---:|---:|---|---:|")
    for k, v in by.items():
        x = f"{flex / med[k]:.3f}x" if flex else ""
        print(f"| {k} | {med[k]:.4f} | {x} | {' / '.join(f'{m:.4f}' for m in v)} | "
              f"{sorted(hosts[k])[len(v) // 2]:.3f} |")
    pts = []
    for r in recs:
        if "window" in r and "main_ms" in r:
            steps = 16 * sum((min(-(-(n0 + 128 + r["window"]) // 64) * 64, 8192) - n0) // 64
                             for n0 in range(0, 8192, 128))
            pts.append((steps, r["main_ms"]))
            print(f"window {r['window']}: main kernel {r['main_ms']:.4f} ms, {steps} steps, "
                  f"{r['main_ms'] * 1e3 / steps * 132:.2f} us a step an SM; all kernels {r['kernel_ms']:.4f}")
    if len(pts) >= 2:  # main ms = c0 + c1 steps: c0 the part that does not grow with the window (1024 tiles)
        n = len(pts)
        mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
        c1 = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
        c0 = my - c1 * mx
        print(f"fit: main ms = {c0:.4f} + {c1 * 1e3:.5f} us x steps ({c1 * 1e3 * 132:.2f} us a step an SM); "
              f"c0 over 1024 tiles on 132 SMs: {c0 * 1e3 * 132 / 1024:.2f} us a tile")
    for r in recs:
        if "kernel_ms" in r and "window" not in r:
            print(f"kernels {r['variant']}: {r['kernel_ms']:.4f} {r['top']}")
        elif "bound" in r:
            print(f"bound alone: {r['bound']}")


def main():
    from _phases import child_env, run_phase

    t0 = time.time()
    env = child_env("/tmp/fagen-s13-window", ROOT)
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    script = os.path.abspath(__file__)
    lines: dict = {}

    def go(name, limit, extra=()):
        rc, got = run_phase(script, name, limit, env, on_line=lambda s: print(s, end="", flush=True), extra=extra)
        lines.setdefault(name + "".join(extra), []).extend(got)
        if rc != 0:
            print(f"phase {name} {extra}: {rc}", flush=True)

    threads = [threading.Thread(target=go, args=("warm", 34.0, (w, ))) for w in ("flex", "window")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    left = BUDGET - (time.time() - t0)
    env["S13_TIME_END"] = str(time.time() + left - 6)
    print(f"compiled in {time.time() - t0:.0f} s; timing for {left:.0f} s", flush=True)
    go("time", max(5.0, left))
    recs = [json.loads(s[4:]) for s in lines.get("time", []) if s.startswith("REC ")]
    summary(recs)
    for s in [x for got in lines.values() for x in got if x.startswith("CHECK ")]:
        print(s[6:], end="")
    print(f"total {time.time() - t0:.0f} s")
    if os.environ.get("OUTX"):
        os.makedirs(os.environ["OUTX"], exist_ok=True)
        with open(os.path.join(os.environ["OUTX"], "window_s13.json"), "w") as f:
            json.dump({"records": recs, "lines": lines}, f, indent=1)


if __name__ == "__main__":
    if "--phase" in sys.argv:
        if sys.argv[sys.argv.index("--phase") + 1] == "time":
            phase_time()
        else:
            phase_warm(sys.argv[-1])
    else:
        main()
