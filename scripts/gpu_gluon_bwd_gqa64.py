"""The Gluon backward at GQA and d64 (issue 28, ninth session, helper gqa64) on an H100/H200.

    PYTHONPATH=$PWD python3 scripts/gpu_gluon_bwd_gqa64.py      # every phase, each in a child with a timeout
    python scripts/gpu_gluon_bwd_gqa64.py --phase time          # one phase here (no child, no timeout)
    GPU_GQA64_DRY=1 python scripts/gpu_gluon_bwd_gqa64.py       # any machine: renders, sm_90 builds of the new ones

Questions (docs/hopper.md, "GQA and d64 in the Gluon backward (ninth session)"):
- d64: which deterministic render of the Gluon backward (the chain: fixed-order float32 dQ adds, DQ_MODE 0; the
  fixed-point dQ: variant bwd_fixed) beats the Triton backward at d64 causal AND full (B1 H32 s16k), and at GQA
  32/8 causal d64; with 128-query steps (BWD_BLOCK_M 128 in the render: twice the step, the same chain latency).
- GQA 32/8 causal (B4 s4k, d128): why 372 against cuDNN's 461. Levers timed here: GRID 1 (one CTA per tile, the
  hardware hands them out in index order: heavy tiles first, no static round robin; the module's _NUM_SMS set past
  the tile count between forward and backward: the same kernels), the unordered kernel without its levers, and the
  query heads of a KV head split over 2 or 4 CTAs (variant bwd_gqa_split, [Note] GQA split in the backward: float32
  dK, dV partials summed in a fixed order afterwards; a job's split field > 1 emulates it on the gqa / split module
  with K, V repeated), the steps of a GQA tile query block major (variant bwd_gqa_order 1, [Note] GQA step order in the backward: key block n - 1 stays
  ahead of n in the dQ chain at every head change), and L2 sections (variant bwd_sections 8: the tiles of 8 (batch,
  KV head) pairs key block major, then the next 8: a wave spans 16 key blocks of 8 heads instead of 4 of all 32, so
  each dQ row gets more of its adds while in L2; [Note] L2 sections in the backward).
Phases: `warm` (one child per job, all at once: build, check against float64 at a small shape whose integer
arguments fall in the real shape's specialisation classes, exact zeros of row 0 in causal cases, then the real shape
once per mode, bitwise equal twice in deterministic modes and equal under GRID 1), `time` (one child: TF/s of each
ready job's modes beside cuDNN, SDPA's cuDNN backend, and the Triton backward, backward only, triton's do_bench
median). Prints one table at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/, for _phases
from _phases import child_env, run_phase as run_child  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# case -> (B, Hq, Hkv, S_real, D, causal, check shape (B, Hq, Hkv, Sq, Sk)): the check shape's integer arguments
# (B x Hkv, Hkv, the tile count, the sequence lengths) fall in the real shape's divisibility classes, so the kernels
# built at the check shape serve the real one without another compile
CASES = {
    "d64 causal B1 H32 s16k": (1, 32, 32, 16384, 64, True, (1, 16, 16, 208, 208)),
    "d64 full B1 H32 s16k": (1, 32, 32, 16384, 64, False, (1, 16, 16, 208, 336)),
    "gqa 32/8 causal B4 s4k d128": (4, 32, 8, 4096, 128, True, (4, 32, 8, 208, 208)),
    "gqa 32/8 causal B4 s4k d64": (4, 32, 8, 4096, 64, True, (4, 32, 8, 208, 208)),
}
C_C64, C_F64, C_GQA, C_G64 = CASES
# job -> (case, backend, variant overrides, BWD_BLOCK_M or None, split, modes): modes are labels 'chain' (DQ_MODE 0),
# 'fixed' (the bwd_fixed render's deterministic mode), 'unord' (deterministic=False); split s > 1: the gqa / s module
# on K, V repeated s times per KV head (the query heads of a KV head over s CTAs), dK, dV summed in float32
# Round A (06:20 UTC, docs/hopper.md) timed the chain, the fixed-point dQ, 128-query steps, GRID 1, the step order,
# the split and L2 sections; unordered adds with sections of 8 and GRID 1 ran 486 TF/s at GQA (1.04x cuDNN).
# Round B: sections (bwd_sections, which renders with the fixed-point dQ and launches its modes one program per
# tile) of 4, 8, 16 for the fixed-point (deterministic) and unordered modes; the round A baselines beside.
F = {"bwd_fixed": 1}
JOBS = {
    "c64-fix": (C_C64, "gluon", F, None, 1, ("fixed", )),
    "c64-F8": (C_C64, "gluon", {**F, "bwd_sections": 8}, None, 1, ("fixed", "unord")),
    "c64-F16": (C_C64, "gluon", {**F, "bwd_sections": 16}, None, 1, ("fixed", "unord")),
    "c64-tri": (C_C64, "triton", {}, None, 1, ("triton", )),
    "f64-fix": (C_F64, "gluon", F, None, 1, ("fixed", )),
    "f64-F8": (C_F64, "gluon", {**F, "bwd_sections": 8}, None, 1, ("fixed", "unord")),
    "f64-F16": (C_F64, "gluon", {**F, "bwd_sections": 16}, None, 1, ("fixed", "unord")),
    "f64-tri": (C_F64, "triton", {}, None, 1, ("triton", )),
    "gqa": (C_GQA, "gluon", {}, None, 1, ("chain", )),
    "gqa-F4": (C_GQA, "gluon", {**F, "bwd_sections": 4}, None, 1, ("fixed", "unord")),
    "gqa-F8": (C_GQA, "gluon", {**F, "bwd_sections": 8}, None, 1, ("fixed", "unord")),
    "gqa-F16": (C_GQA, "gluon", {**F, "bwd_sections": 16}, None, 1, ("fixed", "unord")),
    "gqa-F8u0": (C_GQA, "gluon", {**F, "bwd_sections": 8, "bwd_unordered_levers": {}}, None, 1, ("fixed", "unord")),
    "gqa-tri": (C_GQA, "triton", {}, None, 1, ("triton", )),
    "g64-fix": (C_G64, "gluon", F, None, 1, ("fixed", )),
    "g64-F8": (C_G64, "gluon", {**F, "bwd_sections": 8}, None, 1, ("fixed", "unord")),
    "g64-tri": (C_G64, "triton", {}, None, 1, ("triton", )),
}
# GRID 1 as a flag (the module's _NUM_SMS past the tile count): the fixed-point renders without sections
GRID1 = {("c64-fix", "fixed"), ("f64-fix", "fixed"), ("g64-fix", "fixed")}
WARM_LIMIT, TIME_LIMIT = 38, 27
BOUND = 6e-3  # relative L2 error of each gradient against float64 (bf16: the Gluon / Triton backwards give ~2.4e-3)
DEV_BIG = 1 << 30  # _NUM_SMS[dev] past any tile count: one program per tile (GRID 1)


def log(*parts):
    print(*parts, flush=True)


_MODULES = {}


def module(job):
    """The job's module (kept per process)"""
    if job not in _MODULES:
        _MODULES[job] = _module(job)
    return _MODULES[job]


def _module(job):
    """The job's module: fagen.load for a plain render, else the gluon bwd render with GluonBackend.variant updated
    (and BWD_BLOCK_M replaced), loaded under its own name."""
    import fagen
    from fagen import backends
    from fagen.codegen import render as _render
    from fagen.runtime.loader import load_source
    from fagen.spec.kernel import KernelSpec
    case, backend, over, bm, split, _ = JOBS[job]
    b, hq, hkv, s, d, causal, _ = CASES[case]
    spec = KernelSpec(head_dim=d, mask="causal" if causal else "none", gqa=hq // hkv // split, dtype="bf16",
                      direction="bwd", backend=backend)
    if not over and bm is None:
        return fagen.load(spec)
    saved = dict(backends.GLUON.variant)
    backends.GLUON.variant.update(over)
    _render.render.cache_clear()
    try:
        source = fagen.generate(spec)
    finally:
        backends.GLUON.variant.clear()
        backends.GLUON.variant.update(saved)
        _render.render.cache_clear()
    tag = "_".join(f"{k}{len(v) if isinstance(v, dict) else v}" for k, v in over.items())
    if bm is not None:
        assert "\nBWD_BLOCK_M = 64\n" in source, "the render's BWD_BLOCK_M line moved"
        assert "gl.static_assert(BLOCK_M == 64)" in source, "the render's BLOCK_M assertion moved"
        source = source.replace("\nBWD_BLOCK_M = 64\n", f"\nBWD_BLOCK_M = {bm}\n").replace(
            "gl.static_assert(BLOCK_M == 64)", f"gl.static_assert((BLOCK_M == 64) | (BLOCK_M == {bm}))")
        tag += f"_m{bm}"
    return load_source(source, f"{spec.name}_{tag}")


def inputs(b, hq, hkv, sq, sk, d, seed=0):
    import torch
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(shape, generator=g, device="cuda").bfloat16()
            for shape in ((b, hq, sq, d), (b, hkv, sk, d), (b, hkv, sk, d), (b, hq, sq, d))]


def reference(q, k, v, do, causal, scale):
    """float64 autograd gradients, bottom-right causal."""
    import torch
    gqa = q.shape[1] // k.shape[1]
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    kk, vv = (t.repeat_interleave(gqa, dim=1) for t in (k64, v64))
    s = (q64 @ kk.transpose(-1, -2)) * scale
    if causal:
        sq, sk = q.shape[2], k.shape[2]
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        s = s.masked_fill(j > i + (sk - sq), float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return torch.autograd.grad(p @ vv, (q64, k64, v64), do.double())


def rel(a, b):
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()


def backward_fn(job, mod, fwd, q, k, v, do, mode, grid1=False):
    """A closure running one backward of `job` in `mode` on (q, k, v, do); (out, lse) from `fwd` (the job case's own
    forward module: a split's module is of another gqa). Returns (dq, dk, dv)."""
    import torch
    case, backend, _, _, split, _ = JOBS[job]
    d = CASES[case][4]
    scale = d ** -0.5
    out, lse = fwd.forward(q, k, v, scale=scale)
    dev = q.get_device()
    if backend == "triton":
        return lambda: mod.backward(do, q, k, v, out, lse, scale=scale)
    kw = {"deterministic": mode != "unord"}

    def run():
        saved = mod._NUM_SMS.get(dev)
        if grid1:
            mod._NUM_SMS[dev] = DEV_BIG
        try:
            if split == 1:
                return mod.backward(do, q, k, v, out, lse, scale=scale, **kw)
            # the query heads of KV head h over `split` CTAs: K, V repeated (virtual KV heads h * split + i), the
            # deterministic kernel's dK, dV partials in float32 ([Note] GQA split in the backward), summed in order
            ks, vs = k.repeat_interleave(split, dim=1), v.repeat_interleave(split, dim=1)
            dq = torch.empty_like(q)
            dks = torch.empty(ks.shape, dtype=torch.float32, device=q.device)
            dvs = torch.empty_like(dks)
            mod._bwd_host(do, q, ks, vs, out, lse, scale, dq, dks, dvs, mod.BWD_DET_MODE if mode != "unord" else 1)
            b, hkv, sk, dd = k.shape
            return (dq, dks.view(b, hkv, split, sk, dd).sum(2).to(k.dtype),
                    dvs.view(b, hkv, split, sk, dd).sum(2).to(v.dtype))
        finally:
            if grid1:
                if saved is None:
                    mod._NUM_SMS.pop(dev, None)
                else:
                    mod._NUM_SMS[dev] = saved
    return run


def forward_module(job):
    """The forward that gives (out, lse) for the job's case: the case's plain gluon module (any render's forward is
    the same kernel; the Triton jobs use their own)."""
    import fagen
    from fagen.spec.kernel import KernelSpec
    case, backend, _, _, _, _ = JOBS[job]
    b, hq, hkv, s, d, causal, _ = CASES[case]
    return fagen.load(KernelSpec(head_dim=d, mask="causal" if causal else "none", gqa=hq // hkv, dtype="bf16",
                                 direction="bwd", backend=backend))


# -- phases --------------------------------------------------------------------------------------------------
def phase_warm(results, job):
    """Build the job, check each mode against float64 at the case's check shape (and GRID 1 where timed), exact
    zeros of row 0 (causal), then the real shape once per mode: deterministic modes twice and under GRID 1, all
    bitwise equal."""
    import torch
    t0 = time.time()
    case, backend, _, _, _, modes = JOBS[job]
    b, hq, hkv, s, d, causal, (cb, chq, chkv, csq, csk) = CASES[case]
    mod, fwd = module(job), forward_module(job)
    q, k, v, do = inputs(cb, chq, chkv, csq, csk, d)
    ref = reference(q, k, v, do, causal, d ** -0.5)
    ready = []
    for mode in modes:
        for g1 in ((False, True) if (job, mode) in GRID1 else (False, )):
            label = mode + (" g1" if g1 else "")
            got = backward_fn(job, mod, fwd, q, k, v, do, mode, g1)()
            errs = [rel(x, r) for x, r in zip(got, ref)]
            ok = all(e <= BOUND for e in errs) and all(bool(torch.isfinite(x).all()) for x in got)
            zeros = ""
            if causal and csq == csk:
                z = bool((got[0][:, :, 0] == 0).all())
                ok, zeros = ok and z, f", dq row 0 {'== 0' if z else '!= 0 FAIL'}"
            log(f"check {job:<9} {label:<9} B{cb} H{chq}/{chkv} {csq}x{csk}: rel dq {errs[0]:.2e} dk {errs[1]:.2e} "
                f"dv {errs[2]:.2e}{zeros} -> {'PASS' if ok else 'FAIL'}")
            results.append(dict(job=job, mode=label, check="float64", ok=ok))
    q, k, v, do = inputs(b, hq, hkv, s, s, d, seed=1)
    for mode in modes:
        runs = [backward_fn(job, mod, fwd, q, k, v, do, mode)()]
        if mode != "unord":
            runs.append(backward_fn(job, mod, fwd, q, k, v, do, mode)())
        if (job, mode) in GRID1:
            runs.append(backward_fn(job, mod, fwd, q, k, v, do, mode, True)())
        torch.cuda.synchronize()
        if mode == "unord":
            same = all(torch.equal(a, c) for r in runs[1:] for a, c in zip(r[1:], runs[0][1:]))  # dk, dv
        else:
            same = all(torch.equal(a, c) for r in runs[1:] for a, c in zip(r, runs[0]))
        log(f"real  {job:<9} {mode:<9} x{len(runs)} {'bitwise equal' if same else 'DIFFER'}"
            f"{' (dk, dv)' if mode == 'unord' else ''} ({time.time() - t0:.1f}s)")
        results.append(dict(job=job, mode=mode, check="bitwise", ok=same or backend == "triton"))
        ready.append(mode)
        del runs
    results.append(dict(job=job, ready=ready))


def phase_time(results, ready):
    """TF/s of every ready (job, mode) beside cuDNN, case by case, backward only (do_bench median)."""
    import torch
    import triton
    for case, (b, hq, hkv, s, d, causal, _) in CASES.items():
        flops = 2.5 * 4 * b * hq * s * s * d * (0.5 if causal else 1.0)
        q, k, v, do = inputs(b, hq, hkv, s, s, d, seed=2)
        row = dict(case=case)
        runs = [("cudnn", None, None, False)]
        for job, (c, _, _, _, _, modes) in JOBS.items():
            if c == case:
                runs += [(job, mode, g1) for mode in modes if mode in ready.get(job, ())
                         for g1 in ((False, True) if (job, mode) in GRID1 else (False, ))]
        for run in runs:
            label = "cudnn" if run[0] == "cudnn" else f"{run[0]} {run[1]}" + (" g1" if run[2] else "")
            try:
                if run[0] == "cudnn":
                    from torch.nn.attention import SDPBackend, sdpa_kernel
                    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        out = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=causal,
                                                                               enable_gqa=hq != hkv)
                    step = lambda: torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True)  # noqa: E731
                else:
                    job, mode, g1 = run
                    step = backward_fn(job, module(job), forward_module(job), q, k, v, do, mode, g1)
                step()
                torch.cuda.synchronize()
                ms = triton.testing.do_bench(step, warmup=3, rep=25)
                row[label] = flops / ms / 1e9
                ratio = f"{row[label] / row['cudnn']:.2f}x cudnn" if "cudnn" in row else ""
                log(f"{case:<28} {label:<18} {ms:8.3f} ms {row[label]:6.1f} TF/s {ratio}")
            except Exception as e:
                log(f"{case:<28} {label:<18} ERROR {type(e).__name__}: {str(e)[:200]}")
        print("ROW " + json.dumps(row), flush=True)  # the parent's table (kept if the phase is killed later)
        torch.cuda.empty_cache()


def dry_run():
    """Any machine: render every job, build the new renders (128-query steps, the unordered kernel without levers)
    for sm_90 and print ptxas's numbers."""
    sys.path.insert(0, str(ROOT / "tests"))
    from sm90 import ptxas
    ok = True
    for job, (case, backend, over, bm, split, modes) in JOBS.items():
        try:
            mod = module(job)
            line = f"dry {job:<9} {mod.__name__}"
            if backend == "gluon" and job in ("gqa-F8", "c64-F8", "f64-F8"):
                for mode in modes:
                    ck = mod.compile_backward_for(deterministic=mode != "unord")
                    res = next(iter(ptxas(ck.asm["ptx"])[0].values()))
                    line += f" | {mode}: shared {ck.metadata.shared} B, spills {res.spill_stores}/{res.spill_loads} B"
            log(line)
        except Exception as e:
            ok = False
            log(f"dry {job}: ERROR {type(e).__name__}: {str(e)[:300]}")
    log(f"dry run: {'OK' if ok else 'FAILED'}")
    return ok


# -- driver --------------------------------------------------------------------------------------------------
def run_phase(name, ready_json="{}"):
    import torch
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        log(f"{name}: needs an sm_90 GPU")
        return []
    results = []
    try:
        if name.startswith("warm:"):
            phase_warm(results, name[5:])
        elif name == "time":
            phase_time(results, json.loads(ready_json))
    except Exception as e:
        log(f"{name}: ERROR {type(e).__name__}: {e}")
        traceback.print_exc()
    print("RESULTS " + json.dumps(results), flush=True)
    return results


def table(rows):
    """One block per case: TF/s of each label and its ratio to cuDNN."""
    log("\n| case | label | TF/s | / cudnn |")
    log("|---|---|---:|---:|")
    for r in rows:
        for label, tf in r.items():
            if label != "case":
                ratio = f"{tf / r['cudnn']:.2f}x" if "cudnn" in r else "-"
                log(f"| {r['case']} | {label} | {tf:.0f} | {ratio} |")
    log("(bf16, backward only, TF/s = 2.5 x forward FLOPs / do_bench median; chain = fixed-order float32 dQ adds "
        "(the default deterministic mode), fixed = variant bwd_fixed, unord = deterministic=False, g1 = GRID 1, "
        "S2/S4 = query heads split over 2/4 CTAs (bwd_gqa_split), "
        "u0 = the unordered kernel without levers, m128 = 128-query steps, mm = query block major GQA steps, "
        "h8 = L2 sections of 8 heads)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phase", help="one phase here (no child): warm:JOB or time")
    ap.add_argument("--ready", default=None, help="time: the ready modes per job (JSON), default every job's")
    args = ap.parse_args()
    if os.environ.get("GPU_GQA64_DRY"):
        sys.exit(0 if dry_run() else 1)
    if args.phase:
        ready = args.ready if args.ready is not None else json.dumps({job: list(j[-1]) for job, j in JOBS.items()})
        run_phase(args.phase, ready)
        return
    t0 = time.time()
    env = child_env("/tmp/fagen-cache-gpu-gqa64", ROOT)
    log(f"#### phase warm: {len(JOBS)} children at once (timeout {WARM_LIMIT}s)")
    tmp = tempfile.mkdtemp(prefix="gqa64-")
    files = {job: open(os.path.join(tmp, f"{job}.log"), "w+") for job in JOBS}  # no pipe to fill up
    procs = {job: subprocess.Popen([sys.executable, __file__, "--phase", f"warm:{job}"], env=env,
                                   stdout=files[job], stderr=subprocess.STDOUT, text=True) for job in JOBS}
    deadline = time.time() + WARM_LIMIT
    ready, checks, logs = {}, [], []
    for job, p in procs.items():
        try:
            p.wait(timeout=max(deadline - time.time(), 0.1))
            killed = ""
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            killed = f"warm:{job} killed (timeout)\n"
        files[job].seek(0)
        outs = files[job].read() + killed
        logs.append(outs)
        for line in outs.splitlines():
            if line.startswith("RESULTS "):
                for r in json.loads(line[8:]):
                    if "ready" in r:
                        ready[job] = r["ready"]
                    else:
                        checks.append(r)
            elif line.startswith(("check", "real", "warm", "Traceback")) or "Error" in line:
                print(line, flush=True)
    bad = [f"{r['job']} {r['mode']} {r['check']}" for r in checks if not r["ok"]]
    log(f"#### warm: {len(ready)}/{len(JOBS)} jobs ready, checks {'ALL PASS' if not bad else 'FAILED: ' + ', '.join(bad)}"
        f" ({time.time() - t0:.0f}s)")
    rows = []
    rc, lines = run_child(__file__, "time", min(TIME_LIMIT, max(5.0, 68 - (time.time() - t0))), env,
                          lambda line: line.startswith(("RESULTS ", "ROW ")) or print(line, end="", flush=True),
                          ("--ready", json.dumps(ready)))
    for line in lines:
        if line.startswith("ROW "):
            rows.append(json.loads(line[4:]))
    logs += lines
    log(f"#### phase time: rc={rc}, {time.time() - t0:.0f}s so far")
    table(rows)
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "gpu_gluon_bwd_gqa64.log").write_text("".join(logs))


if __name__ == "__main__":
    main()
