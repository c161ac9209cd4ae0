"""Issue 26, eighteenth session (helper window): why the mods suite's sliding-window row did not see the seventeenth
session's "spin" render (variant bwd_window = chain 2, pending 0, relaxed 2: 0.4947 against 0.5311 ms through the
module's backward() in round B) when the lead flipped it. Here both renders run the suite's exact row in ONE process:

  - api-prod / api-spin: fagen.attention(q, k, v, mask_mod=generate_sliding_window(1024), block_mask=fagen's), the
    suite's inputs (fagen.bench.mods._inputs), torch.autograd.grad on a kept graph (fagen.bench.mods._parts' grad),
    the spin module resolved by the flip's own mechanism (variant["bwd_window"] set, resolve's memo cleared);
  - mod-prod / mod-spin: the module's backward() on the product's (out, lse) (round B of the seventeenth session);
  - flex: the suite's Flex call;
  - suite-prod / suite-spin: fagen.bench.mods.mod_rows itself (flex off, 3 rounds) under each variant.

  - api-pdl / mod-pdl (when its own child "warm-pdl" passed): spin with variant bwd_window_pdl 1, the dQ
    conversion as the main kernel's programmatic dependent ([Note] Window conversion overlap).

Checks first (exit 1 on a FAIL): the spin module against float64 at B1 H2 S333 window (37, 0) and S1000 (130, 0),
three calls, bitwise repeatable, row 0's dq exactly 0 (child "check"); at the timed shape which module each api
call resolved (BWD_DET_MODE, BWD_WIN_CHAIN), api-spin repeatable bit for bit, api-spin against mod-spin on the same
(out, lse) and against api-prod; pdl: repeatable at the timed shape, float64 at S1000 (130, 0) on the persistent
grid and on 4 programs, bit for bit spin's there and (api-pdl) at the timed shape. Then interleaved, shuffled passes (fagen.bench.timing.measure, L2 flushed) with
per-pass ratios, torch.profiler's kernels of every variant, and host us a call (GPU kept busy).

    PYTHONPATH=$PWD python3 scripts/gpu_window_s18.py [--round A|B]
    PYTHONPATH=$PWD python3 scripts/gpu_window_s18.py --dry-run     # CPU: both renders built for sm_90
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
BUDGET = 57.0
ROUND = (sys.argv[sys.argv.index("--round") + 1] if "--round" in sys.argv else "A").upper()
FAILS: list = []


def spec_():
    from fagen.spec.kernel import KernelSpec

    return KernelSpec(backend="gluon", direction="bwd", head_dim=128, dtype="bf16", mask="causal", window=True)


def use(keys):
    """The flip's mechanism in this process: variant bwd_window = keys, and every memo of the resolved module
    cleared (resolve's _FAST and _module, which key on the spec alone), so the next fagen.attention resolves anew."""
    from fagen import backends
    from fagen.runtime import resolve

    backends.GLUON.variant["bwd_window"] = dict(keys)
    resolve._FAST.clear()
    resolve._module.cache_clear()


def spin_module(keys=None):
    """The module of variant bwd_window = keys (default SPIN), loaded as the flip would load it."""
    import fagen

    use(keys or SPIN)
    try:
        return fagen.load(spec_())
    finally:
        use(PRODUCT)


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
    use(PRODUCT)
    lever = s9.lever_source(spec_(), {"bwd_window": SPIN})
    check(flipped == lever, "the flip's render is the s17 lever render (spin), text equal")
    use(PDL)
    pdl = fagen.generate(spec_())
    use(PRODUCT)
    for name, src in (("prod", fagen.generate(spec_())), ("spin", flipped), ("pdl", pdl)):
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
    import torch

    import gpu_window_s12 as s12
    import gpu_mods_bwd_s9 as s9

    t0 = time.perf_counter()
    q, k, v, do = s12.window_inputs()
    if name == "flex":
        sm, mm = s9.row_mods(SW, s9.shape_of())
        out = s9.flex_call(sm, mm, s9.shape_of())(q, k, v)
        torch.autograd.grad(out, (q, k, v), do)
    elif name == "prod":  # the suite's path with the product (fwd without and with a gradient, the backward)
        api_call(PRODUCT, (q, k, v, do))
    elif name == "spin":  # the spin module's backward at the timed shape (float32 torch's out, lse)
        t = [x.detach() for x in (q, k, v, do)]
        spin_module().backward(t[3], *t[:3], *torch_saved(t), window=WIN)
    elif name == "pdl":  # the pdl module at the timed shape, twice (repeatable), then float64 on 132 and 4 programs
        t = [x.detach() for x in (q, k, v, do)]
        saved = torch_saved(t)
        a, b = ([g.clone() for g in spin_module(PDL).backward(t[3], *t[:3], *saved, window=WIN)] for _ in "ab")
        torch.cuda.synchronize()
        check(s12.same(a, b), f"pdl timed shape repeatable ({time.perf_counter() - t0:.1f} s)")
        phase_check("pdl", ((1000, 130, None), (1000, 130, 4)))
    torch.cuda.synchronize()
    print(f"warm {name}: {time.perf_counter() - t0:.1f} s", flush=True)


def api_call(keys, tensors):
    """The suite's fagen side under variant bwd_window = keys: (grad step, out, the module resolved)."""
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
        out = fagen.attention(q, k, v, mask_mod=mm, block_mask=bm)
        mods = [m for m in resolve._FAST.values() if hasattr(m, "BWD_WIN_CHAIN")]
        step = lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)  # noqa: E731
        step()
    finally:
        use(PRODUCT)
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
    import torch

    import gpu_window_s12 as s12
    import gpu_mods_bwd_s9 as s9
    from fagen.bench.mods import ModsShape, mod_rows
    from fagen.bench.timing import measure

    t_end = float(os.environ.get("S18_END", time.time() + 40))
    dev = torch.device("cuda")
    tensors = s12.window_inputs()
    q, k, v, do = tensors
    steps, outs, mods = {}, {}, {}
    pdl = os.environ.get("S18_PDL") == "1"  # the pdl child passed its checks
    for name, keys in (("api-prod", PRODUCT), ("api-spin", SPIN), *((("api-pdl", PDL), ) if pdl else ())):
        steps[name], outs[name], mods[name] = api_call(keys, tensors)
        m = mods[name]
        print(f"FLIP-PATH {name}: module {getattr(m, '__name__', None)}, BWD_DET_MODE "
              f"{getattr(m, 'BWD_DET_MODE', None)}, BWD_WIN_CHAIN {getattr(m, 'BWD_WIN_CHAIN', None)}, "
              f"grad_fn {type(outs[name].grad_fn).__name__}", flush=True)
    check(getattr(mods["api-spin"], "BWD_WIN_CHAIN", None) == 2 and getattr(mods["api-prod"], "BWD_DET_MODE", None) == 2,
          "fagen.attention resolved the spin render under the flip and the product's without it")
    import fagen

    prod, spin = mods["api-prod"] or fagen.load(spec_()), mods["api-spin"] or spin_module()
    td = [t.detach() for t in tensors]
    saved = prod.forward(*td[:3], window=WIN)
    steps["mod-prod"] = lambda: prod.backward(td[3], *td[:3], *saved, window=WIN)
    steps["mod-spin"] = lambda: spin.backward(td[3], *td[:3], *saved, window=WIN)
    if pdl:
        mpdl = mods["api-pdl"] or spin_module(PDL)
        steps["mod-pdl"] = lambda: mpdl.backward(td[3], *td[:3], *saved, window=WIN)
    sm, mm = s9.row_mods(SW, s9.shape_of())
    fout = s9.flex_call(sm, mm, s9.shape_of())(q, k, v)
    steps["flex"] = lambda: torch.autograd.grad(fout, (q, k, v), do, retain_graph=True)
    # checks at the timed shape
    g = {n: [x.clone() for x in steps[n]()] for n in ("api-prod", "api-spin", "mod-prod", "mod-spin")}
    again = [x.clone() for x in steps["api-spin"]()]
    torch.cuda.synchronize()
    check(s12.same(g["api-spin"], again), "timed shape: api-spin bitwise repeatable")
    print(f"CHECK INFO timed shape: out api-spin vs api-prod {s12.diff([outs['api-spin']], [outs['api-prod']])}; "
          f"out api-prod vs module forward {s12.diff([outs['api-prod']], [saved[0]])}", flush=True)
    same_out = s12.same([outs["api-spin"]], [saved[0]])
    d = s12.diff(g["api-spin"], g["mod-spin"])
    check(d == "bitwise" or not same_out, f"timed shape: api-spin vs mod-spin (same out): {d}")
    check(s12.same(g["api-prod"], g["mod-prod"]) or not same_out, "timed shape: api-prod bitwise mod-prod")
    dd = max(float((a.float() - b.float()).abs().max()) for a, b in zip(g["api-spin"], g["api-prod"]))
    check(dd < 3e-2, f"timed shape: api-spin vs api-prod max |diff| {dd:.2e}")
    if pdl:
        gp = [x.clone() for x in steps["api-pdl"]()]
        torch.cuda.synchronize()
        check(getattr(mods["api-pdl"], "BWD_WIN_PDL", None) == 1, "fagen.attention resolved the pdl render")
        check(s12.same(gp, g["api-spin"]), f"timed shape: api-pdl vs api-spin {s12.diff(gp, g['api-spin'])}")
        del gp
    del g, again
    # the suite's own row function under each variant (flex off), alternating
    suite = {}
    shape = ModsShape()
    order = (("suite-prod", PRODUCT), ("suite-spin", SPIN), *((("suite-pdl", PDL), ) if pdl else ()))
    for rnd, (name, keys) in enumerate(order * 2):
        if time.time() > t_end - (18 if pdl else 14):
            break
        use(keys)
        try:
            row = mod_rows("cuda", shape, log=lambda s: None, flex=False, only={SW}, rounds=3)[0]
        finally:
            use(PRODUCT)
        suite.setdefault(name, []).append(row.get("fagen", {}).get("bwd_ms") or row.get("error"))
        print(f"REC {json.dumps({'variant': name, 'suite_bwd_ms': suite[name][-1], 'lowered': row.get('lowered_to'), 'rounds_ms': row.get('fagen', {}).get('bwd_rounds_ms')})}", flush=True)
    # interleaved, shuffled passes
    names = ["api-prod", "api-spin", "mod-prod", "mod-spin", "flex", *(["api-pdl", "mod-pdl"] if pdl else [])]
    rng = random.Random(18)
    recs = []
    for p in range(12):
        if time.time() > t_end - 7:
            break
        order = names[:]
        rng.shuffle(order)
        for n in order:
            ms = measure(lambda i, s=steps[n]: s(), 1, dev, 5.0, 20.0)
            recs.append({"variant": n, "pass": p, "ms": ms})
            print("REC " + json.dumps(recs[-1]), flush=True)
    # kernels and host time
    for n in ("api-prod", "api-spin", *(["api-pdl"] if pdl else []), "mod-prod", "mod-spin"):
        if time.time() > t_end - 2:
            break
        ks = kernels(steps[n])
        print("KERNELS " + json.dumps({"variant": n, "sum": round(sum(t for _, t in ks), 4),
                                       "k": [(a[:48], round(t, 4)) for a, t in ks]}), flush=True)
    for n in ("api-prod", "api-spin"):
        if time.time() > t_end - 1:
            break
        us, busy = host_us(steps[n])
        print("HOST " + json.dumps({"variant": n, "us": round(us, 1), "gpu_busy": busy}), flush=True)


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
    for a, b in (("api-spin", "api-prod"), ("mod-spin", "mod-prod"), ("api-prod", "mod-prod"),
                 ("api-spin", "mod-spin"), ("api-prod", "flex"), ("api-spin", "flex"), ("api-pdl", "api-spin"),
                 ("mod-pdl", "mod-spin"), ("api-pdl", "api-prod"), ("api-pdl", "flex")):
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
    warm = [threading.Thread(target=run, args=(n, 27.0))
            for n in ("warm-prod", "warm-spin", "warm-flex", "check", "warm-pdl")]
    for th in warm:
        th.start()
    for th in warm:
        th.join()
    pdl_ok = results.get("warm-pdl") == 0 and not any(x.startswith("CHECK FAIL pdl") for x in lines)
    env["S18_PDL"] = "1" if pdl_ok else "0"  # a pdl that hung or failed is not timed
    env["S18_END"] = str(t0 + BUDGET - 1)
    run("main", BUDGET - (time.time() - t0))
    print(f"phases: {results}; {time.time() - t0:.1f} s", flush=True)
    table = summary(lines)
    print("\n".join(table), flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "window-s18.txt"), "w") as f:
            f.write("".join(lines) + "\n".join(table) + "\n")
    fails = [x for x in lines if x.startswith("CHECK FAIL")]
    sys.exit(1 if fails or any(rc != 0 for rc in results.values()) else 0)


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
