"""Issue 26, eleventh session: the sliding-window row's backward (attention-gym's generate_sliding_window(1024),
causal, B1 H16 S8192 d128 bf16) against FlexAttention's (docs/mods.md, "The window's backward (eleventh session)").

    PYTHONPATH=$PWD python3 scripts/gpu_window_s11.py [--round b]

Phases (scripts/_phases.py; the "warm" ones at once, then "time"):
  warm   each group of variants sharing modules once at the bench shape, then in the same child (the kernels compiled
         once) its checks: float64 of the user's own mask (B1 H2 S333 d128 bf16, windows (37, 0) and (130, 0): lengths
         and windows not block multiples), a bitwise repeat of every deterministic one; for the window's fast
         fixed-point path ([Note] Window fixed-point fast path) also its gradients against the plain path's and a
         mutant that must fail (the bound kernel left out: KVB stays 0, the units overflow).
  time   per variant: backward ms (autograd.grad of a kept output, do_bench median, L2 flushed) and TF/s (2.5 * 4 * D
         per visible pair), Flex in the same process, the host's own time per call (10 calls issued, no sync) and
         the kernels' own time per call (torch.profiler, 3 calls) with the three largest named.
Variants: flex; api (fagen.attention: the Triton backward today); t-mXnYwZsW: the Triton window bwd module at that tile;
g-unord (deterministic=False), g-fixed (bwd_window_fixed 1, s10's fast mode 2): the window's Gluon module with
_BWD_FAST_SWITCHES; g-ftma: bwd_window_fixed 1 + bwd_fixed_tma 1 on the plain host path, -wf on the window's fast path
(_BWD_WINDOW_FAST); g-sec-wf: bwd_fixed 1 + bwd_fixed_tma 1 + bwd_sections 4 (one program per tile) on it, g-sec-u
that render's unordered mode (deterministic=False).
Round b (--round b): the product after the flip (api, api-nondet), the Triton backward (triton: $FAGEN_HOPPER=0), the
bound kernel's configurations alone (bound) and the product with the fastest (api-bound), sections again (g-sec-wf).
Round a's api-g: fagen.attention with the window selected onto g-ftma-wf (variant bwd_window, bwd_selected_switches,
_BWD_WINDOW_FAST): what a flip would run; checked through fagen.attention with the size floors at 0.
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
import gpu_mods_bwd_s9 as s9  # noqa: E402  (lever_source, reference, flex_call, row_mods, fagen_mask, shape_of)

WINDOW = (1024, 0)
SW = "sliding-window+causal"
BUDGET = 74.0
TILES = ["t-m64n128w8s3", "t-m128n64w8s3", "t-m64n64w4s3"]
VARIANTS = ["flex", "api", "g-ftma-wf", "g-sec-wf", "api-g", "g-unord", "g-sec-u", *TILES, "g-ftma"]  # timing order
# (api-g changes the selection for the fagen.attention calls after it: "api" comes before it)
# warm groups: (variants sharing modules, check names run after them in the same child)
WARM = [(["flex"], []), (["api"], []), *[([t], [t]) for t in TILES], (["g-unord"], ["g-unord"]),
        (["g-fixed"], []), (["g-ftma", "g-ftma-wf"], ["g-ftma-wf", "same", "mutant"]), (["g-sec-wf", "g-sec-u"], ["g-sec-wf", "g-sec-u"]),
        (["api-g"], ["api-g"])]
ROUND_B = os.environ.get("S11_ROUND") == "b" or sys.argv[1:3] == ["--round", "b"]  # the parent reads argv
LEVERS = {"fixed": {"bwd_window_fixed": 1}, "ftma": {"bwd_window_fixed": 1, "bwd_fixed_tma": 1},
          "sec": {"bwd_fixed": 1, "bwd_fixed_tma": 1, "bwd_sections": 4}}


def gluon_module(kind: str):
    """The window switch's Gluon bwd module (causal): the default render (unord) or a lever's."""
    import fagen
    from fagen.runtime.loader import load_source
    from fagen.spec.kernel import KernelSpec

    spec = KernelSpec(backend="gluon", direction="bwd", head_dim=128, dtype="bf16", mask="causal", window=True)
    if kind == "unord":
        return fagen.load(spec)
    src = s9.lever_source(spec, LEVERS[kind])
    assert "BWD_DET_MODE = 2" in src and ("_run_backward_window" in src) == (kind != "fixed"), kind
    return load_source(src, spec.name + "_" + kind)


_MODULES: dict = {}


def gluon_call(variant: str):
    """(q, k, v, window) -> out of a g-* variant."""
    parts = variant.split("-")
    kind, wf = parts[1], parts[-1] == "wf"
    module = _MODULES.get(kind) or _MODULES.setdefault(kind, gluon_module(kind))
    det = kind != "unord" and parts[-1] != "u"

    def call(q, k, v, w=WINDOW):  # the flags set per call: variants share a module
        module._BWD_FAST_SWITCHES = kind in ("unord", "fixed") or not det  # modes 0/1 (and s10's 2) fast
        if hasattr(module, "_BWD_WINDOW_FAST"):
            module._BWD_WINDOW_FAST = wf
        return module.attention(q, k, v, window=w, deterministic=det)
    call.module = module
    return call


def triton_call(variant: str):
    import fagen
    from fagen.spec.kernel import KernelSpec

    t = variant[2:]
    m, rest = t[1:].split("n")
    n, rest = rest.split("w")
    w, s = rest.split("s")
    spec = KernelSpec(backend="triton", direction="bwd", head_dim=128, dtype="bf16", mask="causal", window=True,
                      block_m=int(m), block_n=int(n), num_warps=int(w), num_stages=int(s))
    module = fagen.load(spec)
    return lambda q, k, v, win=WINDOW: module.attention(q, k, v, window=win)


def api_gluon():
    """fagen.attention with the window switch selected onto the Gluon backward's fixed-point render with the qmul
    rows by TMA on the window's fast path: what flipping the selection would run."""
    import fagen
    from fagen import backends
    from fagen.runtime import hopper
    from fagen.spec.kernel import KernelSpec

    from fagen.runtime import loader
    from fagen.runtime.device import gpu_arch
    from fagen.codegen.render import render_state

    backends.GLUON.bwd_selected_switches = ((), ("window",))
    hopper._bwd_twin.cache_clear()
    s9.selection(True)
    spec = KernelSpec(backend="gluon", direction="bwd", head_dim=128, dtype="bf16", mask="causal", window=True)
    # the render as variant["bwd_window"] = LEVERS["ftma"] gives it, put where fagen.load finds it in this process
    # (fagen.load's render index on disk is keyed by the spec and fagen's files, not the variant: rendering through
    # it here would hand the lever's source to other processes of this run)
    spec = spec.for_arch(gpu_arch())
    key = (spec.hash, render_state(spec))  # fagen.load's in-process memo keys on the variant too (thirteenth session)
    module = loader._loaded.get(key)
    if module is None or not hasattr(module, "_BWD_WINDOW_FAST"):
        module = loader._loaded[key] = gluon_module("ftma")
    assert fagen.load(spec) is module and module.BWD_DET_MODE == 2 and hasattr(module, "_BWD_WINDOW_FAST")
    module._BWD_WINDOW_FAST = True
    return module


def caller(variant: str, sm, mm, bm):
    import fagen

    if variant.startswith("g-"):
        return gluon_call(variant)
    if variant.startswith("t-"):
        return triton_call(variant)
    if variant == "api-bound":  # the product with the fastest bound configuration of this process's "bound" row
        module = product_module()
        module._BWD_BOUND_ROWS, module._BWD_BOUND_WARPS = BEST_BOUND or (64, 4)
        s9.selection(True)
    elif variant.startswith("api-g"):
        api_gluon()
    else:
        s9.selection(variant != "triton")  # triton: $FAGEN_HOPPER=0, the Triton backward
    det = not variant.endswith("-nondet")
    return lambda q, k, v: fagen.attention(q, k, v, score_mod=sm, mask_mod=mm, block_mask=bm, deterministic=det)


def phase_warm(items: list) -> None:
    import torch

    from fagen.bench.mods import _inputs

    shape = s9.shape_of()
    q, k, v, do = _inputs(shape, "cuda", True)
    sm, mm = s9.row_mods(SW, shape)
    for variant in items:
        t0 = time.perf_counter()
        try:
            if variant == "bound":  # compiles the bound kernel's configurations
                print(f"warm bound: {bound_bench(k.detach(), v.detach())}", flush=True)
                continue
            att = s9.flex_call(sm, mm, shape) if variant == "flex" else caller(variant, sm, mm, s9.fagen_mask(mm, shape))
            torch.autograd.grad(att(q, k, v), (q, k, v), do)
            torch.cuda.synchronize()
            print(f"warm {variant}: {time.perf_counter() - t0:.1f} s", flush=True)
        except Exception as e:  # noqa: BLE001 - the time phase reports it again
            print(f"warm {variant}: {type(e).__name__}: {str(e)[:160]}", flush=True)


def phase_check(names: list) -> None:
    import torch

    from fagen.spec.axes import DType
    from fagen.verify.tolerances import compare_grad

    H, S, D = 2, 333, 128
    g = torch.Generator().manual_seed(11)
    q, k, v, do = (torch.randn(1, H, S, D, generator=g).to("cuda", torch.bfloat16) for _ in range(4))

    def win_mask(left):
        return lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx <= left)

    def grads(call, left):
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        return torch.autograd.grad(call(qg, kg, vg, (left, 0)), (qg, kg, vg), do)

    def line(name, fn):
        t0 = time.perf_counter()
        try:
            text = fn()
        except Exception as e:  # noqa: BLE001 - a line, never the end of the run
            text = f"FAIL {name}: {type(e).__name__}: {str(e)[:200]}"
        print(f"CHECK {text} ({time.perf_counter() - t0:.1f} s)", flush=True)

    def against_f64(name, call, left, repeat, expect_fail=False):
        def fn():
            got = grads(call, left)
            ref = s9.reference(None, win_mask(left), "none", q, k, v, do)
            try:
                errs = [compare_grad(n, a, r, DType.BF16) for n, a, r in zip(("dq", "dk", "dv"), got, ref)]
            except AssertionError as e:
                if expect_fail:
                    return f"PASS {name}: caught ({str(e).splitlines()[0][:120]})"
                raise
            if expect_fail:
                return f"FAIL {name}: the mutant passed float64 (dq err {errs[0]:.1e})"
            note = ""
            if repeat:
                twice = grads(call, left)
                assert all(torch.equal(a, b) for a, b in zip(got, twice)), "two runs differ"
                note = "; bitwise repeatable"
            return f"PASS {name}: max |err| dq {errs[0]:.1e} dk {errs[1]:.1e} dv {errs[2]:.1e}{note}"
        line(name, fn)

    for name in names:
        if name.startswith("t-"):
            call = triton_call(name)
            # 144: a multiple of 16 as the bench's 1024 (the Triton kernels specialise the window's ints by class)
            against_f64(f"{name} window (144, 0)", lambda a, b, c, w: call(a, b, c, w), 144, True)
        elif name in ("g-unord", "g-ftma-wf", "g-sec-wf", "g-sec-u"):
            call = gluon_call(name)
            for left in (37, 130):
                against_f64(f"{name} window ({left}, 0)", call, left, name.endswith("wf"))
            if name.endswith("wf"):
                taken = []
                real = call.module._run_backward_window
                call.module._run_backward_window = lambda *a: (taken.append(1), real(*a))[1]
                grads(call, 37)
                call.module._run_backward_window = real
                line(f"{name} took the window path", lambda: f"{'PASS' if taken else 'FAIL'} {name}: window path "
                                                              f"calls {len(taken)}")
        elif name == "api-g":  # through fagen.attention (the mask_mod lowered to the window switch), floors at 0
            from fagen.runtime import api, hopper

            api.BWD_MIN_WORK = hopper.BWD_MIN_WORK = hopper.BWD_WINDOW_MIN_WORK = 0
            module = api_gluon()
            taken = []
            real = module._run_backward_window
            module._run_backward_window = lambda *a: (taken.append(1), real(*a))[1]
            import fagen
            for left in (37, 130):
                mm_ = win_mask(left)
                against_f64(f"api-g window ({left}, 0)", lambda a, b, c, w, mm_=mm_: fagen.attention(a, b, c, mask_mod=mm_),
                            left, True)
            line("api-g path", lambda: f"{'PASS' if len(taken) == 4 else 'FAIL'} api-g: window fast-path calls "
                                       f"{len(taken)} of 4")
        elif name == "api-prod":  # the flipped product through fagen.attention, floors at 0
            import fagen
            from fagen.runtime import hopper

            hopper.BWD_MIN_WORK = hopper.BWD_WINDOW_MIN_WORK = 0
            s9.selection(True)
            module = product_module()
            taken = []
            real_w, real_f = module._run_backward_window, module._run_backward_fast
            module._run_backward_window = lambda *a: (taken.append(2), real_w(*a))[1]
            module._run_backward_fast = lambda *a, **kw: (taken.append(a[10]), real_f(*a, **kw))[1]
            for left in (37, 130):
                mm_ = win_mask(left)
                against_f64(f"api window ({left}, 0)", lambda a, b, c, w, mm_=mm_: fagen.attention(a, b, c, mask_mod=mm_),
                            left, True)
                against_f64(f"api deterministic=False window ({left}, 0)",
                            lambda a, b, c, w, mm_=mm_: fagen.attention(a, b, c, mask_mod=mm_, deterministic=False),
                            left, False)
            module._run_backward_window, module._run_backward_fast = real_w, real_f
            line("api paths", lambda: f"{'PASS' if taken == [2, 2, 1, 2, 2, 1] else 'FAIL'} api: host paths "
                                      f"{taken} (2: the window's fixed-point path, 1: the unordered fast path)")
        elif name == "api-mutant":  # the product module with the bound kernel left out
            import fagen

            module = product_module()
            real = module._fast_kv_bound
            module._fast_kv_bound = type("NoBound", (), {"__getitem__": lambda self, grid: (lambda *a, **k: None)})()
            try:
                against_f64("api mutant (no bound kernel) must fail",
                            lambda a, b, c, w: fagen.attention(a, b, c, mask_mod=win_mask(130)), 130, False,
                            expect_fail=True)
            finally:
                module._fast_kv_bound = real
        elif name == "same":  # the fast path's gradients against the plain path's (the same module)
            fast, plain = gluon_call("g-ftma-wf"), gluon_call("g-ftma")

            def fn():
                res = []
                for left in (37, 130):
                    a, b = grads(fast, left), grads(plain, left)
                    res.append(all(torch.equal(x, y) for x, y in zip(a, b)))
                    if not res[-1]:
                        res[-1] = max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b))
                return f"{'PASS' if all(r is True for r in res) else 'NOTE'} g-ftma fast == plain bitwise: {res}"
            line("same", fn)
        elif name == "mutant":  # the bound kernel left out: KVB stays 0
            call = gluon_call("g-ftma-wf")
            mod = call.module
            real = mod._fast_kv_bound
            mod._fast_kv_bound = type("NoBound", (), {"__getitem__": lambda self, grid: (lambda *a, **k: None)})()
            try:
                against_f64("mutant (no bound kernel) must fail", call, 130, False, expect_fail=True)
            finally:
                mod._fast_kv_bound = real


def kernel_ms(fn, n=3):
    """(kernels' ms per call, [(name, ms per call)] of the three largest) from torch.profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    per = {}
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = getattr(e, "self_cuda_time_total", 0)
        if t:
            per[e.key] = per.get(e.key, 0.0) + t / 1e3 / n
    top = sorted(per.items(), key=lambda x: -x[1])[:4]
    return sum(per.values()), [(k[:32], round(v, 3)) for k, v in top]


def phase_time() -> None:
    import torch

    from fagen.bench.mods import _inputs, _visible_pairs
    from fagen.bench.timing import measure

    shape = s9.shape_of()
    q, k, v, do = _inputs(shape, "cuda", True)
    t_end = float(os.environ.get("S11_TIME_END", time.time() + 60))
    sm, mm = s9.row_mods(SW, shape)
    bm = s9.fagen_mask(mm, shape)
    fl = 2.5 * 4.0 * shape.head_dim * _visible_pairs(bm, mm, shape)
    for variant in plan():
        rec = {"variant": variant}
        if time.time() > t_end:
            rec["error"] = "skipped: out of time"
        elif variant == "bound":
            try:
                rec["bound"] = bound_bench(k.detach(), v.detach())
                good = {c: ms for c, (ms, ok) in rec["bound"].items() if ms is not None and ok is True}
                if good:
                    best = min(good, key=good.get)
                    BEST_BOUND[:] = [int(x) for x in best.split("x")]
                    rec["best"] = best
            except Exception as e:  # noqa: BLE001
                rec["error"] = f"{type(e).__name__}: {str(e)[:160]}"
        else:
            try:
                att = s9.flex_call(sm, mm, shape) if variant == "flex" else caller(variant, sm, mm, bm)
                out = att(q, k, v)
                step = lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)  # noqa: E731
                step()
                rec["bwd_ms"] = measure(lambda i: step(), 1, torch.device("cuda"), 10.0, 25.0)
                rec["tflops"] = fl / rec["bwd_ms"] / 1e9
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(10):
                    step()
                rec["host_ms"] = (time.perf_counter() - t0) * 100.0
                torch.cuda.synchronize()
                try:
                    rec["kernel_ms"], rec["top"] = kernel_ms(step)
                except Exception as e:  # noqa: BLE001
                    rec["top"] = f"profiler: {type(e).__name__}: {str(e)[:80]}"
                del out
            except Exception as e:  # noqa: BLE001 - a row of the table
                rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        print("REC " + json.dumps(rec), flush=True)


def plan() -> list:
    if ROUND_B:
        return VARIANTS_B
    return VARIANTS


# round B: the product after the flip (8287125) through fagen.attention, deterministic and not, against the Triton
# backward ($FAGEN_HOPPER=0) and Flex; the bound kernel's configurations alone, then the product with the fastest
VARIANTS_B = ["flex", "api", "triton", "api-nondet", "bound", "api-bound", "g-sec-wf"]
BOUND_CONFIGS = [(64, 4), (32, 4), (64, 8), (128, 8), (32, 2), (16, 2)]


def product_module():
    """The window switch's Gluon bwd module as fagen.attention loads it (the flipped default render)."""
    import fagen
    from fagen.spec.kernel import KernelSpec

    module = fagen.load(KernelSpec(backend="gluon", direction="bwd", head_dim=128, dtype="bf16", mask="causal",
                                   window=True))
    assert module.BWD_DET_MODE == 2 and module._BWD_WINDOW_FAST, "not the flipped render"
    return module


def bound_bench(k, v):
    """{(rows, warps): (ms, ok)} of the bound kernel alone on k, v (do_bench; ok: max|K| bit for bit and the V norms
    within 1e-5 of _bwd_kv_bound's float64 values)."""
    import torch
    import triton.testing

    mod = product_module()
    b, h, sk, _ = k.shape
    want_k = k.abs().amax(dim=(2, 3)).float().reshape(-1)
    want_v = torch.linalg.vector_norm(v.double(), dim=-1).amax(-1).reshape(-1)
    out = {}
    for rows, warps in BOUND_CONFIGS:
        kvb = torch.zeros(2 * b * h, device=k.device)

        def go():
            mod._bwd_kv_bound_rows[(-(-sk // rows), b * h)](k, v, kvb, sk, HEAD_DIM=128, BLOCK=rows, num_warps=warps)
        try:
            go()
            torch.cuda.synchronize()
            got = kvb.view(-1, 2)
            ok = bool(torch.equal(got[:, 0], want_k)) and float(((got[:, 1].double() - want_v).abs() /
                                                                   want_v).max()) < 1e-5
            out[f"{rows}x{warps}"] = (float(triton.testing.do_bench(go, warmup=5, rep=20, return_mode="median")), ok)
        except Exception as e:  # noqa: BLE001
            out[f"{rows}x{warps}"] = (None, f"{type(e).__name__}: {str(e)[:80]}")
    return out


def main() -> None:
    from _phases import child_env, run_phase

    t0 = time.time()
    env = child_env("/tmp/fagen-s11-window", ROOT)
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    script = os.path.abspath(__file__)
    lines: dict[str, list] = {}
    if sys.argv[1:3] == ["--round", "b"]:
        env["S11_ROUND"] = "b"
    todo = set(plan())
    groups = [(g, c) for g, c in (WARM_B if ROUND_B else WARM) if any(x in todo for x in g)]

    def go(name, limit, extra=()):
        rc, got = run_phase(script, name, limit, env, on_line=lambda s: print(s, end="", flush=True), extra=extra)
        lines.setdefault(name, []).extend(got)
        if rc != 0:
            print(f"phase {name}: {rc}", flush=True)

    threads = [threading.Thread(target=go, args=(f"warm{i}", 44.0, (json.dumps([g, c]),)))
               for i, (g, c) in enumerate(groups)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    left = BUDGET - (time.time() - t0)
    env["S11_TIME_END"] = str(time.time() + left - 4)
    print(f"compiled in {time.time() - t0:.0f} s; timing for {left:.0f} s", flush=True)
    go("time", max(5.0, left))
    recs = [json.loads(s[4:]) for s in lines.get("time", []) if s.startswith("REC ")]
    flex = next((r.get("bwd_ms") for r in recs if r["variant"] == "flex"), None)
    print("\n| variant | bwd ms | TF/s | x Flex | kernels ms | host ms | top kernels |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for r in recs:
        if "bound" in r:
            print(f"| bound kernel alone (rows x warps: ms, ok) | {r['bound']} | best {r.get('best')} | | | | |")
            continue
        if r.get("error"):
            print(f"| {r['variant']} | - | - | {r['error'][:90]} | | | |")
            continue
        x = f"{flex / r['bwd_ms']:.2f}x" if flex else "-"
        print(f"| {r['variant']} | {r['bwd_ms']:.3f} | {r['tflops']:.0f} | {x} | {r.get('kernel_ms', 0):.3f} | "
              f"{r.get('host_ms', 0):.3f} | {r.get('top')} |")
    for s in [x for got in lines.values() for x in got if x.startswith("CHECK ")]:
        print(s[6:], end="")
    print(f"total {time.time() - t0:.0f} s")
    if os.environ.get("OUTX"):
        os.makedirs(os.environ["OUTX"], exist_ok=True)
        with open(os.path.join(os.environ["OUTX"], "window_s11.json"), "w") as f:
            json.dump({"records": recs, "lines": lines}, f, indent=1)


BEST_BOUND: list = []
WARM_B = [(["flex"], []), (["api", "api-nondet"], ["api-prod", "api-mutant"]), (["triton"], []),
          (["bound"], []), (["g-sec-wf"], [])]

if __name__ == "__main__":
    if "--phase" in sys.argv:
        name = sys.argv[sys.argv.index("--phase") + 1]
        if name == "time":
            phase_time()
        else:
            items, checks = json.loads(sys.argv[-1])
            phase_warm(items)
            phase_check(checks)
    else:
        main()
