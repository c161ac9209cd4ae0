"""Issue 26, seventeenth session (helper window): the sliding-window row's deterministic backward (causal + window
(1024, 0), B1 H16 S8192 d128 bf16) as the fixed-order chain (mode 0) walking its query blocks down, on the unordered
kernel's levers (variant bwd_window_chain 1, bwd_window_desc 1), and with each query block's first adder storing its
partial so the accumulator's fill goes (bwd_window_chain 2); bwd_window_pending 0 (the publish after this step's adds
complete). docs/mods.md "The window's backward (seventeenth session)"; [Note] Window chain in
fagen/templates/gluon/backward.py.j2.

    PYTHONPATH=$PWD python3 scripts/gpu_window_s17.py [--round b]

Phases (scripts/_phases.py), warm children at once, one module each (a hang costs that child only): flex; prod (the
product module, modes 2 and 1, at the timed shape); chain, store, p0 (a lever module's deterministic backward at the
timed shape on (out, lse) from float32 torch, then its checks: float64 at B1 H2 S333 / S1000, windows (37, 0) and
(130, 0), three calls each, repeatable bit for bit, row 0's dq exactly 0, on the persistent grid and on 4 programs
(several waves a program); chain also the mutant: the chain module with the fill skipped (its host's BWD_WIN_CHAIN
set to 2, the kernel still adding at turn 0) must fail); store-u (the store render's deterministic=False, which a
flip would also take: float64 at S1000). Then one timing child: every fagen variant through the module's backward()
on the product's (out, lse), the product also through autograd (own, the row's path), Flex, in rotated passes
(do_bench medians, L2 flushed), the per-pass ratios, the levers' gradients compared at the timed shape (store and p0
bit for bit the chain's); the kernels by torch.profiler. The table goes to stdout and $OUTX/table.txt.
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
import gpu_window_s12 as s12  # noqa: E402  (small, grads, ref64, errs, same, diff, check, kernel_ms, window_inputs)

BUDGET = 57.0
ROUND_B = sys.argv[1:3] == ["--round", "b"] or os.environ.get("S17_ROUND") == "b"
SW = "sliding-window+causal"
WIN = (1024, 0)
LEVERS = {"chain": {"bwd_window_desc": 1, "bwd_window_chain": 1},
          "store": {"bwd_window_desc": 1, "bwd_window_chain": 2},
          "p0": {"bwd_window_desc": 1, "bwd_window_chain": 2, "bwd_window_pending": 0},
          "relax": {"bwd_window_desc": 1, "bwd_window_chain": 2, "bwd_window_pending": 0, "bwd_window_relaxed": 1},
          "spin": {"bwd_window_desc": 1, "bwd_window_chain": 2, "bwd_window_pending": 0, "bwd_window_relaxed": 2}}
WARM = ["flex", "prod", "chain", "store", "p0", "store-u"]
PRODUCT = {"bwd_window_fixed": 1, "bwd_fixed_tma": 1}  # main's variant bwd_window
# round B (after round A: the chain lost, store lost 3%, p0 tied the product): p0 again, relax (p0 with the turn
# polled by relaxed loads) and spin (the same polls in one asm loop) new; no flip. The grid-4 checks in a child of
# their own (round A's lever children were killed at 26 s during or after their first small check).
B_LEVERS, B_FLIP = ["p0", "relax", "spin"], ""
if ROUND_B:
    LEVERS = {k: LEVERS[k] for k in (*B_LEVERS, "store")}
    WARM = ["flex", "prod", *B_LEVERS, "store-u", "grid4"]
FLIP = os.environ.get("S17_FLIP", B_FLIP if ROUND_B else "")  # a lever's keys as variant bwd_window: "api" runs it
_MOD: dict = {}


def flip():
    """S17_FLIP: the lever's keys as this process's variant bwd_window (what the flip commit would set), so that
    fagen.attention's window backward ("api") runs the lever's render; the product then renders from PRODUCT."""
    if FLIP:
        from fagen import backends
        from fagen.codegen import render

        backends.GLUON.variant["bwd_window"] = dict(LEVERS[FLIP])
        render.render.cache_clear()


def spec_():
    from fagen.spec.kernel import KernelSpec

    return KernelSpec(backend="gluon", direction="bwd", head_dim=128, dtype="bf16", mask="causal", window=True)


def module(name):
    """The product module ("prod") or a lever's render (LEVERS: the keys of variant bwd_window for this render)."""
    if name not in _MOD:
        import fagen
        from fagen.runtime.loader import load_source

        if name == "prod" and FLIP:
            mod = load_source(s9.lever_source(spec_(), {"bwd_window": PRODUCT}), f"{spec_().name}_s17_prod")
            assert mod.BWD_DET_MODE == 2 and mod.BWD_WIN_CHAIN == 0
        elif name == "prod":
            mod = fagen.load(spec_())
            assert mod.BWD_DET_MODE == 2 and mod.BWD_WIN_CHAIN == 0
        else:
            src = s9.lever_source(spec_(), {"bwd_window": LEVERS[name]})
            mod = load_source(src, f"{spec_().name}_s17_{name}")
            assert mod.BWD_DET_MODE == 0 and mod.BWD_WIN_CHAIN == (1 if name == "chain" else 2), name
            assert "GQA * steps - 1 - i" in src
            assert ("_bwd_publish(sem, m0, 0)" in src) == (name in ("p0", "relax", "spin")), name
            assert ('sem="relaxed"' in src) == (name == "relax") and ("_bwd_spin(sem, turn)" in src) == (name == "spin")
        _MOD[name] = mod
    return _MOD[name]


def bwd_step(mod, tensors, saved, det=True, window=WIN):
    q, k, v, do = tensors
    out, lse = saved
    return lambda: mod.backward(do, q, k, v, out, lse, window=window, deterministic=det)


def fwd_saved(tensors, window=WIN):
    q, k, v, _ = tensors
    return module("prod").forward(q, k, v, window=window)


def torch_saved(tensors, window=WIN):
    """(out, lse) by float32 torch (the lever children compile no forward), per head to bound the memory."""
    import torch

    q, k, v, _ = tensors
    sq, sk = q.shape[2], k.shape[2]
    i, j = torch.arange(sq, device=q.device)[:, None] + sk - sq, torch.arange(sk, device=q.device)[None, :]
    hide = (j > i + min(window[1], 0)) | (j < i - window[0])
    out, lse = torch.empty_like(q), torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            s_ = (q[b, h].float() @ k[b, h].float().T) * q.shape[-1] ** -0.5
            s_.masked_fill_(hide, float("-inf"))
            lse[b, h] = torch.logsumexp(s_, -1)
            out[b, h] = (torch.softmax(s_, -1) @ v[b, h].float()).to(q.dtype)
    return out, lse


def detached(tensors):
    return [t.detach() for t in tensors]


def check_small(name, grids=(None, 4)):
    """float64, repeatable, row 0's dq == 0, on the persistent grid and on 4 programs; store/p0 bit for bit chain's
    (mutant: the chain module with the fill skipped must fail)."""
    import torch

    mut = name == "mutant"
    mod = module("chain" if mut else name)
    base = None  # store vs chain: bit for bit at the timed shape (compare() in the timing child)
    for n in ((333, ) if mut else (333, 1000)):
        t = s12.small(s=n)
        i, j = torch.arange(n, device="cuda")[:, None], torch.arange(n, device="cuda")[None, :]
        for left in (37, 130):
            for sms in ((None, ) if mut else grids):
                def run(left=left, sms=sms, t=t):
                    ref = s12.ref64(*t, (j <= i) & (i - j <= left))
                    saved = torch_saved(t, (left, 0))
                    dev = t[0].get_device()
                    keep = mod._NUM_SMS.get(dev)
                    store = mod.BWD_WIN_CHAIN
                    try:
                        if sms:
                            mod._NUM_SMS[dev] = sms  # the persistent grid of 4 programs: several waves each
                        if mut:
                            mod.BWD_WIN_CHAIN = 2  # the host skips the fill; the kernel still adds at turn 0
                        runs = [[g.clone() for g in bwd_step(mod, t, saved, window=(left, 0))()] for _ in "abc"]
                        other = None
                        if base is not None:
                            if sms:
                                base._NUM_SMS[dev] = sms
                            other = [g.clone() for g in bwd_step(base, t, saved, window=(left, 0))()]
                    finally:
                        mod.BWD_WIN_CHAIN = store
                        for m in (mod, base):
                            if m is not None:
                                if keep is None:
                                    m._NUM_SMS.pop(dev, None)
                                else:
                                    m._NUM_SMS[dev] = keep
                    if mut:  # caught: a call's gradients outside the float64 tolerance
                        try:
                            e = max(max(s12.errs(r, ref)) for r in runs)
                        except Exception as x:  # noqa: BLE001 - PropertyFailure: what the mutant must cause
                            return True, f"caught: {str(x)[:160]}"
                        return e >= 3e-2, f"max |err| over three calls {e:.2e}"
                    e = max(max(s12.errs(r, ref)) for r in runs)
                    rep = all(s12.same(runs[0], r) for r in runs[1:])
                    zero = all(bool((r[0][:, :, 0] == 0).all()) for r in runs)
                    eq = "-" if other is None else s12.diff(runs[0], other)
                    ok = e < 3e-2 and rep and zero and eq in ("-", "bitwise")
                    return ok, f"max |err| {e:.2e}; repeatable {rep}; row 0 dq == 0 {zero}; vs chain: {eq}"
                s12.check(f"{name} window ({left}, 0) S{n} {'grid ' + str(sms) if sms else 'persistent'}", run)


def check_one(name, n, left, sms):
    """One float64 check of a lever module at S n, window (left, 0), on a grid of `sms` programs (three calls)."""
    import torch

    mod = module(name)
    t = s12.small(s=n)
    i, j = torch.arange(n, device="cuda")[:, None], torch.arange(n, device="cuda")[None, :]

    def run():
        ref = s12.ref64(*t, (j <= i) & (i - j <= left))
        saved = torch_saved(t, (left, 0))
        dev = t[0].get_device()
        keep = mod._NUM_SMS.get(dev)
        mod._NUM_SMS[dev] = sms
        try:
            runs = []
            for _ in "abc":
                t1 = time.perf_counter()
                runs.append([g.clone() for g in bwd_step(mod, t, saved, window=(left, 0))()])
                torch.cuda.synchronize()
                print(f"CHECK INFO {name} grid {sms} S{n} call {len(runs)}: {time.perf_counter() - t1:.2f} s",
                      flush=True)
        finally:
            if keep is None:
                mod._NUM_SMS.pop(dev, None)
            else:
                mod._NUM_SMS[dev] = keep
        e = max(max(s12.errs(r, ref)) for r in runs)
        rep = all(s12.same(runs[0], r) for r in runs[1:])
        zero = all(bool((r[0][:, :, 0] == 0).all()) for r in runs)
        return e < 3e-2 and rep and zero, f"max |err| {e:.2e}; repeatable {rep}; row 0 dq == 0 {zero}"
    s12.check(f"{name} window ({left}, 0) S{n} grid {sms}", run)


def phase_warm(name):
    import torch

    flip()
    t0 = time.perf_counter()
    try:
        tensors = detached(s12.window_inputs())
        if name == "flex":
            q, k, v, do = s12.window_inputs()
            sm, mm = s9.row_mods(SW, s9.shape_of())
            out = s9.flex_call(sm, mm, s9.shape_of())(q, k, v)
            torch.autograd.grad(out, (q, k, v), do)
        elif name == "prod":
            saved = fwd_saved(tensors)
            a = [g.clone() for g in bwd_step(module("prod"), tensors, saved)()]
            b = [g.clone() for g in bwd_step(module("prod"), tensors, saved, det=False)()]
            torch.cuda.synchronize()
            print(f"CHECK INFO timed shape, product mode 2 vs mode 1: {s12.diff(a, b)}", flush=True)
            print(f"CHECK INFO prod main kernels (regs, spills): {regs(module('prod'), 2)} / {regs(module('prod'), 1)}",
                  flush=True)
        elif name == "grid4":  # the spin module on a grid of 4 programs (several waves a program), S1000 first
            for n_, left_ in ((1000, 130), (333, 37)):
                check_one("spin", n_, left_, 4)
        elif name == "store-u":  # the store render's deterministic=False (a flip would take it too): desc steps
            saved = torch_saved(tensors)
            bwd_step(module("store"), tensors, saved, det=False)()
            torch.cuda.synchronize()
            print(f"timed shape, {name} ok", flush=True)
            t = s12.small(s=1000)
            i, j = torch.arange(1000, device="cuda")[:, None], torch.arange(1000, device="cuda")[None, :]
            for left in (37, 130):
                def run(left=left):
                    ref = s12.ref64(*t, (j <= i) & (i - j <= left))
                    got = bwd_step(module("store"), t, torch_saved(t, (left, 0)), det=False, window=(left, 0))()
                    e = max(s12.errs(got, ref))
                    return e < 3e-2, f"max |err| {e:.2e}"
                s12.check(f"store-u window ({left}, 0) S1000 unordered", run)
        else:
            saved = torch_saved(tensors)
            got = [g.clone() for g in bwd_step(module(name), tensors, saved)()]
            again = [g.clone() for g in bwd_step(module(name), tensors, saved)()]
            torch.cuda.synchronize()
            print(f"warm {name} compiled: {time.perf_counter() - t0:.1f} s", flush=True)
            print(f"CHECK INFO timed shape, {name}: repeat {s12.diff(got, again)}; regs {regs(module(name), 0)}",
                  flush=True)
            print(f"timed shape, {name} ok", flush=True)
            check_small(name, (None, ) if ROUND_B else (None, 4))
            if name == "chain":
                check_small("mutant")
        torch.cuda.synchronize()
        print(f"warm {name}: {time.perf_counter() - t0:.1f} s", flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"warm {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)


def regs(mod, mode):
    out = []
    try:
        for cache in mod._BWD_KERNELS[mode][0].device_caches.values():
            for k in cache[0].values():
                k._init_handles()
                out.append((k.n_regs, k.n_spills))
    except Exception as e:  # noqa: BLE001
        out.append(f"{type(e).__name__}")
    return out


def step_of(variant, tensors, saved):
    import torch

    if variant == "flex":
        q, k, v, do = s12.window_inputs()
        sm, mm = s9.row_mods(SW, s9.shape_of())
        out = s9.flex_call(sm, mm, s9.shape_of())(q, k, v)
        return lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
    if variant == "own":  # the product's module through autograd (the row's path, as the earlier sessions timed it)
        q, k, v, do = s12.window_inputs()
        out = module("prod").attention(q, k, v, window=WIN)
        return lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
    if variant == "api":  # fagen.attention on the bench's mask_mod (the row's path; S17_FLIP: the lever's render)
        import fagen

        q, k, v, do = s12.window_inputs()
        sm, mm = s9.row_mods(SW, s9.shape_of())
        s9.selection(True)
        out = fagen.attention(q, k, v, mask_mod=mm, block_mask=s9.fagen_mask(mm, s9.shape_of()), deterministic=True)
        return lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
    if variant == "prod-u":
        return bwd_step(module("prod"), tensors, saved, det=False)
    if variant == "store-u":
        return bwd_step(module("store"), tensors, saved, det=False)
    return bwd_step(module(variant), tensors, saved)


def phase_time():
    import torch

    from fagen.bench.timing import measure

    flip()
    t_end = float(os.environ.get("S17_TIME_END", time.time() + 40))
    tensors = detached(s12.window_inputs())
    saved = fwd_saved(tensors)
    levers = os.environ.get("S17_LEVERS", "").split()  # levers whose warm call passed
    names = ["prod", "prod-u", *levers, "own", *(["api"] if FLIP else []), "flex"]
    steps = {}

    def profile(rnd):
        for item in (["prod", "prod-u", *levers] if rnd % 2 == 0 else [*levers[::-1], "prod-u", "prod"]):
            if time.time() > t_end - 1.5 or item not in steps:
                continue
            try:
                ms, top = s12.kernel_ms(steps[item], n=5)
                print("REC " + json.dumps({"variant": item, "round": rnd, "kernel_ms": ms, "top": top}), flush=True)
            except Exception as e:  # noqa: BLE001
                print("REC " + json.dumps({"variant": item, "error": f"kernels {type(e).__name__}: {e}"[:200]}))

    for p in range(16):
        # three passes without Flex (its compile in this child takes a while), then with it; rotated, every other
        # pass reversed
        names_p = names if p >= 3 else names[:-1]
        order = names_p[p % len(names_p):] + names_p[:p % len(names_p)]
        if p % 2:
            order = order[::-1]
        for item in order:
            rec = {"variant": item, "pass": p}
            if time.time() > t_end - (3 if p < 3 else 5):
                continue
            try:
                if item not in steps:
                    steps[item] = step_of(item, tensors, saved)
                step = steps[item]
                step()
                rec["ms"] = measure(lambda i: step(), 1, torch.device("cuda"), 10.0, 25.0)
            except Exception as e:  # noqa: BLE001
                rec["error"] = f"{type(e).__name__}: {str(e)[:160]}"
            print("REC " + json.dumps(rec), flush=True)
        if p == 0:
            profile(0)
            compare(steps)
    profile(1)


def compare(steps):
    """The levers' gradients at the timed shape: store and p0 bit for bit the chain's (the same float32 sums, the
    first partial stored instead of added onto zero); the chain's dq against the product's (mode 2) and mode 1."""
    import torch

    got = {}
    for item in ("chain", "store", "p0", "relax", "spin", "prod", "prod-u"):
        if item in steps:
            got[item] = [g.clone() for g in steps[item]()]
    torch.cuda.synchronize()
    for a, b in (("store", "chain"), ("p0", "chain"), ("relax", "p0"), ("spin", "p0"), ("chain", "prod"),
                 ("chain", "prod-u"),
                 ("p0", "prod")):
        if a in got and b in got:
            print(f"CHECK INFO timed shape, {a} vs {b}: {s12.diff(got[a], got[b])}", flush=True)


PAIRS = (("chain", "prod"), ("store", "prod"), ("p0", "prod"), ("store", "chain"), ("p0", "store"),
         ("chain", "prod-u"), ("store", "prod-u"), ("store-u", "prod-u"), ("prod", "own"), ("own", "flex"),
         ("prod", "flex"), ("prod-u", "flex"), ("chain", "flex"), ("store", "flex"), ("p0", "flex"),
         ("store-u", "flex"), ("api", "own"), ("api", "flex"), ("relax", "prod"), ("relax", "p0"),
         ("relax", "flex"), ("relax", "prod-u"), ("spin", "prod"), ("spin", "p0"), ("spin", "relax"), ("spin", "flex"),
         ("spin", "prod-u"))


def summary(recs):
    out = []
    by, per_pass = {}, {}
    for r in recs:
        if r.get("error"):
            out.append(f"ERROR {r['variant']}: {r['error']}")
        elif "ms" in r:
            by.setdefault(r["variant"], []).append(r["ms"])
            per_pass.setdefault(r["pass"], {})[r["variant"]] = r["ms"]
    med = {k: sorted(v)[len(v) // 2] for k, v in by.items()}
    flex = med.get("flex")
    out += ["", "| variant | median ms | x Flex | each pass |", "|---|---:|---:|---|"]
    for k, v in by.items():
        x = f"{flex / med[k]:.3f}x" if flex else ""
        out.append(f"| {k} | {med[k]:.4f} | {x} | {' / '.join(f'{m:.4f}' for m in v)} |")
    for a, b in PAIRS:
        rs = sorted(p[a] / p[b] for p in per_pass.values() if a in p and b in p)
        if rs:
            out.append(f"ratio {a} / {b} per pass: median {rs[len(rs) // 2]:.4f}, range {rs[0]:.4f}..{rs[-1]:.4f} "
                       f"({len(rs)} passes)")
    out += ["", "| module | round | all kernels ms | largest (ms) |", "|---|---|---:|---|"]
    for r in recs:
        if "kernel_ms" in r:
            out.append(f"| {r['variant']} | {r['round']} | {r['kernel_ms']:.4f} | {r['top']} |")
    return out


def main():
    from _phases import child_env, run_phase

    t0 = time.time()
    env = child_env("/tmp/fagen-s17-window", ROOT)
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    if ROUND_B:
        env["S17_ROUND"] = "b"
    script = os.path.abspath(__file__)
    lines: dict = {}

    def go(name, limit, extra=()):
        rc, got = run_phase(script, name, limit, env, on_line=lambda s: print(s, end="", flush=True), extra=extra)
        lines.setdefault(name + "".join(extra), []).extend(got)
        if rc != 0:
            print(f"phase {name} {extra}: {rc}", flush=True)

    threads = [threading.Thread(target=go, args=("warm", 26.0, (w, ))) for w in WARM]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ok = [n for n in (*LEVERS, "store-u") if any(f"timed shape, {n} ok" in s for s in lines.get("warm" + n, []))]
    env["S17_LEVERS"] = " ".join(ok)  # a lever whose warm call hung is not timed (a hang would take all)
    left = BUDGET - (time.time() - t0)
    env["S17_TIME_END"] = str(time.time() + left - 3)
    print(f"compiled in {time.time() - t0:.0f} s; timing for {left:.0f} s; levers timed: {ok}", flush=True)
    go("time", max(5.0, left))
    recs = [json.loads(s[4:]) for s in lines.get("time", []) if s.startswith("REC ")]
    out = summary(recs)
    out += [s[6:].rstrip("\n") for got in lines.values() for s in got if s.startswith("CHECK ")]
    out.append(f"total {time.time() - t0:.0f} s")
    print("\n".join(out), flush=True)
    if os.environ.get("OUTX"):
        os.makedirs(os.environ["OUTX"], exist_ok=True)
        with open(os.path.join(os.environ["OUTX"], "table.txt"), "w") as f:
            f.write("\n".join(out) + "\n")
        with open(os.path.join(os.environ["OUTX"], "window_s17.json"), "w") as f:
            json.dump({"records": recs, "lines": lines}, f, indent=1)


if __name__ == "__main__":
    if "--phase" in sys.argv:
        if sys.argv[sys.argv.index("--phase") + 1] == "time":
            phase_time()
        else:
            phase_warm(sys.argv[-1])
    else:
        main()
