"""Probe the Hopper (Gluon) forward's score switches (softcap, window) against fagen's Triton forward, in one GPU run.

    OUT=/tmp/o python scripts/hopper_scores_probe.py     # on an H100 (sm_90): checks, then timings (< 150 s)
    python scripts/hopper_scores_probe.py --dry-run      # any machine: build every gluon module for sm_90, print
                                                         # shared memory, registers, spills

Issue 15's targets (bf16, d128, fagen/bench/workloads.py RELATIVE_TARGETS): softcap 50 causal s16k B1 H16 at
>= 0.9x fagen's plain causal s16k; causal window (4095, 0) s32k B1 H16 at >= 1.3x FlexAttention and >= 0.9x
fagen's dense causal s32k. Phase 1 (subprocesses, all at once, each with a time limit, so a deadlock costs that
module only and the compiles run in parallel): the gluon softcap, window and plain causal modules against the
float64 reference (fagen.verify.reference, compare with fagen.verify.tolerances, hopper_gpu.poisoned_forward) on
small shapes (ragged; Sq > Sk, where rows see no key; many tiles per persistent program), while three
more compile the Triton modules at the timed shapes. Phase 2 (one subprocess, triton's cache filled):
triton.testing.do_bench (hopper_gpu.bench: median, best of 2) of each module on the suite's rows
(fagen.bench.workloads.score_rows), TF/s from fagen.bench.workloads.fwd_flops (a window counts visible pairs).
Output: the log and scores_probe.json in $OUT (the workers' parts go to a temporary folder).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import hopper_gpu  # noqa: E402  (poisoned_forward, bench)

CAP = 50.0
WINDOW = (4095, 0)  # the suite's "window 4096" (fwd-d128-win4k-s32k)
# module key -> gluon spec fields (d128 bf16 causal gqa 1, as the suite's rows)
MODULES = {
    "plain": dict(),
    "softcap": dict(softcap=True),
    "window": dict(window=True),
    "both": dict(window=True, softcap=True),  # dry run only (not timed, checked on the GPU tests)
}
CHECKED = ("softcap", "window", "plain")
WARMED = ("triton-softcap", "triton-window", "triton-causal")  # compiled in phase 1, one subprocess each
# (batch, q heads, Sq, Sk, window): ragged, Sq > Sk (the first rows see no key), many tiles per program (the
# persistent loop crosses tiles whose key ranges start at different blocks).
CHECK_SHAPES = {
    "softcap": [(1, 4, 200, 333, None), (2, 2, 333, 200, None)],
    "plain": [(1, 4, 200, 333, None), (2, 2, 333, 200, None)],
    "window": [(1, 4, 1000, 1000, (100, 5)), (2, 2, 333, 200, (37, 0)), (16, 4, 1000, 1000, (300, None))],
}


def gluon_spec(key):
    from fagen.spec.kernel import KernelSpec
    return KernelSpec(backend="gluon", head_dim=128, mask="causal", dtype="bf16", **MODULES[key])


# -- dry run: compile for sm_90 without a GPU ----------------------------------------------------------------
def compile_info(key):
    """Build one module for sm_90 with triton's ptxas: shared memory, registers, spills (hopper_fwd_probe's way)."""
    import triton
    import fagen
    import hopper_fwd_probe
    from fagen.aot.nvcc import parse_resources
    from fagen import backends
    spec = gluon_spec(key)
    mod = fagen.load(spec)
    t0 = time.time()
    ck = mod.compile_for()
    ptx = ck.asm["ptx"]
    ptxas = os.environ.get("TRITON_PTXAS_PATH") or os.path.join(os.path.dirname(triton.__file__), "backends",
                                                                 "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        Path(src).write_text(ptx)
        r = subprocess.run([ptxas, "-arch=sm_90a", "-v", src, "-o", src + ".cubin"], capture_output=True, text=True)
    res = parse_resources(r.stdout + r.stderr)["_attn_fwd_hopper"]
    steps = hopper_fwd_probe._loops(ptx)
    return dict(module=key, name=spec.name, shared=ck.metadata.shared, formula=backends.smem_bytes(spec),
                regs_entry=res.registers,
                setmaxnreg=sorted(set(int(x) for x in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx))),
                spill_stores=res.spill_stores, spill_loads=res.spill_loads, stack=res.stack,
                tanh=ptx.count("tanh.approx.f32"), wgmma=ptx.count("wgmma.mma_async"), step_loops=len(steps),
                consumer_step=hopper_fwd_probe._count(steps[0]) if steps else None, seconds=round(time.time() - t0, 1))


def dry_run(keys=None):
    from concurrent.futures import ProcessPoolExecutor
    os.environ.pop("TRITON_INTERPRET", None)
    keys = list(keys or MODULES)
    with ProcessPoolExecutor(max_workers=min(len(keys), os.cpu_count() or 1)) as pool:
        results = list(pool.map(compile_info, keys))
    print(f"{'module':8} {'shared':>7} {'formula':>7} {'regs':>4} {'setmaxnreg':>12} {'spill st/ld':>11} {'stack':>5} "
          f"{'tanh':>4} {'wgmma':>5} {'step loops':>10}")
    for r in results:
        print(f"{r['module']:8} {r['shared']:7} {r['formula']:7} {r['regs_entry']:4} {str(r['setmaxnreg']):>12} "
              f"{r['spill_stores']:>5}/{r['spill_loads']:<5} {r['stack']:5} {r['tanh']:4} {r['wgmma']:5} "
              f"{r['step_loops']:10}")
    print("(shared: compiled metadata; formula: fagen.backends.smem_bytes; regs: ptxas at entry; sm_90 limit "
          "232448 B; step loops: innermost PTX loops holding a consumer step, both warpgroups)")
    return results


def check_dry_run(results):
    """What the compile-only test asserts: within sm_90's shared memory and the formula, no spills, the softcap's
    tanh.approx present exactly when the module has it, and one more step loop per warpgroup with a window."""
    base = next(r for r in results if r["module"] == "plain")
    for r in results:
        assert r["shared"] <= min(r["formula"], 232448), r
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0 and r["stack"] == 0, r
        assert (r["tanh"] > 0) == bool(MODULES[r["module"]].get("softcap")), r
        more = 2 if MODULES[r["module"]].get("window") else 0  # the left-edge masked loop, in each warpgroup
        assert r["step_loops"] == base["step_loops"] + more, (r, base)


# -- on the GPU ----------------------------------------------------------------------------------------------
def worker_check(key, log):
    import torch
    import fagen
    from fagen.spec.axes import DType
    from fagen.verify import reference
    from fagen.verify import tolerances as verify
    mod = fagen.load(gluon_spec(key))
    out = []
    for i, (b, hq, sq, sk, window) in enumerate(CHECK_SHAPES[key]):
        g = torch.Generator(device="cuda").manual_seed(500 + i)
        q = torch.randn((b, hq, sq, 128), generator=g, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn((b, hq, sk, 128), generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        kw = {}
        if key == "softcap":
            kw["softcap"] = 5.0
            q = q * 4  # scale * q.k ~ N(0, 16): tanh far from linear at cap 5
        if window is not None:
            kw["window"] = window
        entry = dict(shape=[b, hq, sq, sk], window=window)
        try:
            got, lse = hopper_gpu.poisoned_forward(lambda q, k, v: mod.forward(q, k, v, **kw), q, k, v)
            torch.cuda.synchronize()
            ref, ref_lse = reference.attention(q, k, v, mask="causal", **kw)
            entry["empty_rows"] = int(torch.isinf(ref_lse).sum().item())
            entry["max_err"] = verify.compare("out", got, ref, **verify.TOLERANCE[DType.BF16])
            entry["lse_err"] = verify.compare("lse", lse, ref_lse, **verify.LSE_TOLERANCE)
            entry["ok"] = True
        except Exception as e:  # noqa: BLE001 - every failure is logged and reported, none is hidden
            entry.update(ok=False, error=f"{type(e).__name__}: {e}"[:600])
        log(f"  check {key} {entry}")
        out.append(entry)
    return out


def timed_rows():
    """(case, [(impl, spec, kwargs)]): the suite's rows with the modules timed on them."""
    from fagen.bench.workloads import score_rows
    from fagen.spec.kernel import KernelSpec
    rows = {c.name: c for c in score_rows(baselines=True)}
    tri = lambda **kw: KernelSpec(head_dim=128, mask="causal", dtype="bf16", **kw)  # noqa: E731
    win, cap = rows["fwd-d128-win4k-s32k"], rows["fwd-d128-softcap-causal-s16k"]
    assert win.window == WINDOW and cap.softcap == CAP, (win, cap)
    return [
        (cap, [("gluon-softcap", gluon_spec("softcap"), dict(softcap=CAP)),
               ("triton-softcap", tri(softcap=True), dict(softcap=CAP))]),
        (rows["fwd-d128-causal-s16k"], [("gluon-causal", gluon_spec("plain"), {}), ("triton-causal", tri(), {})]),
        (win, [("gluon-window", gluon_spec("window"), dict(window=WINDOW)),
               ("triton-window", tri(window=True), dict(window=WINDOW))]),
        (rows["fwd-d128-causal-s32k"], [("gluon-causal", gluon_spec("plain"), {}), ("triton-causal", tri(), {})]),
    ]


def case_inputs(case):
    import torch
    g = torch.Generator(device="cuda").manual_seed(0)
    shape = lambda h: (case.batch, h, case.seq_q if h == case.heads_q else case.seq_k, case.head_dim)  # noqa: E731
    return [torch.randn(shape(h), generator=g, device="cuda", dtype=torch.bfloat16)
            for h in (case.heads_q, case.heads_kv, case.heads_kv)]


def worker_warm(which, log):
    """Compile one Triton module at the timed shapes (triton's cache) while the gluon modules are checked."""
    import torch
    import fagen
    for case, impls in timed_rows():
        q, k, v = case_inputs(case)
        for impl, spec, kw in impls:
            if impl == which:
                fagen.load(spec).forward(q, k, v, **kw)
                torch.cuda.synchronize()
                log(f"  warm {impl} {case.name}")
    return {}


def worker_time(ok, log, save):
    import torch
    import fagen
    from fagen.bench.workloads import fwd_flops
    out = dict(ms={}, tflops={}, specs={})
    for case, impls in timed_rows():
        q, k, v = case_inputs(case)
        for impl, spec, kw in impls:
            if impl.startswith("gluon") and impl.split("-")[1].replace("causal", "plain") not in ok:
                log(f"  {impl} {case.name}: skipped (its check failed)")
                continue
            try:
                mod = fagen.load(spec)
                fn = lambda mod=mod, kw=kw: mod.forward(q, k, v, **kw)  # noqa: E731
                fn()
                torch.cuda.synchronize()
                ms = hopper_gpu.bench(fn)
                tf = fwd_flops(case) / (min(ms) * 1e-3) / 1e12
                out["ms"].setdefault(impl, {})[case.name] = ms
                out["tflops"].setdefault(impl, {})[case.name] = tf
                out["specs"][impl] = spec.name
                log(f"  {impl} {case.name}: {[round(t, 4) for t in ms]} ms = {tf:.0f} TF/s")
            except Exception as e:  # noqa: BLE001
                log(f"  {impl} {case.name} FAILED: {type(e).__name__}: {e}"[:600])
            save(out)  # after each module: a later hang keeps what was measured
    return out


def ratios(tf):
    """The targets' ratios (and the Triton-vs-gluon ones), from the measured TF/s."""
    get = lambda impl, case: tf.get(impl, {}).get(case)  # noqa: E731
    fagen_causal16 = get("triton-causal", "fwd-d128-causal-s16k")  # what fagen serves at causal gqa 1 today
    pairs = {
        "gluon softcap / fagen causal s16k (target 0.9)": (get("gluon-softcap", "fwd-d128-softcap-causal-s16k"),
                                                           fagen_causal16),
        "gluon softcap / gluon causal s16k": (get("gluon-softcap", "fwd-d128-softcap-causal-s16k"),
                                              get("gluon-causal", "fwd-d128-causal-s16k")),
        "triton softcap / fagen causal s16k": (get("triton-softcap", "fwd-d128-softcap-causal-s16k"), fagen_causal16),
        "gluon softcap / triton softcap": (get("gluon-softcap", "fwd-d128-softcap-causal-s16k"),
                                           get("triton-softcap", "fwd-d128-softcap-causal-s16k")),
        "gluon window / triton causal s32k (target 0.9)": (get("gluon-window", "fwd-d128-win4k-s32k"),
                                                           get("triton-causal", "fwd-d128-causal-s32k")),
        "gluon window / Flex 409 (2026-11-25 suite; target 1.3)": (get("gluon-window", "fwd-d128-win4k-s32k"), 409.0),
        "gluon window / gluon causal s32k": (get("gluon-window", "fwd-d128-win4k-s32k"),
                                             get("gluon-causal", "fwd-d128-causal-s32k")),
        "triton window / triton causal s32k": (get("triton-window", "fwd-d128-win4k-s32k"),
                                               get("triton-causal", "fwd-d128-causal-s32k")),
        "gluon window / triton window": (get("gluon-window", "fwd-d128-win4k-s32k"),
                                         get("triton-window", "fwd-d128-win4k-s32k")),
    }
    return {name: (a / b if a and b else None) for name, (a, b) in pairs.items()}, fagen_causal16


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="compile every gluon module for sm_90 (no GPU needed)")
    parser.add_argument("--timeout", type=int, default=80, help="seconds for phase 1 (checks and Triton compiles)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.dry_run:
        check_dry_run(dry_run())
        print("dry run OK")
        return
    out_dir = Path(os.environ.get("OUT", "/tmp/hopper_scores_probe"))
    out_dir.mkdir(parents=True, exist_ok=True)
    parts = Path(os.environ.get("SCORES_PROBE_PARTS") or tempfile.mkdtemp(prefix="scores_probe_"))
    os.environ["SCORES_PROBE_PARTS"] = str(parts)
    logfile = open(out_dir / "scores_probe.log", "a")

    def log(msg):
        print(msg, flush=True)
        logfile.write(msg + "\n")
        logfile.flush()

    if args.worker:
        kind, _, arg = args.worker.partition(":")
        path = parts / f"part_{kind}_{arg or 'x'}.json"
        save = lambda result: path.write_text(json.dumps(result, indent=1))  # noqa: E731
        save({"check": lambda: worker_check(arg, log), "warm": lambda: worker_warm(arg, log),
              "time": lambda: worker_time([a for a in arg.split(",") if a], log, save)}[kind]())
        return

    import torch
    import triton
    t_start = time.time()
    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               date=time.strftime("%Y-%m-%d %H:%M:%S"))
    log(f"env {env}")

    def part(kind, arg):
        p = parts / f"part_{kind}_{arg or 'x'}.json"
        return json.loads(p.read_text()) if p.exists() else None

    procs = {w: subprocess.Popen([sys.executable, __file__, "--worker", w])
             for w in [f"check:{key}" for key in CHECKED] + [f"warm:{impl}" for impl in WARMED]}
    rcs = {}
    for w, proc in procs.items():
        try:
            rcs[w] = proc.wait(timeout=max(1, args.timeout - (time.time() - t_start)))
        except subprocess.TimeoutExpired:
            proc.kill()
            rcs[w] = "timeout"
    log(f"phase 1 in {time.time() - t_start:.0f} s: {rcs}")
    checks, ok = {}, []
    for key in CHECKED:
        res = checks[key] = part("check", key)
        good = res is not None and len(res) == len(CHECK_SHAPES[key]) and all(c.get("ok") for c in res)
        log(f"{'PASS' if good else 'FAIL'} gluon {key}: "
            f"{sum(bool(c.get('ok')) for c in res or [])}/{len(CHECK_SHAPES[key])} shapes (rc {rcs[f'check:{key}']})")
        if good:
            ok.append(key)
    t1 = time.time()
    cmd = [sys.executable, __file__, "--worker", "time:" + ",".join(ok)]
    try:
        rc = subprocess.run(cmd, timeout=max(10, 145 - (t1 - t_start))).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    log(f"phase 2 in {time.time() - t1:.0f} s: rc {rc}")
    timing = part("time", ",".join(ok)) or {}
    tf = timing.get("tflops", {})
    cases = ["fwd-d128-softcap-causal-s16k", "fwd-d128-causal-s16k", "fwd-d128-win4k-s32k", "fwd-d128-causal-s32k"]
    impls = ["gluon-softcap", "triton-softcap", "gluon-window", "triton-window", "gluon-causal", "triton-causal"]
    log(f"\nTF/s (H100 bf16 d128, B1 H16; median of do_bench, best of 2; window: visible pairs)")
    for case in cases:
        cells = [f"{impl} {tf[impl][case]:.0f}" for impl in impls if tf.get(impl, {}).get(case)]
        log(f"  {case:30} " + "  ".join(cells))
    rat, base16 = ratios(tf)
    log(f"\nratios (fagen causal = triton causal, what fagen serves at causal gqa 1 today: s16k "
        f"{base16 and round(base16)} TF/s)")
    for name, r in rat.items():
        log(f"  {name:58} {r:.3f}" if r else f"  {name:58} -")
    summary = dict(env=env, rcs={**rcs, "time": rc}, checks=checks, passed=ok, timing=timing, ratios=rat,
                   seconds=time.time() - t_start)
    (out_dir / "scores_probe.json").write_text(json.dumps(summary, indent=1))
    for p in parts.glob("part_*.json"):
        p.unlink()
    log(f"total {time.time() - t_start:.0f} s; JSON in {out_dir / 'scores_probe.json'}")


if __name__ == "__main__":
    main()
