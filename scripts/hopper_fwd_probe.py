"""Probe the Hopper (Gluon) forward's O-via-Q and joined-release variants against cuDNN, in one GPU run.

    OUT=/tmp/o python scripts/hopper_fwd_probe.py            # on an H100 (sm_90): checks, then timings (< 170 s)
    python scripts/hopper_fwd_probe.py --dry-run             # any machine: build every variant for sm_90, print
                                                             # shared memory, registers, spills, barrier ops per step
    OUT=/tmp/o python scripts/hopper_fwd_probe.py --variants default,j2

The variants are fagen/templates/gluon/attention.py.j2 rendered by scripts/hopper_render.py ([Note] O via Q,
[Note] Joined release). Phase 1 (one subprocess per variant, all at once, each with a time limit, so a deadlock
costs that variant only and the compiles run in parallel): every variant against the float64 reference
(hopper_gpu.check_module) on d128 bf16, masks none/causal x gqa 1/4, on hopper_gpu's ragged shapes plus two with
many tiles per persistent program (a causal one with Sq > Sk, whose first tiles see no key). Phase 2 (one
subprocess, after phase 1 has filled triton's cache): each variant that passed, SDPA forced to cuDNN and fagen's
Triton forward, timed with do_bench in that one process (hopper_gpu.bench: median, best of 2); each variant's
output on the timed inputs is also compared with cuDNN's. Table on stdout, JSON in $OUT/fwd_probe.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import hopper_gpu  # noqa: E402  (checking and timing helpers: check_module, bench, tflops, inputs, CASES)

# name -> hopper_render config overrides (d128, block_n 128). "default" is the shipped kernel.
VARIANTS = {
    "default": dict(),
    "oq": dict(o_via_q=1),  # O through Q, Q double-buffered, 2 slots (197 KB)
    "j2": dict(kv_join=2),  # one arrive per step (K_n with V_{n-1}), 2 slots, O buffer kept
    "oq_s3": dict(o_via_q=1, q_stages=1, stages=3),  # 3 K/V slots: Q single-buffered, O through it
    "oq_s3_j1": dict(o_via_q=1, q_stages=1, stages=3, kv_join=1),  # 3 slots, one barrier per slot (K_n + V_n)
    "oq_s3_j2": dict(o_via_q=1, q_stages=1, stages=3, kv_join=2),  # 3 slots, one barrier per step
}
CASES = [c for c in hopper_gpu.CASES if c[0] in ("fwd-d128-full-s16k", "fwd-d128-causal-s16k",
                                                   "fwd-gqa-d128-causal-s4k")]
# hopper_gpu's ragged shapes (B, Sq, Sk) plus many tiles per program (grid = #SMs): B 16 x 2 or 8 heads x 8 row
# blocks = 256 / 1024 tiles; the second is causal with Sq > Sk: rows 0-399 see no key, whole tiles have none.
MULTI_TILE = [(16, 1000, 1000), (16, 700, 300)]
CHECKS = [(m, g) for m in ("none", "causal") for g in (1, 4)]


def config(variant, mask, gqa):
    return dict(VARIANTS[variant], head_dim=128, mask=mask, gqa=gqa, dtype="bf16")


# -- dry run: compile for sm_90 without a GPU ----------------------------------------------------------------
def _loops(ptx):
    """Innermost PTX loops (label .. backward branch) that hold a whole consumer step (>= 16 wgmma). The
    producer's loop is laid out in pieces (its back edge branches forward), so it is not counted."""
    lines = ptx.splitlines()
    labels = {m.group(1): i for i, l in enumerate(lines) if (m := re.match(r"^(\$L__BB\d+_\d+):", l))}
    regions = []
    for j, l in enumerate(lines):
        m = re.search(r"\bbra(?:\.uni)?\s+(\$L__BB\d+_\d+);", l)
        if m and m.group(1) in labels and labels[m.group(1)] < j:
            regions.append((labels[m.group(1)], j))
    body = lambda r: "\n".join(lines[r[0]:r[1] + 1])  # noqa: E731
    steps = [r for r in regions if body(r).count("wgmma.mma_async") >= 16]
    inner = [r for r in steps if not any(o != r and r[0] <= o[0] and o[1] <= r[1] for o in steps)]
    return [body(r) for r in inner]


def _count(text):
    return dict(bar_sync=len(re.findall(r"\b(?:bar|barrier)\.sync\b", text)),
                mbar_arrive=text.count("mbarrier.arrive"), mbar_wait=text.count("mbarrier.try_wait"))


def compile_info(variant, mask):
    """Build one variant for sm_90 with triton's ptxas: shared memory, registers, spills, barrier ops per step."""
    import tempfile
    import triton
    import hopper_render
    from fagen.aot.nvcc import parse_resources
    cfg = config(variant, mask, 1)
    mod = hopper_render.load(**cfg)
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
    steps = _loops(ptx)
    per_step = [_count(s) for s in steps]
    return dict(variant=variant, mask=mask, name=hopper_render.HopperConfig(**cfg).name, shared=ck.metadata.shared,
                formula=hopper_render.HopperConfig(**cfg).smem_bytes(), regs_entry=res.registers,
                setmaxnreg=sorted(set(int(x) for x in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx))),
                spill_stores=res.spill_stores, spill_loads=res.spill_loads, stack=res.stack,
                consumer_step=per_step[0] if per_step else None, step_loops=len(steps),
                seconds=round(time.time() - t0, 1))


def dry_run(variants, jobs=None):
    """Compile (variant, mask) jobs (default: every variant, both masks) in parallel; print and return the table."""
    from concurrent.futures import ProcessPoolExecutor
    os.environ.pop("TRITON_INTERPRET", None)
    jobs = jobs or [(v, m) for v in variants for m in ("none", "causal")]
    with ProcessPoolExecutor(max_workers=min(len(jobs), os.cpu_count() or 1)) as pool:
        results = list(pool.map(compile_info, *zip(*jobs)))
    print(f"{'variant':10} {'mask':6} {'shared':>7} {'formula':>7} {'regs':>4} {'setmaxnreg':>12} {'spill st/ld':>11} "
          f"{'step: bar.sync arrive wait':>27}")
    for r in results:
        st = r["consumer_step"] or {}
        print(f"{r['variant']:10} {r['mask']:6} {r['shared']:7} {r['formula']:7} {r['regs_entry']:4} "
              f"{str(r['setmaxnreg']):>12} {r['spill_stores']:>5}/{r['spill_loads']:<5} "
              f"{st.get('bar_sync', '-'):>13} {st.get('mbar_arrive', '-'):>6} {st.get('mbar_wait', '-'):>6}")
    print("(shared: compiled metadata; formula: fagen.backends.gluon.smem_bytes; regs: ptxas at entry; per step: "
          "the first innermost PTX loop holding a consumer step, one warpgroup; sm_90 limit 232448 B)")
    return results


def check_dry_run(results):
    """What the compile-only test asserts: within sm_90's shared memory and the formula, no spills, and fewer
    barrier ops per consumer step with a joined release."""
    for r in results:
        assert r["shared"] <= min(r["formula"], 232448), r
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0 and r["stack"] == 0, r
        st = r["consumer_step"]
        assert st is not None, r
        joined = VARIANTS[r["variant"]].get("kv_join", 0)
        assert (st["mbar_arrive"], st["bar_sync"]) == ((1, 2) if joined else (2, 3)), r


# -- on the GPU ----------------------------------------------------------------------------------------------
def worker_check(variant, log):
    import hopper_render
    hopper_gpu.CHECK_SHAPES = list(hopper_gpu.CHECK_SHAPES) + MULTI_TILE  # check_module reads it at call time
    out = {}
    for mask, gqa in CHECKS:
        cfg = config(variant, mask, gqa)
        key = f"{mask}-g{gqa}"
        try:
            out[key] = hopper_gpu.check_module(hopper_render.load(**cfg), cfg, log, full=True)
        except Exception:  # noqa: BLE001 - a failure is reported, never hidden
            out[key] = [dict(ok=False, error=traceback.format_exc()[-1500:])]
            log(f"  {variant} check {key} FAILED\n{traceback.format_exc()}")
    return out


def worker_warm_triton(log):
    """Compile fagen's Triton forwards for the timed cases (fills triton's cache while the variants check)."""
    import torch
    import fagen
    for case in CASES:
        name, d, m, b, hq, hkv, s = case[:7]
        q, k, v = hopper_gpu.inputs(case)
        fagen.load(fagen.KernelSpec(head_dim=d, mask=m, gqa=hq // hkv, dtype="bf16")).forward(q, k, v)
        torch.cuda.synchronize()
        log(f"  warm fagen-triton {name}")
    return {}


def worker_time(variants, log):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import fagen
    import hopper_render
    out = dict(times={}, vs_cudnn={}, compile={})
    for case in CASES:
        name, d, m, b, hq, hkv, s = case[:7]
        q, k, v = hopper_gpu.inputs(case)
        causal = m == "causal"

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hq != hkv)
        impls = {"cudnn": cudnn}
        tri = fagen.load(fagen.KernelSpec(head_dim=d, mask=m, gqa=hq // hkv, dtype="bf16"))
        impls["fagen-triton"] = lambda: tri.forward(q, k, v)
        ref = cudnn()
        for var in variants:
            mod = hopper_render.load(**config(var, m, hq // hkv))
            impls[var] = lambda mod=mod: mod.forward(q, k, v)
        for impl, fn in impls.items():
            try:
                got = fn()
                got = got[0] if isinstance(got, tuple) else got
                torch.cuda.synchronize()
                diff = (got.float() - ref.float()).abs().max().item()
                out["vs_cudnn"].setdefault(impl, {})[name] = diff
                ms = hopper_gpu.bench(fn)
                out["times"].setdefault(impl, {})[name] = ms
                log(f"  {impl} {name}: {[round(t, 4) for t in ms]} ms = {hopper_gpu.tflops(case, min(ms)):.0f} "
                    f"TF/s, max|out - cudnn| {diff:.2e}")
            except Exception as e:  # noqa: BLE001
                out["times"].setdefault(impl, {})[name] = None
                log(f"  {impl} {name} FAILED: {type(e).__name__}: {e}"[:400])
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--dry-run", action="store_true", help="compile every variant for sm_90 (no GPU needed)")
    parser.add_argument("--timeout", type=int, default=110, help="seconds per check subprocess")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        if v not in VARIANTS:
            parser.error(f"unknown variant {v!r}; choose from {', '.join(VARIANTS)}")
    for v in VARIANTS:  # a bad config is a ConfigError before any GPU work
        for m, g in CHECKS:
            import hopper_render
            hopper_render.HopperConfig(**config(v, m, g))
    if args.dry_run:
        check_dry_run(dry_run(variants))
        return
    out_dir = Path(os.environ.get("OUT", "/tmp/hopper_fwd_probe"))
    out_dir.mkdir(parents=True, exist_ok=True)
    logfile = open(out_dir / "fwd_probe.log", "a")

    def log(msg):
        print(msg, flush=True)
        logfile.write(msg + "\n")
        logfile.flush()

    if args.worker:
        kind, _, arg = args.worker.partition(":")
        result = {"check": lambda: worker_check(arg, log), "warm": lambda: worker_warm_triton(log),
                  "time": lambda: worker_time([v for v in arg.split(",") if v], log)}[kind]()
        (out_dir / f"part_{kind}_{arg or 'x'}.json").write_text(json.dumps(result, indent=1))
        return

    import torch
    import triton
    t_start = time.time()
    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               date=time.strftime("%Y-%m-%d %H:%M:%S"))
    log(f"env {env}")

    def part(kind, arg):
        p = out_dir / f"part_{kind}_{arg or 'x'}.json"
        return json.loads(p.read_text()) if p.exists() else None

    for p in out_dir.glob("part_*.json"):
        p.unlink()
    # Phase 1: checks of every variant and the Triton warm-up, concurrently.
    procs = {w: subprocess.Popen([sys.executable, __file__, "--worker", w])
             for w in [f"check:{v}" for v in variants] + ["warm:"]}
    rcs = {}
    for w, proc in procs.items():
        try:
            rcs[w] = proc.wait(timeout=max(1, args.timeout - (time.time() - t_start)))
        except subprocess.TimeoutExpired:
            proc.kill()
            rcs[w] = "timeout"
    log(f"phase 1 in {time.time() - t_start:.0f} s: {rcs}")
    checks, passed = {}, []
    for v in variants:
        res = part("check", v)
        checks[v] = res
        n_bad = sum(not c.get("ok") for cs in (res or {}).values() for c in cs)
        n_all = sum(len(cs) for cs in (res or {}).values())
        n_want = len(CHECKS) * len(hopper_gpu.CHECK_SHAPES + MULTI_TILE)
        ok = res is not None and n_bad == 0 and n_all == n_want
        log(f"{'PASS' if ok else 'FAIL'} {v}: {n_all - n_bad}/{n_want} checks passed (rc {rcs[f'check:{v}']})")
        if ok:
            passed.append(v)
    # Phase 2: timings in one process.
    t1 = time.time()
    cmd = [sys.executable, __file__, "--worker", "time:" + ",".join(passed)]
    try:
        rc = subprocess.run(cmd, timeout=max(10, 165 - (t1 - t_start))).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    log(f"phase 2 in {time.time() - t1:.0f} s: rc {rc}")
    timing = part("time", ",".join(passed)) or {}
    times = timing.get("times", {})
    cols = passed + ["fagen-triton", "cudnn"]
    log(f"\nTF/s (bf16, d128; median of do_bench, best of 2)\n{'case':26} " + " ".join(f"{c:>12}" for c in cols))
    table = []
    for case in CASES:
        row = dict(case=case[0])
        for c in cols:
            ms = times.get(c, {}).get(case[0])
            row[c] = hopper_gpu.tflops(case, min(ms)) if ms else None
        table.append(row)
        log(f"{case[0]:26} " + " ".join(f"{row[c]:12.0f}" if row[c] else f"{'-':>12}" for c in cols))
    log(f"\nratio to cuDNN\n{'case':26} " + " ".join(f"{c:>12}" for c in cols[:-1]))
    for row in table:
        cud = row.get("cudnn")
        row["over_cudnn"] = {c: row[c] / cud for c in cols[:-1] if row.get(c) and cud}
        log(f"{row['case']:26} " + " ".join(f"{row['over_cudnn'][c]:12.3f}" if c in row["over_cudnn"] else
                                            f"{'-':>12}" for c in cols[:-1]))
    summary = dict(env=env, variants={v: VARIANTS[v] for v in variants}, rcs={**rcs, "time": rc}, checks=checks,
                   passed=passed, timing=timing, table=table, seconds=time.time() - t_start)
    (out_dir / "fwd_probe.json").write_text(json.dumps(summary, indent=1))
    log(f"total {time.time() - t_start:.0f} s; JSON in {out_dir / 'fwd_probe.json'}")


if __name__ == "__main__":
    main()
