"""Issue 26, eighteenth session (helper window): the mods suite's sliding-window row's backward (B1 H16 S8192 d128
bf16, causal, window (1024, 0) as attention-gym's mask_mod, lowered to the window switch) through the suite's own
path, fagen.attention with gradients (the suite's inputs, fagen's block mask, torch.autograd.grad on a kept graph),
one process, with the window render chosen by the flip's own mechanism (variant["bwd_window"] set, resolve's memo
cleared): prod (the fixed-point render, main's until the flip), spin (the seventeenth session's store chain with the
spun turn), pdl (spin + bwd_window_pdl 1: the dQ conversion as the main kernel's programmatic dependent, [Note]
Window conversion overlap), def (this tree's own render: pdl after the flip commit), their deterministic=False
calls (prod-u, def-u) and Flex. docs/mods.md "The window's backward (eighteenth session)".

Round A (at 2fd943c) timed api-* and the modules' backward() (mod-*: the seventeenth session's round B) side by side.
Round B (this text): warm children at once (prod: the fixed module's modes 2 and 1; fwd: the suite's no-gradient
Gluon forward; spin; flex; pdl: repeatable at the timed shape, float64 at S1000 (130, 0) on the persistent grid and
on 4 programs, three calls, row 0's dq == 0, bit for bit spin's, then a CUDA graph capture of its backward (two
replays bit for bit the eager call) and its deterministic=False against float64); then one main child: which
module each call resolved, repeatable and pdl == spin bit for bit at the timed shape, interleaved shuffled passes
(fagen.bench.timing.measure, L2 flushed) with per-pass ratios, torch.profiler's kernels, and the suite's row
function itself (fagen.bench.mods.mod_rows, Flex off, 3 rounds) under prod and def, alternating, while time is
left. Exit 1 on a FAIL.

    PYTHONPATH=$PWD python3 scripts/gpu_window_s18.py [--round A|B]
    PYTHONPATH=$PWD python3 scripts/gpu_window_s18.py --dry-run     # CPU: the renders built for sm_90
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

SPIN = {"bwd_window_desc": 1, "bwd_window_chain": 2, "bwd_window_pending": 0, "bwd_window_relaxed": 2}
PDL = {**SPIN, "bwd_window_pdl": 1}  # spin + the conversion as the main kernel's programmatic dependent
PRODUCT = {"bwd_window_fixed": 1, "bwd_fixed_tma": 1}  # main's variant bwd_window
WIN = (1024, 0)
SW = "sliding-window+causal"
BUDGET = 58.0
ROUND = (sys.argv[sys.argv.index("--round") + 1] if "--round" in sys.argv else "A").upper()
FAILS: list = []


def spec_():
    from fagen.spec.kernel import KernelSpec

    return KernelSpec(backend="gluon", direction="bwd", head_dim=128, dtype="bf16", mask="causal", window=True)


_DEFAULT: list = []  # this tree's own variant bwd_window (round B: the flip's), kept before the first use()


def use(keys):
    """The flip's mechanism in this process: variant bwd_window = keys (None: this tree's own), and every memo of
    the resolved module cleared (resolve's _FAST and _module, which key on the spec alone), so the next
    fagen.attention resolves anew."""
    from fagen import backends
    from fagen.runtime import resolve

    if not _DEFAULT:
        _DEFAULT.append(dict(backends.GLUON.variant["bwd_window"]))
    backends.GLUON.variant["bwd_window"] = dict(_DEFAULT[0] if keys is None else keys)
    resolve._FAST.clear()
    resolve._module.cache_clear()


def spin_module(keys=None):
    """The module of variant bwd_window = keys (default SPIN), loaded as the flip would load it."""
    import fagen

    use(keys or SPIN)
    try:
        return fagen.load(spec_())
    finally:
        use(None)


def check(ok, text):
    print(f"CHECK {'PASS' if ok else 'FAIL'} {text}", flush=True)
    if not ok:
        FAILS.append(text)


def dry_run():
    """CPU: the flip's render equals the seventeenth script's lever render (lever_source), and both renders' main
    kernels build for sm_90 (ptxas registers and spills)."""
    import fagen
    from triton.backends.compiler import GPUTarget

    import gpu_mods_bwd_s9 as s9
    from fagen.runtime.loader import load_source

    use(SPIN)
    flipped = fagen.generate(spec_())
    use(None)
    lever = s9.lever_source(spec_(), {"bwd_window": SPIN})
    check(flipped == lever, "the flip's render is the s17 lever render (spin), text equal")
    use(PDL)
    pdl = fagen.generate(spec_())
    use(None)
    use(PRODUCT)
    prod = fagen.generate(spec_())
    use(None)
    print(f"CHECK INFO this tree's window render is the pdl render (the flip): {fagen.generate(spec_()) == pdl}")
    for name, src in (("prod", prod), ("spin", flipped), ("pdl", pdl)):
        mod = load_source(src, f"{spec_().name}_s18_{name}")
        t0 = time.perf_counter()
        k = mod.compile_backward_for(GPUTarget("cuda", 90, 128), seq_q=8192, seq_k=8192)
        meta = getattr(k, "metadata", None)
        print(f"{name}: mode {mod.BWD_DET_MODE}, chain {mod.BWD_WIN_CHAIN}, built sm_90 in "
              f"{time.perf_counter() - t0:.1f} s; shared {getattr(meta, 'shared', '?')}", flush=True)
    return 1 if FAILS else 0


# ---------------------------------------------------------------- GPU phases
def torch_saved(tensors, window=WIN):
    import gpu_window_s17 as s17

    return s17.torch_saved(tensors, window)


def phase_check(name="spin", cases=((333, 37, None), (1000, 130, None))):
    """A lever module against float64 (None: the persistent grid; 4: a grid of 4 programs, several waves each), three
    calls each, repeatable, row 0's dq == 0; pdl also bit for bit spin's (the same sums, the same conversion)."""
    import torch

    import gpu_window_s12 as s12

    mod = spin_module(PDL if name == "pdl" else SPIN)
    base = spin_module() if name == "pdl" else None
    assert mod.BWD_DET_MODE == 0 and mod.BWD_WIN_CHAIN == 2 and mod.BWD_WIN_PDL == (name == "pdl")
    for n, left, sms in cases:
        t0 = time.perf_counter()
        t = s12.small(s=n)
        i, j = torch.arange(n, device="cuda")[:, None], torch.arange(n, device="cuda")[None, :]
        ref = s12.ref64(*t, (j <= i) & (i - j <= left))
        saved = torch_saved(t, (left, 0))
        q, k, v, do = t
        keep = dict(mod._NUM_SMS)
        try:
            if sms:
                mod._NUM_SMS[q.get_device()] = sms
            runs = [[g.clone() for g in mod.backward(do, q, k, v, *saved, window=(left, 0))] for _ in "abc"]
            torch.cuda.synchronize()
        finally:
            mod._NUM_SMS.clear()
            mod._NUM_SMS.update(keep)
        e = max(max(s12.errs(r, ref)) for r in runs)
        rep = all(s12.same(runs[0], r) for r in runs[1:])
        zero = all(bool((r[0][:, :, 0] == 0).all()) for r in runs)
        eq = "-" if base is None else s12.diff(runs[0], [g.clone() for g in base.backward(do, q, k, v, *saved,
                                                                                            window=(left, 0))])
        check(e < 3e-2 and rep and zero and eq in ("-", "bitwise"),
              f"{name} window ({left}, 0) S{n} {'grid ' + str(sms) if sms else 'persistent'}: max |err| {e:.2e}; "
              f"repeatable {rep}; row 0 dq == 0 {zero}; vs spin {eq} ({time.perf_counter() - t0:.1f} s)")


def phase_warm(name):
    """Compile (and check) one variant at the timed shape beside the others; `prod` the fixed-point module's modes 2
    and 1, `fwd` the Gluon forward the suite's no-gradient call takes, `pdl` also its checks."""
    import torch

    import gpu_window_s12 as s12
    import gpu_mods_bwd_s9 as s9

    t0 = time.perf_counter()
    q, k, v, do = s12.window_inputs()
    t = [x.detach() for x in (q, k, v, do)]
    if name == "flex":
        sm, mm = s9.row_mods(SW, s9.shape_of())
        out = s9.flex_call(sm, mm, s9.shape_of())(q, k, v)
        torch.autograd.grad(out, (q, k, v), do)
    elif name == "fwd":  # the suite's forward without a gradient (the Gluon forward module)
        import fagen

        sm, mm = s9.row_mods(SW, s9.shape_of())
        with torch.no_grad():
            fagen.attention(q, k, v, mask_mod=mm, block_mask=s9.fagen_mask(mm, s9.shape_of()))
    elif name == "prod":  # the fixed-point module: its forward, modes 2 and 1
        mod = spin_module(PRODUCT)
        saved = mod.forward(*t[:3], window=WIN)
        for det in (True, False):
            mod.backward(t[3], *t[:3], *saved, window=WIN, deterministic=det)
    elif name == "spin":  # the spin module's backward at the timed shape (float32 torch's out, lse)
        spin_module().backward(t[3], *t[:3], *torch_saved(t), window=WIN)
    elif name == "pdl":  # the pdl module (this tree's window render): timed shape, modes 0 and 1, then its checks
        mod = spin_module(PDL)
        saved = torch_saved(t)
        a, b = ([g.clone() for g in mod.backward(t[3], *t[:3], *saved, window=WIN)] for _ in "ab")
        torch.cuda.synchronize()
        check(s12.same(a, b), f"pdl timed shape repeatable ({time.perf_counter() - t0:.1f} s)")
        phase_check("pdl", ((1000, 130, None), (1000, 130, 4)))
        torch.cuda.synchronize()
        print(f"warm pdl checked: {time.perf_counter() - t0:.1f} s", flush=True)  # the gate: its checks ran
        mod.backward(t[3], *t[:3], *saved, window=WIN, deterministic=False)  # mode 1's kernel (def-u)
        graph_check(mod)
    torch.cuda.synchronize()
    print(f"warm {name}: {time.perf_counter() - t0:.1f} s", flush=True)


def graph_check(mod, n=1000, left=130):
    """The pdl module's backward captured in a CUDA graph (its conversion a programmatic dependent in the graph):
    two replays bit for bit the eager call; and mode 1 (deterministic=False) of the same render against float64."""
    import torch

    import gpu_window_s12 as s12

    t = s12.small(s=n)
    q, k, v, do = t
    saved = torch_saved(t, (left, 0))
    try:
        eager = [g.clone() for g in mod.backward(do, q, k, v, *saved, window=(left, 0))]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            mod.backward(do, q, k, v, *saved, window=(left, 0))
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = mod.backward(do, q, k, v, *saved, window=(left, 0))
        reps = []
        for _ in "ab":
            graph.replay()
            torch.cuda.synchronize()
            reps.append([g.clone() for g in outs])
        d = [s12.diff(r, eager) for r in reps]
        check(all(x == "bitwise" for x in d), f"graph: pdl backward captured, two replays vs eager: {d}")
    except Exception as e:  # noqa: BLE001
        check(False, f"graph: pdl backward captured: {type(e).__name__}: {str(e)[:160]}")
    i, j = torch.arange(n, device="cuda")[:, None], torch.arange(n, device="cuda")[None, :]
    ref = s12.ref64(*t, (j <= i) & (i - j <= left))
    got = mod.backward(do, q, k, v, *saved, window=(left, 0), deterministic=False)
    e = max(s12.errs(got, ref))
    check(e < 3e-2, f"graph: pdl deterministic=False window ({left}, 0) S{n}: max |err| {e:.2e}")


def api_call(keys, tensors, det=True):
    """The suite's fagen side under variant bwd_window = keys (None: this tree's own): (grad step, out, the module
    resolved); det=False: fagen.attention(deterministic=False)."""
    import torch

    import fagen
    import gpu_mods_bwd_s9 as s9
    from fagen.runtime import resolve

    q, k, v, do = tensors
    sm, mm = s9.row_mods(SW, s9.shape_of())
    bm = s9.fagen_mask(mm, s9.shape_of())
    use(keys)
    try:
        with torch.no_grad():
            fagen.attention(q, k, v, mask_mod=mm, block_mask=bm)
        out = fagen.attention(q, k, v, mask_mod=mm, block_mask=bm, deterministic=det)
        mods = [m for m in resolve._FAST.values() if hasattr(m, "BWD_WIN_CHAIN")]
        step = lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)  # noqa: E731
        step()
    finally:
        use(None)
    return step, out, (mods[0] if mods else None)


def kernels(fn, n=5):
    """Every CUDA kernel of fn() by torch.profiler: [(name, ms a call)], and their sum."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    per = {}
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if t:
            per[e.key] = per.get(e.key, 0.0) + t / 1e3 / n
    return sorted(per.items(), key=lambda x: -x[1])


def host_us(fn, calls=20):
    """Host us a call while the GPU is kept busy (torch.cuda._sleep), and whether it was still busy at the end."""
    import torch

    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(1.5e9 * 0.05))  # ~50 ms of spinning at ~1.5-2 GHz
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    ev = torch.cuda.Event()
    ev.record()
    busy = not ev.query()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6, busy


def phase_main():
    """Round B: interleaved passes through fagen.attention: prod (fixed-point), spin, pdl, def (this tree's own),
    their deterministic=False calls (prod-u, def-u) and Flex; kernels; then the suite's row function (mod_rows)
    under the fixed-point render and this tree's own (the flip), alternating, as long as time is left."""
    import torch

    import gpu_window_s12 as s12
    import gpu_mods_bwd_s9 as s9
    from fagen.bench.mods import ModsShape, mod_rows
    from fagen.bench.timing import measure

    t_end = float(os.environ.get("S18_END", time.time() + 40))
    dev = torch.device("cuda")
    tensors = s12.window_inputs()
    q, k, v, do = tensors
    pdl = os.environ.get("S18_PDL") == "1"  # the pdl child passed its checks
    use(None)
    print(f"CHECK INFO this tree's variant bwd_window: {_DEFAULT[0]} (the pdl keys: {_DEFAULT[0] == PDL})", flush=True)
    steps, outs, mods = {}, {}, {}
    plan = [("api-prod", PRODUCT, True), ("api-spin", SPIN, True), ("api-prod-u", PRODUCT, False)]
    if pdl:
        plan += [("api-pdl", PDL, True), ("api-def", None, True), ("api-def-u", None, False)]
    for name, keys, det in plan:
        steps[name], outs[name], mods[name] = api_call(keys, tensors, det)
        m = mods[name]
        print(f"FLIP-PATH {name}: BWD_DET_MODE {getattr(m, 'BWD_DET_MODE', None)}, BWD_WIN_CHAIN "
              f"{getattr(m, 'BWD_WIN_CHAIN', None)}, BWD_WIN_PDL {getattr(m, 'BWD_WIN_PDL', None)}", flush=True)
    sm, mm = s9.row_mods(SW, s9.shape_of())
    fout = s9.flex_call(sm, mm, s9.shape_of())(q, k, v)
    steps["flex"] = lambda: torch.autograd.grad(fout, (q, k, v), do, retain_graph=True)
    # checks at the timed shape: spin and pdl bit for bit, repeatable; this tree's own is pdl
    g = {n: [x.clone() for x in steps[n]()] for n in steps if n != "flex"}
    again = {n: [x.clone() for x in steps[n]()] for n in ("api-spin", "api-pdl", "api-def") if n in steps}
    torch.cuda.synchronize()
    for n, r in again.items():
        check(s12.same(g[n], r), f"timed shape: {n} bitwise repeatable")
    if pdl:
        check(s12.same(g["api-pdl"], g["api-spin"]), f"timed shape: api-pdl vs api-spin {s12.diff(g['api-pdl'], g['api-spin'])}")
        print(f"CHECK INFO timed shape: fagen.attention's own window render is pdl: "
              f"{getattr(mods['api-def'], 'BWD_WIN_PDL', None) == 1}", flush=True)
        dd = max(float((a.float() - b.float()).abs().max()) for a, b in zip(g["api-def-u"], g["api-prod-u"]))
        check(dd < 3e-2, f"timed shape: def-u vs prod-u (deterministic=False) max |diff| {dd:.2e}")
    dd = max(float((a.float() - b.float()).abs().max()) for a, b in zip(g["api-spin"], g["api-prod"]))
    check(dd < 3e-2, f"timed shape: api-spin vs api-prod max |diff| {dd:.2e}")
    del g, again
    names = ["api-prod", "api-spin", *(["api-pdl", "api-def"] if pdl else []), "flex", "api-prod-u",
             *(["api-def-u"] if pdl else [])]
    rng = random.Random(18)
    for p in range(8):
        if time.time() > t_end - 8:
            break
        order = names[:]
        rng.shuffle(order)
        for n in order:
            ms = measure(lambda i, s=steps[n]: s(), 1, dev, 4.0, 16.0)
            print("REC " + json.dumps({"variant": n, "pass": p, "ms": ms}), flush=True)
    for n in ("api-prod", "api-spin", *(["api-def"] if pdl else []), "api-prod-u", *(["api-def-u"] if pdl else [])):
        if time.time() > t_end - 5:
            break
        ks = kernels(steps[n])
        print("KERNELS " + json.dumps({"variant": n, "sum": round(sum(t for _, t in ks), 4),
                                       "k": [(a[:24], round(t, 4)) for a, t in ks]}), flush=True)
    # the suite's own row function, fixed-point render against this tree's own, alternating (Flex off)
    shape = ModsShape()
    for rnd, (name, keys) in enumerate((("suite-prod", PRODUCT), ("suite-def", None)) * 2):
        if time.time() > t_end - 3.5 or (keys is None and not pdl):
            break
        use(keys)
        try:
            row = mod_rows("cuda", shape, log=lambda s: None, flex=False, only={SW}, rounds=3)[0]
        finally:
            use(None)
        f = row.get("fagen", {})
        print("SUITE " + json.dumps({"variant": name, "bwd_ms": f.get("bwd_ms"), "rounds_ms": f.get("bwd_rounds_ms"),
                                     "fwd_ms": f.get("fwd_ms"), "lowered": row.get("lowered_to"),
                                     "error": row.get("error")}), flush=True)


def summary(lines):
    recs = [json.loads(x[4:]) for x in lines if x.startswith("REC ") and '"ms"' in x]
    by, per = {}, {}
    for r in recs:
        by.setdefault(r["variant"], []).append(r["ms"])
        per.setdefault(r["pass"], {})[r["variant"]] = r["ms"]

    def q(xs):
        xs = sorted(xs)
        return xs[len(xs) // 4], xs[len(xs) // 2], xs[(3 * len(xs)) // 4]
    out = ["", "| variant | median ms | x Flex | quartiles | passes |", "|---|---:|---:|---|---:|"]
    flex = q(by["flex"])[1] if "flex" in by else None
    for n, xs in by.items():
        lo, med, hi = q(xs)
        out.append(f"| {n} | {med:.4f} | {f'{flex / med:.3f}x' if flex else ''} | {lo:.4f}..{hi:.4f} | {len(xs)} |")
    out += ["", "| ratio (per pass) | median | quartiles | n |", "|---|---:|---|---:|"]
    for a, b in (("api-spin", "api-prod"), ("api-pdl", "api-spin"), ("api-pdl", "api-prod"), ("api-def", "api-prod"),
                 ("api-def", "api-pdl"), ("api-prod", "flex"), ("api-spin", "flex"), ("api-pdl", "flex"),
                 ("api-def", "flex"), ("api-def-u", "api-prod-u"), ("api-prod-u", "flex"), ("api-def-u", "flex")):
        rs = [v[a] / v[b] for v in per.values() if a in v and b in v]
        if rs:
            lo, med, hi = q(rs)
            out.append(f"| {a} / {b} | {med:.3f} | {lo:.3f}..{hi:.3f} | {len(rs)} |")
    return out


def main():
    import _phases

    if "--dry-run" in sys.argv:
        sys.exit(dry_run())
    t0 = time.time()
    env = _phases.child_env("/tmp/s18-window-cache", ROOT)  # the caches are bulky: out of $OUT
    env.setdefault("TRITON_CACHE_DIR", "/tmp/s18-window-triton")
    import threading

    lines, results = [], {}

    def run(name, limit):
        rc, ls = _phases.run_phase(__file__, name, limit, env,  # the passes' lines go to $OUT only
                                   on_line=lambda s: None if s.startswith("REC {\"variant\": \"", 0) and '"pass"' in s
                                   else print(s, end="", flush=True))
        results[name] = rc
        lines.extend(ls)
    # warm children and the small-shape checks at once (other cache entries: the checks' kernels specialise on
    # other sequence lengths), then the main phase alone on the GPU
    warm = [threading.Thread(target=run, args=(n, 28.0))
            for n in ("warm-prod", "warm-fwd", "warm-spin", "warm-flex", "warm-pdl")]
    for th in warm:
        th.start()
    for th in warm:
        th.join()
    pdl_ok = any(x.startswith("warm pdl checked") for x in lines) and not any(x.startswith("CHECK FAIL pdl")
                                                                              for x in lines)
    env["S18_PDL"] = "1" if pdl_ok else "0"  # a pdl that hung or failed is not timed
    env["S18_END"] = str(t0 + BUDGET - 1)
    run("main", BUDGET - (time.time() - t0))
    lines.append(f"phases: {results}; {time.time() - t0:.1f} s\n")
    print(lines[-1], end="", flush=True)
    table = summary(lines)
    print("\n".join(table), flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "window-s18.txt"), "w") as f:
            f.write("".join(lines) + "\n".join(table) + "\n")
    fails = [x for x in lines if x.startswith("CHECK FAIL")]
    sys.exit(1 if fails or results.get("main") != 0 else 0)  # a slow warm child is not a failed check


if __name__ == "__main__":
    if "--phase" in sys.argv:
        name = sys.argv[sys.argv.index("--phase") + 1]
        if name.startswith("warm-"):
            phase_warm(name[5:])
        elif name == "check":
            phase_check()
        else:
            phase_main()
        sys.exit(1 if FAILS else 0)
    main()
