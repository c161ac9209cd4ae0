"""Issue 26, thirteenth session (helper window): the sliding-window row's deterministic backward (causal + window
(1024, 0), B1 H16 S8192 d128 bf16) with the fixed passes' levers of [Note] The accumulator's fill and conversion
order (fagen/templates/host/gluon_bwd_launch.py); docs/mods.md "The window's backward (thirteenth session)".

    PYTHONPATH=$PWD python3 scripts/gpu_window_s13.py

Variants (module globals of the window render, set before every call; each else at the product's defaults):
  api    the product (fagen.attention with the window's mask_mod, the fast path, bound kernel)
  keep   _BWD_WS_KEEP 2^28: the 68 MB workspace kept per stream instead of allocated per call (lever 3)
  side   keep + _BWD_FILL_SIDE (the accumulator's fill on a side stream beside the bound and the preprocess)
  rfill  keep + _BWD_FILL_REV (the fill kernel, highest query blocks first)
  rconv  keep + _BWD_CONV_REV (the conversion's ORDER 1, highest query blocks first)
  all    keep + side + rfill + rconv
  nondet the product with deterministic=False (the unordered adds: the reference the fixed passes are measured to)
  own    the product module's own attention (no fagen.attention dispatch); desc: the same render with its steps in
         descending query blocks (variant bwd_window_desc 1, a main-kernel lever: same bits, other L2 order)
Phases (scripts/_phases.py): warm-flex and warm-window at once (the latter then checks at B1 H2 S333, windows
(37, 0) and (130, 0): each variant against float64, bit for bit the product's, repeatable, row 0's dq exactly 0; a
mutant that must fail: the fill kernel left out; at the timed shape each variant bit for bit the product's), then
`time`: passes in rotated orders, medians (do_bench, L2 flushed), host ms a call, the kernels' ms (torch.profiler).
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

BUDGET = 66.0
SW = "sliding-window+causal"
KEEP = {"_BWD_WS_KEEP": 1 << 28}
VARIANTS = {"api": {}, "keep": KEEP, "side": {**KEEP, "_BWD_FILL_SIDE": True},
            "rfill": {**KEEP, "_BWD_FILL_REV": True}, "rconv": {**KEEP, "_BWD_CONV_REV": True},
            "all": {**KEEP, "_BWD_FILL_SIDE": True, "_BWD_FILL_REV": True, "_BWD_CONV_REV": True}}
DEFAULTS: dict = {}


def levers(mod, variant):
    """mod on the product's path with `variant`'s globals (the others at their defaults); returns mod."""
    if not DEFAULTS:
        DEFAULTS.update({k: getattr(mod, k) for k in ("_BWD_WS_KEEP", "_BWD_FILL_SIDE", "_BWD_FILL_REV",
                                                       "_BWD_CONV_REV")})
    s12.host(mod, "bk")
    for k, v in {**DEFAULTS, **VARIANTS[variant]}.items():
        setattr(mod, k, v)
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
            ok = rep and zero and max(e.values()) < 3e-2 and all(x == "bitwise" for x in eq.values())
            return ok, (f"max |err| {max(e.values()):.1e} (api {e['api']:.1e}); repeatable {rep}; row 0 dq == 0 "
                        f"{zero}; vs api: {eq}")
        s12.check(f"levers window ({left}, 0) S333", run)

    ref = s12.ref64(q, k, v, do, (j <= i) & (i - j <= 130))

    def mutant():  # the fill kernel that fills nothing: the accumulator keeps the last call's sums
        real = mod._fast_fill_rev
        mod._fast_fill_rev = type("NoFill", (), {"__getitem__": lambda self, g: (lambda *a, **kw: None)})()
        try:
            for _ in range(2):
                got = s12.grads(lambda a, b, c: levers(mod, "rfill").attention(a, b, c, window=(130, 0)), q, k, v, do)
        finally:
            mod._fast_fill_rev = real
            levers(mod, "api")
        try:
            e = s12.errs(got, ref)
        except AssertionError as ex:
            return True, f"caught ({str(ex).splitlines()[0][:100]})"
        return False, f"passed float64 (err {max(e):.1e})"
    s12.check("mutant: rfill without its fill", mutant)


def desc_module():
    """The window render with its steps in descending query blocks (variant bwd_window_desc 1; mode 2 adds integers
    in any order, so its gradients must equal the product's bit for bit)."""
    from fagen.runtime.loader import load_source
    from fagen.spec.kernel import KernelSpec

    if "desc" not in s12._MODS:
        spec = KernelSpec(backend="gluon", direction="bwd", head_dim=128, dtype="bf16", mask="causal", window=True)
        src = s9.lever_source(spec, {"bwd_window_desc": 1})
        assert "GQA * steps - 1 - i" in src and "BWD_DET_MODE = 2" in src, "the lever did not render"
        s12._MODS["desc"] = load_source(src, spec.name + "_desc_s13")
    return s12._MODS["desc"]


def step_of(variant, tensors):
    import torch

    import fagen

    q, k, v, do = tensors
    if variant in ("own", "desc"):  # the module's own attention (no fagen.attention dispatch)
        mod = desc_module() if variant == "desc" else levers(s12.module("window"), "api")
        out = mod.attention(q, k, v, window=(1024, 0))

        def own():
            if variant == "own":
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
        if name == "flex":
            step_of("flex", tensors)()
        elif name == "desc":
            step_of("desc", tensors)()
        else:
            base = [g.clone() for g in step_of("api", tensors)()]
            got = {n: [g.clone() for g in step_of(n, tensors)()] for n in VARIANTS if n != "api"}
            torch.cuda.synchronize()
            print(f"CHECK {'PASS' if all(s12.same(g, base) for g in got.values()) else 'FAIL'} timed shape, vs "
                  f"api: {({n: s12.diff(g, base) for n, g in got.items()})}", flush=True)
        torch.cuda.synchronize()
        print(f"warm {name}: {time.perf_counter() - t0:.1f} s", flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"warm {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    if name == "window":
        check_small()
    elif name == "desc":
        check_desc()


def check_desc():
    import torch

    q, k, v, do = s12.small()
    mod = desc_module()
    i, j = torch.arange(333, device="cuda")[:, None], torch.arange(333, device="cuda")[None, :]
    for left in (37, 130):
        def run(left=left):
            runs = [s12.grads(lambda a, b, c: mod.attention(a, b, c, window=(left, 0)), q, k, v, do) for _ in "ab"]
            e = max(s12.errs(runs[0], s12.ref64(q, k, v, do, (j <= i) & (i - j <= left))))
            zero = bool((runs[0][0][:, :, 0] == 0).all())
            return s12.same(*runs) and zero and e < 3e-2, (f"max |err| {e:.1e}; repeatable {s12.same(*runs)}; "
                                                          f"row 0 dq == 0 {zero}")
        s12.check(f"desc window ({left}, 0) S333", run)


def phase_time():
    import torch

    from fagen.bench.timing import measure

    t_end = float(os.environ.get("S13_TIME_END", time.time() + 50))
    tensors = s12.window_inputs()
    names = ["flex", *VARIANTS, "nondet", "own", "desc"]
    steps, kept = {}, {}
    for p in range(3):
        for item in names[p:] + names[:p]:
            rec = {"variant": item, "pass": p}
            if time.time() > t_end:
                continue
            try:
                if item not in steps:
                    steps[item] = step_of(item, tensors)
                step = steps[item]
                got = step()
                if item in ("own", "desc") and item not in kept:
                    kept[item] = [g.clone() for g in got]
                    if len(kept) == 2:
                        print(f"CHECK {'PASS' if s12.same(kept['own'], kept['desc']) else 'FAIL'} timed shape: desc "
                              f"vs own {s12.diff(kept['desc'], kept['own'])}", flush=True)
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
    for item in ["api", "keep", "rfill", "rconv"]:
        if time.time() > t_end or item not in steps:
            continue
        try:
            ms, top = s12.kernel_ms(steps[item])
            print("REC " + json.dumps({"variant": item, "kernel_ms": ms, "top": top}), flush=True)
        except Exception as e:  # noqa: BLE001
            print("REC " + json.dumps({"variant": item, "error": f"kernels {type(e).__name__}"}), flush=True)


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
    for r in recs:
        if "kernel_ms" in r:
            print(f"kernels {r['variant']}: {r['kernel_ms']:.4f} {r['top']}")


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

    threads = [threading.Thread(target=go, args=("warm", 36.0, (w, ))) for w in ("flex", "window", "desc")]
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
