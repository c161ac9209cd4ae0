"""Issue 26, fourteenth session (helper window): where the sliding-window row's main kernel spends its per-tile cost
(causal + window (1024, 0), B1 H16 S8192 d128 bf16, deterministic); docs/mods.md "The window's backward (fourteenth
session)".

    PYTHONPATH=$PWD python3 scripts/gpu_window_s14.py

Round A (window-A.txt; commit 8c81754): the product against Flex, one program per tile (BWD_GRID_ALL 1: the hardware deals the tiles as SMs free up,
the balance of a dynamic scheduler, at the cost of a CTA's start per tile), and ablations of the main kernel: the
product's window render with one piece taken out of its source (text patches of the generated module; wrong
gradients by construction, timed only):
  noadd   the dQ warp's TMA reduce-adds issued as nothing (the accumulator's L2/DRAM traffic and the adds' issue)
  noepi   the dK/dV TMA stores of the epilogue left out (the stores' traffic; the staging stays)
  nomask  no step masked (the four masked edge steps a tile run as unmasked ones)
  samekv  every tile loads K, V of key block 0, head 0 (L2-hot: the tile-start K/V DRAM loads)
Phases (scripts/_phases.py): warm children at once (flex; window, then its checks at B1 H2 S333, windows (37, 0) and
(130, 0): api and grid against float64, repeatable, row 0's dq exactly 0, grid bit for bit api; the ablations'
compiles in two children), then `time`: api, grid and Flex in three rotated passes (do_bench medians, L2 flushed),
then each module's kernels by torch.profiler (its own attention at the row's window), the main kernel's ms.
Round B (`--round b`, window-B.txt): the prefetch lever at L 2, 4, 6 and its control kvpf4n (the L 4 render
prefetching 16 bytes instead of 32 KB: the same code, and the same sm_90 build's spills as kvpf4's, 128 / 196 bytes
against the product's 164 / 220; round A's ablations showed the main kernel moving 7% with its register allocation),
each main kernel's registers and spills, against the product and Flex in four rotated passes; no ablations, no grid,
no epi2 (round A: lost).
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
ROUND_B = sys.argv[1:3] == ["--round", "b"] or os.environ.get("S14_ROUND") == "b"
SW = "sliding-window+causal"
VARIANTS = {"api": {}, "grid": {"BWD_GRID_ALL": 1}}
DEFAULTS: dict = {}
# noadd: the call sites renamed (a builtin's body is not in the kernel's cache key: patching _tma_reduce_add itself
# would load the product's cached kernel)
PATCHES = {
    "noadd": [("_tma_reduce_add(dq_desc,", "_tma_noadd(dq_desc,"),
              ("@_builtin\ndef _tma_reduce_add(", "@_builtin\ndef _tma_noadd(tensor_desc, coord, src, _semantic=None):\n"
               "    pass\n\n\n@_builtin\ndef _tma_reduce_add(")],
    "noepi": [("tma.async_copy_shared_to_global(DV, [off_b, off_hkv, n0 + WG * WN, 0], stage4)", "pass"),
              ("tma.async_copy_shared_to_global(DK, [off_b, off_hkv, n0 + WG * WN, 0], stage4)", "pass")],
    "nomask": [("if (m0 < split) | (m0 >= top):", "if m0 < 0:")],
    "samekv": [("tma.async_copy_global_to_shared(k_desc, [off_b, off_hkv, n0, 0]",
                "tma.async_copy_global_to_shared(k_desc, [0, 0, 0, 0]"),
               ("tma.async_copy_global_to_shared(v_desc, [off_b, off_hkv, n0, 0]",
                "tma.async_copy_global_to_shared(v_desc, [0, 0, 0, 0]")],
}
ABL_GROUPS = {"abl1": ["noadd", "noepi"], "abl2": ["nomask", "samekv"]}
_ABL: dict = {}
# the lever built for this round: [Note] K/V prefetch into L2 (variant bwd_kv_prefetch L: L steps ahead)
# and round A's two epilogue stages (variant bwd_epi_two 1, removed after round A: lost)
LEVERS = {"kvpf4": {"bwd_kv_prefetch": 4}, "kvpf10": {"bwd_kv_prefetch": 10}}
LEV_GROUPS = {"lev1": ["kvpf4", "kvpf10"]}
_NOPF = ("[$1], 32768; ", "[$1], 16; ")  # kvpf4n: 16 bytes prefetched, not 32 KB (the same code but the size)
if ROUND_B:
    VARIANTS = {"api": {}}
    ABL_GROUPS = {}
    LEVERS = {"kvpf4": {"bwd_kv_prefetch": 4}, "kvpf4n": {"bwd_kv_prefetch": 4}, "kvpf2": {"bwd_kv_prefetch": 2},
              "kvpf6": {"bwd_kv_prefetch": 6}}
    LEV_GROUPS = {"lev1": ["kvpf4", "kvpf4n"], "lev2": ["kvpf2", "kvpf6"]}
_LEV: dict = {}


def lever_module(name):
    """The product's window render with LEVERS[name]'s variant keys (a mode-2 render with the qmul rows by TMA)."""
    if name not in _LEV:
        from fagen.runtime.loader import load_source
        from fagen.spec.kernel import KernelSpec

        spec = KernelSpec(backend="gluon", direction="bwd", head_dim=128, dtype="bf16", mask="causal", window=True)
        src = s9.lever_source(spec, LEVERS[name])
        if name == "kvpf4n":
            assert src.count(_NOPF[0]) == 1, "kvpf4n: patch target missing"
            src = src.replace(*_NOPF)
        mod = load_source(src, f"{spec.name}_s14_{name}")
        assert mod.BWD_DET_MODE == 2 and mod.BWD_FIXED_TMA == 1, name
        assert mod.BWD_KV_PREFETCH == int("bwd_kv_prefetch" in LEVERS[name]), name
        _LEV[name] = mod
    return _LEV[name]


def ablation(name):
    """The product's window render with PATCHES[name] applied (each patch must match)."""
    if name not in _ABL:
        import fagen
        from fagen.runtime.loader import load_source
        from fagen.spec.kernel import KernelSpec

        spec = KernelSpec(backend="gluon", direction="bwd", head_dim=128, dtype="bf16", mask="causal", window=True)
        src = fagen.generate(spec)
        for old, new in PATCHES[name]:
            assert old in src, f"{name}: patch target missing"
            src = src.replace(old, new)
        _ABL[name] = load_source(src, f"{spec.name}_s14_{name}")
    return _ABL[name]


def regs(mod):
    """[(registers, spilled bytes)] of the mode-2 main kernel's compiled versions in this process (best effort)."""
    out = []
    try:
        for cache in mod._BWD_KERNELS[2][0].device_caches.values():
            for k in cache[0].values():
                k._init_handles()
                out.append((k.n_regs, k.n_spills))
    except Exception as e:  # noqa: BLE001
        out.append(f"{type(e).__name__}")
    return out


def levers(mod, variant):
    if not DEFAULTS:
        DEFAULTS.update({"BWD_GRID_ALL": mod.BWD_GRID_ALL})
    for k, v in {**DEFAULTS, **VARIANTS[variant]}.items():
        setattr(mod, k, v)
    return mod


def check_small(with_levers=()):
    import torch

    n = 1000 if with_levers else 333  # the levers: 5 programs for 16 tiles (a prefetch needs a next tile)
    q, k, v, do = s12.small(s=n)
    mod = s12.module("window")
    if with_levers:
        for m in (mod, *(lever_module(x) for x in with_levers)):
            m._NUM_SMS[torch.cuda.current_device()] = 5
    i, j = torch.arange(n, device="cuda")[:, None], torch.arange(n, device="cuda")[None, :]
    for left in (37, 130):
        def run(left=left):
            ref = s12.ref64(q, k, v, do, (j <= i) & (i - j <= left))
            def calls(name):
                mod_ = lever_module(name) if name in LEVERS else levers(mod, name)
                return [s12.grads(lambda a, b, c: mod_.attention(a, b, c, window=(left, 0)), q, k, v, do)
                        for _ in "ab"]
            runs = {name: calls(name) for name in (["api", *with_levers] if with_levers else VARIANTS)}
            levers(mod, "api")
            e = {n: max(s12.errs(r[0], ref)) for n, r in runs.items()}
            rep = all(s12.same(*r) for r in runs.values())
            eq = {n: s12.diff(r[0], runs["api"][0]) for n, r in runs.items() if n != "api"}
            zero = all(bool((r[0][0][:, :, 0] == 0).all()) for r in runs.values())
            ok = rep and zero and max(e.values()) < 3e-2 and all(x == "bitwise" for x in eq.values())
            return ok, (f"max |err| {max(e.values()):.1e} (api {e['api']:.1e}); repeatable {rep}; row 0 dq == 0 "
                        f"{zero}; vs api: {eq}")
        s12.check(f"{'levers (5 programs)' if with_levers else 'variants'} window ({left}, 0) S{n}", run)


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
    if variant in LEVERS or variant == "own":  # the module's own attention (the product's: "own")
        return own_step(lever_module(variant) if variant in LEVERS else levers(s12.module("window"), "api"), tensors)
    mod = s12.module("window")
    bm = s9.fagen_mask(mm, shape)
    s9.selection(True)
    levers(mod, variant)
    out = fagen.attention(q, k, v, mask_mod=mm, block_mask=bm, deterministic=True)

    def step():
        levers(mod, variant)
        return torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
    return step


def phase_warm(name):
    import torch

    t0 = time.perf_counter()
    try:
        tensors = s12.window_inputs()
        if name == "flex":
            step_of("flex", tensors)()
        elif name in LEV_GROUPS:
            base = [g.clone() for g in step_of("own", tensors)()]
            got = {n: [g.clone() for g in step_of(n, tensors)()] for n in LEV_GROUPS[name]}
            torch.cuda.synchronize()
            print(f"CHECK INFO timed shape, vs own: {({n: s12.diff(g, base) for n, g in got.items()})}", flush=True)
            print(f"CHECK INFO main kernel (regs, spill bytes): product {regs(s12.module('window'))}, "
                  + ", ".join(f"{n} {regs(lever_module(n))}" for n in LEV_GROUPS[name]), flush=True)
        elif name in ABL_GROUPS:
            for a in ABL_GROUPS[name]:
                own_step(ablation(a), tensors)()
                torch.cuda.synchronize()
                print(f"warm {a}: {time.perf_counter() - t0:.1f} s", flush=True)
        else:
            base = [g.clone() for g in step_of("api", tensors)()]
            got = {n: [g.clone() for g in step_of(n, tensors)()] for n in VARIANTS if n != "api"}
            torch.cuda.synchronize()
            print(f"CHECK INFO timed shape, vs api: {({n: s12.diff(g, base) for n, g in got.items()})}", flush=True)
        torch.cuda.synchronize()
        print(f"warm {name}: {time.perf_counter() - t0:.1f} s", flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"warm {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    if name == "window" or name in LEV_GROUPS:
        check_small(tuple(LEV_GROUPS.get(name, ())))


def phase_time():
    import torch

    from fagen.bench.timing import measure

    t_end = float(os.environ.get("S14_TIME_END", time.time() + 50))
    tensors = s12.window_inputs()
    names = [*VARIANTS, *(() if ROUND_B else ("own", )), *LEVERS, "flex"]  # fagen's first (Flex's compile: slow)
    steps = {}
    for p in range(4 if ROUND_B else 3):
        for item in names[p % len(names):] + names[:p % len(names)]:
            rec = {"variant": item, "pass": p}
            if time.time() > t_end - 14:
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
    items = [("api", lambda: steps["api"])]
    if not ROUND_B:
        items += [("grid", lambda: steps["grid"]),
                  ("own", lambda: own_step(levers(s12.module("window"), "api"), tensors))]
    items += [(a, lambda a=a: steps[a] if a in steps else step_of(a, tensors)) for a in LEVERS]
    items += [(a, lambda a=a: own_step(ablation(a), tensors)) for a in PATCHES]
    for rnd in range(1 if ROUND_B else 2):  # rounds of the kernel profiles, in opposite orders
        for item, make in (items if rnd == 0 else items[::-1]):
            if time.time() > t_end - 2:
                break
            try:
                ms, top = s12.kernel_ms(make(), n=5)
                main = [t for n, t in top if n.startswith("_attn_bwd")]
                print("REC " + json.dumps({"variant": item, "round": rnd, "kernel_ms": ms,
                                           "main_ms": main[0] if main else None, "top": top}), flush=True)
            except Exception as e:  # noqa: BLE001
                print("REC " + json.dumps({"variant": item, "error": f"kernels {type(e).__name__}: {e}"[:200]}))
            levers(s12.module("window"), "api")


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
    print("\n| module | main kernel ms (rounds) | all kernels ms | largest |")
    print("|---|---|---:|---|")
    kern = {}
    for r in recs:
        if "kernel_ms" in r:
            kern.setdefault(r["variant"], []).append(r)
    for k, rs in kern.items():
        print(f"| {k} | {' / '.join(str(r['main_ms']) for r in rs)} | {rs[0]['kernel_ms']:.4f} | {rs[0]['top']} |")


def main():
    from _phases import child_env, run_phase

    t0 = time.time()
    env = child_env("/tmp/fagen-s14-window", ROOT)
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    if ROUND_B:
        env["S14_ROUND"] = "b"  # the children's LEVERS, groups and passes
    script = os.path.abspath(__file__)
    lines: dict = {}

    def go(name, limit, extra=()):
        rc, got = run_phase(script, name, limit, env, on_line=lambda s: print(s, end="", flush=True), extra=extra)
        lines.setdefault(name + "".join(extra), []).extend(got)
        if rc != 0:
            print(f"phase {name} {extra}: {rc}", flush=True)

    threads = [threading.Thread(target=go, args=("warm", 32.0, (w, )))
               for w in ("flex", "window", *LEV_GROUPS, *ABL_GROUPS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    left = BUDGET - (time.time() - t0)
    env["S14_TIME_END"] = str(time.time() + left - 5)
    print(f"compiled in {time.time() - t0:.0f} s; timing for {left:.0f} s", flush=True)
    go("time", max(5.0, left))
    recs = [json.loads(s[4:]) for s in lines.get("time", []) if s.startswith("REC ")]
    summary(recs)
    for s in [x for got in lines.values() for x in got if x.startswith("CHECK ")]:
        print(s[6:], end="")
    print(f"total {time.time() - t0:.0f} s")
    if os.environ.get("OUTX"):
        os.makedirs(os.environ["OUTX"], exist_ok=True)
        with open(os.path.join(os.environ["OUTX"], "window_s14.json"), "w") as f:
            json.dump({"records": recs, "lines": lines}, f, indent=1)


if __name__ == "__main__":
    if "--phase" in sys.argv:
        if sys.argv[sys.argv.index("--phase") + 1] == "time":
            phase_time()
        else:
            phase_warm(sys.argv[-1])
    else:
        main()
