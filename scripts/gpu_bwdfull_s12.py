"""The d128 full backward row (issue 28, twelfth session, helper bwdfull) on an H100.

    PYTHONPATH=$PWD python3 scripts/gpu_bwdfull_s12.py           # every phase, each in a child with a timeout
    python scripts/gpu_bwdfull_s12.py --phase time               # one phase here (no child, no timeout)
    GPU_BWDFULL_DRY=1 python scripts/gpu_bwdfull_s12.py          # any machine: renders (=2: sm_90 builds, ptxas)

Target (bf16, B1 H16 s16k, cuDNN via SDPA in the same process): deterministic=False >= 1.0x cuDNN with margin, the
deterministic mode's margin over 0.95x. Candidates (variant bwd_full_levers inside bwd_d128, the unordered kernel
of plain full specs, which serves DQ_MODE 1 and 2): the causal kernel's levers (named barriers 2, TMA epilogue) and
staggered walks (bwd_stagger s: key block n starts at query block n s; removed after round A), the persistent
grid in modes 1 and 2 (bwd_persist 1; main: one program per tile with L2 sections).
Phases: `warm` (one child per job, all at once: build; float64 at small shapes whose lengths are not multiples of
the blocks, Sk = 1 rows' exact zeros (dq = dk = 0), the real shape twice bitwise in the deterministic mode; a
mutant's check must FAIL), `time` (one child: float64 gradients of head 0 at the real shape, each row's error
there, then TF/s in rotated passes beside cuDNN, medians; the forward's default and two tile orders beside
cuDNN's forward, checked first: out and lse against float64 at odd shapes with more tiles than SMs, bitwise twice).
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

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/, for _phases and _bwd_timing
from _phases import child_env, run_phase as run_child  # noqa: E402
import _bwd_timing as bt  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ROUND = os.environ.get("BWDFULL_ROUND", "A")
D, B, H, S = 128, 1, 16, 16384
CASE = "d128 full B1 H16 s16k"
# check shapes (B, H, Sq, Sk): lengths not multiples of 64 / 128, Sq < Sk and Sq > Sk (walks that wrap), Sk = 1
CHECKS = ((1, 16, 208, 336), (1, 4, 1000, 700), (1, 4, 333, 1))
PASSES = 4 if ROUND == "A" else 6
D128 = {"bwd_fixed": 1, "bwd_fixed_tma": 1, "bwd_sections": 4}  # main's bwd_d128
L = {"bwd_named": 2, "bwd_epi_tma": 1}  # the causal unordered kernel's levers (its snake is idle on one program a tile)


def full(**levers):
    return {"bwd_d128": {**D128, "bwd_full_levers": levers}}


# the stagger mutant: the dQ warp walks unstaggered (adds each partial into another query block's rows). Round A's
# S*, LS2* and this mutant need the stagger, which left the template after round A: run them at e582cfa.
MSTAG = ("off = _bwd_stagger(n_blk, GQA * steps, 2)  # [Note] Staggered walks\n        n_steps = GQA * steps",
         "off = 0\n        n_steps = GQA * steps")
# the qmul rows mutant: the producer brings the delta rows in place of qmul (the tenth session's)
MROWS = ("[num_bh * GQA + off_b * num_heads + h0 + g, m0]", "[off_b * num_heads + h0 + g, m0]")
# the TMA epilogue mutant: dK goes out through DV's descriptor (DK is never written, DV gets dK)
MEPI = ("tma.async_copy_shared_to_global(DK, [off_b, off_hkv, n0 + WG * WN, 0], stage4)",
        "tma.async_copy_shared_to_global(DV, [off_b, off_hkv, n0 + WG * WN, 0], stage4)")
# job -> (variant overrides, modes, mutant); modes 'fixed' (deterministic=True: DQ_MODE 2), 'unord' (False)
if ROUND == "A":
    JOBS = {"def": ({}, ("fixed", "unord"), None),
            "L": (full(**L), ("fixed", "unord"), None),
            "S1": (full(bwd_stagger=1), ("fixed", "unord"), None),
            "S2": (full(bwd_stagger=2), ("fixed", "unord"), None),
            "LS2": (full(**L, bwd_stagger=2), ("fixed", "unord"), None),
            "P": (full(bwd_persist=1), ("fixed", "unord"), None),
            "LS2P": (full(**L, bwd_stagger=2, bwd_persist=1), ("fixed", "unord"), None),
            "S2mut!": (full(bwd_stagger=2), ("fixed", ), MSTAG)}
    # the forward of the full mask in another tile order (variant full_order: _SCHED 1 paired, 3 the counter over L2
    # sections of heads): the sixth session's one run read paired 696 against the plain loop's 648 (docs/hopper.md,
    # "Tile order"). Round A measured no win and full_order left the code (f70355b): these renders are the default
    # now; e582cfa's script and code time them as round A did.
    FJOBS = {"fwd-def": {}, "fwd-P1": {"full_order": 1}, "fwd-P3": {"full_order": 3}}
else:
    # round B (17:38 UTC): the flipped default (bwd_d128's full levers: named 2 + TMA epilogue; round A deterministic
    # 543 against 512) against main's render, and with the persistent grid beside it; the forward as it is; the new
    # default's dQ path under two mutants (the qmul rows, the TMA epilogue) must fail
    JOBS = {"def": ({}, ("fixed", "unord"), None),
            "old": ({"bwd_d128": D128}, ("fixed", "unord"), None),
            "LP": (full(**L, bwd_persist=1), ("fixed", "unord"), None),
            "mrows!": ({}, ("fixed", ), MROWS),
            "mepi!": ({}, ("fixed", ), MEPI)}
    FJOBS = {"fwd-def": {}}
FSPEC = dict(head_dim=D, mask="none", gqa=1, dtype="bf16", backend="gluon")
FCHECKS = ((1, 16, 1500, 1500), (2, 4, 1000, 333), (1, 3, 200, 1100))  # more tiles than SMs; odd lengths
WARM_LIMIT, TIME_LIMIT, TOTAL = 30, 36, 68
BOUND = 6e-3  # relative L2 error of each gradient against float64 (bf16: ~2.4e-3)
SPEC = dict(head_dim=D, mask="none", gqa=1, dtype="bf16", direction="bwd", backend="gluon")


def log(*parts):
    print(*parts, flush=True)


_MODULES = {}


def module(job):
    if job not in _MODULES:
        over, _, mut = JOBS[job]
        _MODULES[job] = bt.module(SPEC, over, mut, tag=job.replace("!", ""))
    return _MODULES[job]


def fmodule(job):
    if job not in _MODULES:
        _MODULES[job] = bt.module(FSPEC, FJOBS[job], tag=job.replace("-", ""))
    return _MODULES[job]


def forward_reference(q, k, v, scale):
    """float64 (out, lse) of the full mask."""
    import torch
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    lse = torch.logsumexp(s, -1)
    return torch.softmax(s, -1) @ v.double(), lse


def phase_fwarm(results, job):
    """A forward render: float64 out and lse at odd shapes (more tiles than SMs), twice bitwise at the real shape."""
    import torch
    t0 = time.time()
    mod, ok_all = fmodule(job), True
    sched = re.findall(r"^_SCHED = (\d)", Path(mod.__file__).read_text(), flags=re.M)
    log(f"fcheck {job:<7} the render's tile order: {'_SCHED ' + sched[0] if sched else 'the plain loop'}")
    for cb, ch, csq, csk in FCHECKS:
        q, k, v, _ = bt.inputs(D, cb, ch, ch, csq, csk, seed=csq + 7)
        out, lse = mod.forward(q, k, v, scale=D ** -0.5)
        ro, rl = forward_reference(q, k, v, D ** -0.5)
        eo, el = bt.rel(out, ro), (lse.double() - rl).abs().max().item()
        ok = eo <= BOUND and el <= 1e-3 and bool(torch.isfinite(out).all())
        ok_all = ok_all and ok
        log(f"fcheck {job:<7} B{cb} H{ch} {csq}x{csk}: rel out {eo:.2e}, max lse err {el:.1e} -> "
            f"{'PASS' if ok else 'FAIL'} ({time.time() - t0:.1f}s)")
        results.append(dict(job=job, mode="fwd", check=f"float64 {csq}x{csk}", ok=ok))
    q, k, v, _ = bt.inputs(D, B, H, H, S, S, seed=1)
    a, b = mod.forward(q, k, v, scale=D ** -0.5), mod.forward(q, k, v, scale=D ** -0.5)
    torch.cuda.synchronize()
    same = torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    log(f"freal  {job:<7} x2 {'bitwise equal' if same else 'DIFFER'} ({time.time() - t0:.1f}s)")
    results.append(dict(job=job, mode="fwd", check="bitwise", ok=same))
    results.append(dict(job=job, ready=["fwd"]))


def backward_fn(job, q, k, v, do, mode):
    mod, fwd = module(job), module("def")
    scale = q.shape[-1] ** -0.5
    out, lse = fwd.forward(q, k, v, scale=scale)
    det = mode != "unord"
    return lambda: mod.backward(do, q, k, v, out, lse, scale=scale, deterministic=det)


# -- phases --------------------------------------------------------------------------------------------------
def phase_warm(results, job):
    import torch
    t0 = time.time()
    _, modes, mut = JOBS[job]
    ok_all = True
    for cb, ch, csq, csk in CHECKS:
        q, k, v, do = bt.inputs(D, cb, ch, ch, csq, csk, seed=csq)
        ref = bt.reference(q, k, v, do, False, D ** -0.5)
        for mode in modes:
            got = backward_fn(job, q, k, v, do, mode)()
            errs = [bt.rel(x, r) for x, r in zip(got, ref)]
            ok = all(bool(torch.isfinite(x).all()) for x in got)
            zeros = ""
            if csk == 1:  # every row sees one key: dS = 0, so dq = dk = 0 exactly; dv = the sum of dO
                z = bool((got[0] == 0).all()) and bool((got[1] == 0).all())
                ok, zeros = ok and z and errs[2] <= BOUND, f", dq dk {'== 0' if z else '!= 0'}"
            else:
                ok = ok and all(e <= BOUND for e in errs)
            ok_all = ok_all and ok
            verdict = "" if mut else f" -> {'PASS' if ok else 'FAIL'}"
            log(f"check {job:<7} {mode:<6} B{cb} H{ch} {csq}x{csk}: rel dq {errs[0]:.2e} dk {errs[1]:.2e} "
                f"dv {errs[2]:.2e}{zeros}{verdict} ({time.time() - t0:.1f}s)")
            if not mut:
                results.append(dict(job=job, mode=mode, check=f"float64 {csq}x{csk}", ok=ok))
    if mut:
        log(f"check {job:<7} mutant: {'caught' if not ok_all else 'NOT CAUGHT'}")
        results.append(dict(job=job, mode="mutant", check="must fail", ok=not ok_all))
        results.append(dict(job=job, ready=[]))
        return
    ready = []
    q, k, v, do = bt.inputs(D, B, H, H, S, S, seed=1)
    for mode in modes:
        runs = [backward_fn(job, q, k, v, do, mode)() for _ in range(1 if mode == "unord" else 2)]
        torch.cuda.synchronize()
        same = all(torch.equal(a, c) for r in runs[1:] for a, c in zip(r, runs[0]))
        log(f"real  {job:<7} {mode:<6} x{len(runs)} {'bitwise equal' if same else 'DIFFER'} ({time.time() - t0:.1f}s)")
        results.append(dict(job=job, mode=mode, check="bitwise", ok=same))
        ready.append(mode)
        del runs
    results.append(dict(job=job, ready=ready))
    if job == "def":  # the public path takes the default render, bitwise twice
        try:
            import fagen
            from fagen.runtime import hopper
            from fagen.spec.kernel import KernelSpec
            want = hopper.backward_spec(KernelSpec(head_dim=D, mask="none", dtype="bf16", direction="bwd"), q.device)
            picked = fagen.load(want)
            grads = []
            for _ in range(2):
                leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
                out = fagen.attention(*leaves, mask="none")
                grads.append(torch.autograd.grad(out, leaves, do))
            torch.cuda.synchronize()
            same = all(torch.equal(a, c) for a, c in zip(*grads))
            src = Path(picked.__file__).read_text()
            ok = same and picked.BWD_DET_MODE == 2 and (ROUND == "A" or "_attn_bwd_hopper_u" in src)
            log(f"route {job:<7} fagen.attention: {want.name if want else None} (BWD_DET_MODE {picked.BWD_DET_MODE}, "
                f"_u kernel {'yes' if '_attn_bwd_hopper_u' in src else 'no'}), x2 "
                f"{'bitwise equal' if same else 'DIFFER'} -> "
                f"{'PASS' if ok else 'FAIL'}")
            results.append(dict(job=job, mode="route", check="fagen.attention", ok=ok))
        except Exception as e:  # the route check must not keep the job from its timing
            log(f"route {job:<7} ERROR {type(e).__name__}: {str(e)[:200]}")


def phase_time(results, ready):
    """Float64 gradients of head 0 at the real shape, each row's error there, then TF/s in rotated passes."""
    import torch
    import triton
    t0 = time.time()
    flops = 2.5 * 4 * B * H * S * S * D
    q, k, v, do = bt.inputs(D, B, H, H, S, S, seed=2)
    ref = bt.reference(q[:1, :1], k[:1, :1], v[:1, :1], do[:1, :1], False, D ** -0.5)
    torch.cuda.synchronize()
    log(f"{CASE}: float64 head 0 in {time.time() - t0:.1f}s")
    steps, errs = {"cudnn": bt.cudnn_backward(q, k, v, do, False)}, {}
    for job, (_, modes, _) in JOBS.items():
        for mode in modes:
            if mode in ready.get(job, ()):
                steps[f"{job} {mode}"] = backward_fn(job, q, k, v, do, mode)
    for label, step in list(steps.items()):
        try:
            got = step()
            torch.cuda.synchronize()
            errs[label] = [bt.rel(x[:1, :1], r) for x, r in zip(got, ref)]
            del got
        except Exception as e:
            log(f"{label}: ERROR {type(e).__name__}: {str(e)[:200]}")
            del steps[label]
    del ref
    for label, e in errs.items():
        log(f"{CASE:<22} {label:<12} head0 f64 rel dq {e[0]:.2e} dk {e[1]:.2e} dv {e[2]:.2e}")
    # the forward (issue 28's other d128 full row): the product's render and the tile orders, against cuDNN's
    scale = D ** -0.5
    for job in FJOBS:
        if "fwd" in ready.get(job, ()):
            steps["fwd " + ("fagen" if job == "fwd-def" else job[4:])] = (
                lambda m=fmodule(job): m.forward(q, k, v, scale=scale))
    steps["fwd cudnn"] = bt.cudnn_forward(q, k, v, False)
    tfs = {label: [] for label in steps}
    for p, label in bt.rotated(list(steps), PASSES):
        try:
            ms = triton.testing.do_bench(steps[label], warmup=5, rep=40)
            tf = flops / (2.5 if label.startswith("fwd") else 1.0) / ms / 1e9
            tfs[label].append(tf)
            log(f"pass {p} {label:<12} {ms:7.3f} ms {tf:6.1f} TF/s")
        except Exception as e:
            log(f"pass {p} {label:<12} ERROR {type(e).__name__}: {str(e)[:200]}")
    print("ROW " + json.dumps(dict(case=CASE, tfs=tfs, errs=errs)), flush=True)


# d64 full B1 H32 s16k (not a standard row: 0.93x cuDNN in the eleventh session): its default (bwd_d64: fixed-point dQ,
# sections of 8, qmul rows by TMA; the lever-free kernel) against the same with the full levers (L), round B only
D64 = {"bwd_fixed": 1, "bwd_sections": 8, "bwd_fixed_tma": 1}
D64JOBS = {"6-old": {"bwd_d64": D64}, "6-L": {"bwd_d64": {**D64, "bwd_full_levers": L}}} if ROUND != "A" else {}
D64_LIMIT = 20


def phase_d64(results, time_it=True):
    """Build, check (float64 at 208 x 336, Sk = 1's exact zeros, bitwise twice at s16k) and time d64 full (the warm
    phase builds and checks only: the compiles are cached for the timing child)."""
    import torch
    import triton
    t0, d, h = time.time(), 64, 32
    spec = dict(SPEC, head_dim=d)
    mods = {job: bt.module(spec, over, tag=job.replace("-", "")) for job, over in D64JOBS.items()}
    fwd = mods["6-old"]

    def step(job, q, k, v, do, mode):
        out, lse = fwd.forward(q, k, v, scale=d ** -0.5)
        return lambda: mods[job].backward(do, q, k, v, out, lse, scale=d ** -0.5, deterministic=mode != "unord")
    ok_jobs = []
    for job in mods:
        ok = True
        for cb, ch, csq, csk in ((1, 32, 208, 336), (1, 4, 333, 1)):
            q, k, v, do = bt.inputs(d, cb, ch, ch, csq, csk, seed=csq)
            ref = bt.reference(q, k, v, do, False, d ** -0.5)
            for mode in ("fixed", "unord"):
                got = step(job, q, k, v, do, mode)()
                errs = [bt.rel(x, r) for x, r in zip(got, ref)]
                good = all(bool(torch.isfinite(x).all()) for x in got)
                good = good and (bool((got[0] == 0).all() and (got[1] == 0).all()) if csk == 1
                                 else all(e <= BOUND for e in errs))
                ok = ok and good
                log(f"check {job:<7} {mode:<6} B{cb} H{ch} {csq}x{csk}: rel dq {errs[0]:.2e} dk {errs[1]:.2e} dv "
                    f"{errs[2]:.2e} -> {'PASS' if good else 'FAIL'} ({time.time() - t0:.1f}s)")
        q, k, v, do = bt.inputs(d, 1, h, h, S, S, seed=1)
        a, b = step(job, q, k, v, do, "fixed")(), step(job, q, k, v, do, "fixed")()
        torch.cuda.synchronize()
        same = all(torch.equal(x, y) for x, y in zip(a, b))
        log(f"real  {job:<7} fixed  x2 {'bitwise equal' if same else 'DIFFER'} ({time.time() - t0:.1f}s)")
        results.append(dict(job=job, mode="d64", check="float64 + bitwise", ok=ok and same))
        if ok and same:
            ok_jobs.append(job)
        del a, b
    if not time_it:
        results.append(dict(job="d64", ready=["d64"]))
        return
    q, k, v, do = bt.inputs(d, 1, h, h, S, S, seed=2)
    steps = {"cudnn": bt.cudnn_backward(q, k, v, do, False)}
    for job in ok_jobs:
        for mode in ("fixed", "unord"):
            steps[f"{job[2:]} {mode}"] = step(job, q, k, v, do, mode)
    flops = 2.5 * 4 * h * S * S * d
    tfs = {label: [] for label in steps}
    for p, label in bt.rotated(list(steps), 4):
        ms = triton.testing.do_bench(steps[label], warmup=5, rep=40)
        tfs[label].append(flops / ms / 1e9)
        log(f"pass {p} d64 {label:<10} {ms:7.3f} ms {tfs[label][-1]:6.1f} TF/s")
    print("ROW " + json.dumps(dict(case="d64 full B1 H32 s16k", tfs=tfs, errs={})), flush=True)


def dry_run():
    sys.path.insert(0, str(ROOT / "tests"))
    from sm90 import ptxas
    ok = True
    for job, (over, modes, mut) in JOBS.items():
        try:
            mod = module(job)
            line = f"dry {job:<7} {mod.__name__}"
            if os.environ.get("GPU_BWDFULL_DRY") == "2" and not mut:
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
        if name == "warm:d64":
            phase_d64(results, time_it=False)
        elif name.startswith("warm:fwd"):
            phase_fwarm(results, name[5:])
        elif name.startswith("warm:"):
            phase_warm(results, name[5:])
        elif name == "time":
            phase_time(results, json.loads(ready_json))
        elif name == "d64":
            phase_d64(results)
    except Exception as e:
        log(f"{name}: ERROR {type(e).__name__}: {e}")
        traceback.print_exc()
    print("RESULTS " + json.dumps(results), flush=True)
    return results


def table(rows):
    for r in rows:
        log(f"\n| case | row | TF/s, passes in run order | median | / cuDNN median |")
        log("|---|---|---|---:|---:|")
        bwd = {k: v for k, v in r["tfs"].items() if not k.startswith("fwd")}
        bt.medians_table(r["case"], bwd, log=log)
        fwd = {k[4:]: v for k, v in r["tfs"].items() if k.startswith("fwd")}
        if fwd:
            bt.medians_table(r["case"] + " fwd", fwd, log=log)
    log("(bf16, TF/s = (2.5 x for the backward) forward FLOPs / do_bench median; fixed = deterministic mode "
        "(DQ_MODE 2), unord = deterministic=False; def = the branch's default (round B: L flipped on), old = main's; L = bwd_full_levers named 2 + TMA epilogue; "
        "Sn = bwd_stagger n; P = bwd_persist 1; fwd P1 / P3 = the forward with full_order 1 (paired) / 3 "
        "(L2 sections); passes rotated: pass p starts at row p)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phase", help="one phase here (no child): warm:JOB or time")
    ap.add_argument("--ready", default=None, help="time: the ready modes per job (JSON), default every job's")
    args = ap.parse_args()
    if os.environ.get("GPU_BWDFULL_DRY"):
        sys.exit(0 if dry_run() else 1)
    if args.phase:
        ready = args.ready if args.ready is not None else json.dumps(
            {**{job: list(j[1]) for job, j in JOBS.items() if not j[2]}, **{job: ["fwd"] for job in FJOBS}})
        run_phase(args.phase, ready)
        return
    t0 = time.time()
    env = child_env("/tmp/fagen-cache-gpu-bwdfull", ROOT)
    alljobs = [*JOBS, *FJOBS] + (["d64"] if D64JOBS else [])
    log(f"#### round {ROUND}, phase warm: {len(alljobs)} children at once (timeout {WARM_LIMIT}s)")
    tmp = tempfile.mkdtemp(prefix="bwdfull-")
    files = {job: open(os.path.join(tmp, f"{job.replace('!', '')}.log"), "w+") for job in alljobs}
    procs = {job: subprocess.Popen([sys.executable, __file__, "--phase", f"warm:{job}"], env=env,
                                   stdout=files[job], stderr=subprocess.STDOUT, text=True) for job in alljobs}
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
            elif line.startswith(("check", "real", "route", "warm", "fcheck", "freal", "Traceback")) or "Error" in line:
                print(line, flush=True)
    bad = [f"{r['job']} {r['mode']} {r['check']}" for r in checks if not r["ok"]]
    verdict = ("ALL PASS" if checks else "NONE RAN") if not bad else "FAILED: " + ", ".join(bad)
    log(f"#### warm: {len(ready)}/{len(alljobs)} jobs done, checks {verdict} ({time.time() - t0:.0f}s)")
    rows = []
    rc, lines = run_child(__file__, "time", min(TIME_LIMIT, max(5.0, TOTAL - (time.time() - t0))), env,
                          lambda line: line.startswith(("RESULTS ", "ROW ")) or print(line, end="", flush=True),
                          ("--ready", json.dumps(ready)))
    for line in lines:
        if line.startswith("ROW "):
            rows.append(json.loads(line[4:]))
    if not rows:  # the phase was cut short: the passes it printed
        tfs = {}
        for line in lines:
            m = re.match(r"pass (\d+) (.+?)\s+[\d.]+ ms\s+([\d.]+) TF/s", line)
            if m:
                tfs.setdefault(m.group(2), []).append(float(m.group(3)))
        rows = [dict(case=CASE + " (cut short)", tfs=tfs, errs={})] if tfs else []
    logs += lines
    log(f"#### phase time: rc={rc}, {time.time() - t0:.0f}s so far")
    if D64JOBS and TOTAL - (time.time() - t0) > 8:
        rc, lines = run_child(__file__, "d64", min(D64_LIMIT, TOTAL - (time.time() - t0)), env,
                              lambda line: line.startswith(("RESULTS ", "ROW ")) or print(line, end="", flush=True))
        rows += [json.loads(line[4:]) for line in lines if line.startswith("ROW ")]
        for line in lines:
            if line.startswith("RESULTS "):
                bad += [f"{r['job']} {r['check']}" for r in json.loads(line[8:]) if not r["ok"]]
        logs += lines
        log(f"#### phase d64: rc={rc}, checks {'ALL PASS' if not bad else 'FAILED: ' + ', '.join(bad)}, "
            f"{time.time() - t0:.0f}s so far")
    table(rows)
    out = os.environ.get("OUTX") or os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "gpu_bwdfull_s12.log").write_text("".join(logs))


if __name__ == "__main__":
    main()
