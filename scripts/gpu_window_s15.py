"""Issue 26, fifteenth session (helper window): the sliding-window row's deterministic backward (causal + window
(1024, 0), B1 H16 S8192 d128 bf16) with dQ converted in the main kernel (variant bwd_win_conv, [Note] dQ conversion
in the main kernel in fagen/templates/gluon/backward.py.j2); docs/mods.md "The window's backward (fifteenth session)".

    PYTHONPATH=$PWD python3 scripts/gpu_window_s15.py [--round b]

Levers (variant bwd_win_conv): conv (1: the tiles' flags set by the dQ warp's generic release add; its sm_90 build
spills 17 / 14 instructions in the compute warpgroups' step loops against the product's 1 / 4) and conv2 (2: the
flags set by a TMA reduce-add; step loops the product's).
Phases (scripts/_phases.py), warm children at once: flex; window (the product); conv, conv2 (each lever's module,
then its checks: against float64 at B1 H2 S333, windows (37, 0) and (130, 0), and S1000 on 5 programs (16 tiles:
programs convert while others still add), bit for bit the product's there and at the timed shape, repeatable, row 0's
dq exactly 0); mutant (conv2 waiting for one tile fewer than a block's: must differ). Then one timing child: the
product (fagen.attention: api), the product module's own attention (own: the levers' host path without them), the
levers' modules whose warm call matched the product, Flex, in six rotated passes (do_bench medians, L2 flushed), the
per-pass ratios; then the kernels of own, conv and conv2 (torch.profiler). The table goes to stdout and
$OUTX/table.txt.
Round B (`--round b`; round A's timing child spent its time on Flex's compile and timed no lever): conv2 and conv3
(bwd_win_conv 3: conv2's flags, the tail loading block k + 1 before it stores block k), each checked S1000 on 5
programs (37, 0) and S333 (130, 0); flag2 (conv2's flags with the conversion pass: the flags'
cost, timed only); a mutant that must fail deterministically (the tail waits for no flag and tile 0's dQ warp sleeps
200 us first); the timing child times own and the levers first, profiles them, then Flex, then rotated passes.
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
ROUND_B = sys.argv[1:3] == ["--round", "b"] or os.environ.get("S15_ROUND") == "b"
SW = "sliding-window+causal"
LEVERS = {"conv": {"bwd_win_conv": 1}, "conv2": {"bwd_win_conv": 2}, "mutant": {"bwd_win_conv": 2}}
_MUT = [("want = _bwd_visits(", "want = -1 + _bwd_visits(")]
if ROUND_B:  # conv (1) spilled 42 in the compute loops and was not timed in round A: out; a mutant that must fail
    LEVERS = {"conv2": {"bwd_win_conv": 2}, "conv3": {"bwd_win_conv": 3}, "flag2": {"bwd_win_conv": 2},
              "mutant": {"bwd_win_conv": 2}}
    # the tail waits for no flag, and the dQ warp of tile 0 sleeps 200 us before its adds: block 0 (tile 0 its only
    # visitor) is converted before they land, on a program that finished its own tiles
    _MUT = [("want = _bwd_visits(", "want = 0 * _bwd_visits("),
            ("        prev = Sem + 1  # the counter of the add published one step late; a placeholder until step 1\n",
             "        prev = Sem + 1  # the counter of the add published one step late; a placeholder until step 1\n"
             "        if tile == 0:\n            for _ in range(20):\n"
             "                gl.inline_asm_elementwise(\"nanosleep.u32 10000; mov.b32 $0, $1;\", \"=r,r\", [lo], "
             "dtype=gl.int32, is_pure=False, pack=1)\n")]
# flag2 (round B): conv2's render with the main kernel's conversion taken out and the conversion pass put back (the dQ
# warp's flags alone: their cost; gradients the product's)
_COUNT = [("    if DQ_MODE == 2:  # [Note] dQ conversion in the main kernel: the default warps",
           "    if DQ_MODE == 3:  # count: no conversion here"),
          ("    if dq_mode == 2 and BWD_WIN_CONV:\n        return", "    if dq_mode == 3:\n        return")]
_LEV: dict = {}


def spec_():
    from fagen.spec.kernel import KernelSpec

    return KernelSpec(backend="gluon", direction="bwd", head_dim=128, dtype="bf16", mask="causal", window=True)


def lever_module(name):
    if name not in _LEV:
        from fagen.runtime.loader import load_source

        src = s9.lever_source(spec_(), LEVERS[name])
        for old, new in _MUT if name == "mutant" else _COUNT if name == "flag2" else []:
            assert src.count(old) >= 1, f"{name}: patch target missing"
            src = src.replace(old, new)
        mod = load_source(src, f"{spec_().name}_s15_{name}")
        assert mod.BWD_DET_MODE == 2 and mod.BWD_FIXED_TMA == 1 and mod.BWD_WIN_CONV == LEVERS[name]["bwd_win_conv"], name
        _LEV[name] = mod
    return _LEV[name]


def product():
    import fagen

    mod = fagen.load(spec_())
    assert mod.BWD_DET_MODE == 2 and mod.BWD_FIXED_TMA == 1 and mod.BWD_WIN_CONV == 0
    return mod


def regs(mod):
    out = []
    try:
        for cache in mod._BWD_KERNELS[2][0].device_caches.values():
            for k in cache[0].values():
                k._init_handles()
                out.append((k.n_regs, k.n_spills))
    except Exception as e:  # noqa: BLE001
        out.append(f"{type(e).__name__}")
    return out


def check_small(name):
    import torch

    mods = {"product": product(), name: lever_module(name)}
    dev = torch.cuda.current_device()
    for n, progs in ((1000, 5), (333, None)) if not ROUND_B else ((1000, 5), ) if name == "mutant" else ((1000, 5), (333, None)):
        q, k, v, do = s12.small(s=n)
        for m in mods.values():
            if progs:
                m._NUM_SMS[dev] = progs
            else:
                m._NUM_SMS.pop(dev, None)
        i, j = torch.arange(n, device="cuda")[:, None], torch.arange(n, device="cuda")[None, :]
        for left in ((37, 130) if not ROUND_B else (130, ) if n == 333 else (37, )):
            def run(left=left):
                ref = s12.ref64(q, k, v, do, (j <= i) & (i - j <= left))
                runs = {x: [s12.grads(lambda a, b, c: m.attention(a, b, c, window=(left, 0)), q, k, v, do)
                            for _ in "ab"] for x, m in mods.items()}
                e = {x: max(s12.errs(r[0], ref)) for x, r in runs.items()}
                rep = all(s12.same(*r) for r in runs.values())
                eq = s12.diff(runs[name][0], runs["product"][0])
                zero = all(bool((r[0][0][:, :, 0] == 0).all()) for r in runs.values())
                ok = rep and zero and max(e.values()) < 3e-2 and eq == "bitwise"
                if name == "mutant":  # must fail: caught if its dq is off the product's
                    ok = eq != "bitwise"
                return ok, (f"max |err| {e}; repeatable {rep}; row 0 dq == 0 {zero}; vs product: {eq}")
            s12.check(f"{name} window ({left}, 0) S{n}{f' on {progs} programs' if progs else ''}", run)
    for m in mods.values():
        m._NUM_SMS.pop(dev, None)


def own_step(mod, tensors, window=(1024, 0)):
    import torch

    q, k, v, do = tensors
    out = mod.attention(q, k, v, window=window)
    return lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)


def step_of(variant, tensors):
    import torch

    import fagen

    q, k, v, do = tensors
    shape = s9.shape_of()
    sm, mm = s9.row_mods(SW, shape)
    if variant == "flex":
        out = s9.flex_call(sm, mm, shape)(q, k, v)
        return lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
    if variant == "own":
        return own_step(product(), tensors)
    if variant in LEVERS:
        return own_step(lever_module(variant), tensors)
    bm = s9.fagen_mask(mm, shape)
    s9.selection(True)
    out = fagen.attention(q, k, v, mask_mod=mm, block_mask=bm, deterministic=True)
    return lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)


def phase_warm(name):
    import torch

    t0 = time.perf_counter()
    try:
        tensors = s12.window_inputs()
        if name == "flex":
            step_of("flex", tensors)()
        elif name == "window":
            step_of("api", tensors)()
            step_of("own", tensors)()
            print(f"CHECK INFO product main kernel (regs, spills): {regs(product())}", flush=True)
        else:
            base = [g.clone() for g in step_of("own", tensors)()]
            got = [g.clone() for g in step_of(name, tensors)()]
            again = [g.clone() for g in step_of(name, tensors)()]
            torch.cuda.synchronize()
            print(f"CHECK INFO timed shape, {name} vs product: {s12.diff(got, base)}; repeat {s12.diff(got, again)}; "
                  f"main kernel (regs, spills) {regs(lever_module(name))}", flush=True)
        torch.cuda.synchronize()
        print(f"warm {name}: {time.perf_counter() - t0:.1f} s", flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"warm {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    if name in ("conv", "conv2", "conv3", "mutant"):
        try:
            check_small(name)
        except Exception as e:  # noqa: BLE001
            print(f"CHECK FAIL {name} checks: {type(e).__name__}: {str(e)[:200]}", flush=True)


def phase_time():
    import torch

    from fagen.bench.timing import measure

    t_end = float(os.environ.get("S15_TIME_END", time.time() + 40))
    tensors = s12.window_inputs()
    levers = os.environ.get("S15_LEVERS", "").split()  # levers only if their warm call matched the product
    names = ["own", *levers, "api", "flex"]
    steps = {}

    def profile(rnd):
        for item in (["own", *levers] if rnd % 2 == 0 else [*levers[::-1], "own"]):  # noqa: B007
            if time.time() > t_end - 1.5 or item not in steps:
                continue
            try:
                ms, top = s12.kernel_ms(steps[item], n=5)
                print("REC " + json.dumps({"variant": item, "round": rnd, "kernel_ms": ms, "top": top}), flush=True)
            except Exception as e:  # noqa: BLE001
                print("REC " + json.dumps({"variant": item, "error": f"kernels {type(e).__name__}: {e}"[:200]}))

    for p in range(12):
        # four passes without Flex (its compile in this child takes most of the budget), then with it; rotated,
        # every other pass reversed
        names_p = names if p >= 4 else names[:-1]
        order = names_p[p % len(names_p):] + names_p[:p % len(names_p)]
        if p % 2:
            order = order[::-1]
        for item in order:
            rec = {"variant": item, "pass": p}
            if time.time() > t_end - (3 if p < 4 else 5):
                continue
            try:
                if item not in steps:
                    steps[item] = step_of(item, tensors)
                step = steps[item]
                step()
                rec["ms"] = measure(lambda i: step(), 1, torch.device("cuda"), 10.0, 25.0)
            except Exception as e:  # noqa: BLE001
                rec["error"] = f"{type(e).__name__}: {str(e)[:160]}"
            print("REC " + json.dumps(rec), flush=True)
            if p == 0 and item == names[len(levers)]:  # own and the levers timed once: their kernels now
                profile(0)
    profile(1)


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
    for a, b in (("conv", "own"), ("conv2", "own"), ("conv3", "own"), ("flag2", "own"), ("conv3", "conv2"), ("own", "flex"), ("conv", "flex"), ("conv2", "flex"), ("api", "flex")):
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
    env = child_env("/tmp/fagen-s15-window", ROOT)
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    if ROUND_B:
        env["S15_ROUND"] = "b"
    script = os.path.abspath(__file__)
    lines: dict = {}

    def go(name, limit, extra=()):
        rc, got = run_phase(script, name, limit, env, on_line=lambda s: print(s, end="", flush=True), extra=extra)
        lines.setdefault(name + "".join(extra), []).extend(got)
        if rc != 0:
            print(f"phase {name} {extra}: {rc}", flush=True)

    threads = [threading.Thread(target=go, args=("warm", 27.0, (w, ))) for w in ("flex", "window", *LEVERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ok = [n for n in ("conv", "conv2", "conv3", "flag2") if any(f"timed shape, {n} vs product: bitwise" in s for s in lines.get(
        "warm" + n, []))]
    env["S15_LEVERS"] = " ".join(ok)  # a lever whose warm call hung or differed is not timed (a hang would take all)
    left = BUDGET - (time.time() - t0)
    env["S15_TIME_END"] = str(time.time() + left - 3)
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
        with open(os.path.join(os.environ["OUTX"], "window_s15.json"), "w") as f:
            json.dump({"records": recs, "lines": lines}, f, indent=1)


if __name__ == "__main__":
    if "--phase" in sys.argv:
        if sys.argv[sys.argv.index("--phase") + 1] == "time":
            phase_time()
        else:
            phase_warm(sys.argv[-1])
    else:
        main()
