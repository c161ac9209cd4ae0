"""The standard suite's backward rows that missed (issue 28, eleventh session, helper bwdstd) on an H100.

    PYTHONPATH=$PWD python3 scripts/gpu_bwdstd_s11.py           # every phase, each in a child with a timeout
    python scripts/gpu_bwdstd_s11.py --phase time               # one phase here (no child, no timeout)
    GPU_BWDSTD_DRY=1 python scripts/gpu_bwdstd_s11.py           # any machine: renders (=2: sm_90 builds, ptxas)

Targets (bf16, cuDNN via SDPA in the same process): d64 causal B1 H32 s16k >= 0.95x in the deterministic mode;
d128 causal B1 H16 s16k >= 1.0x with deterministic=False. Round A (BWDSTD_ROUND=A) explores: at d64 the qmul rows
by TMA (bwd_fixed_tma 1, [Note] qmul rows by TMA) over bwd_d64 (fixed-point dQ, sections of 8), with sections of
4 / none, the two-limb FMA rounding (bwd_fixed_fma 3), a ring of 3 / 4 slots (bwd_ring), two dQ slots
(bwd_dq_slots 2, [Note] Two dQ slots); at d128 causal the unordered mode with sections of 2 / 8 / none and without
the snake; three passes. Round B (the default): the flipped d64 default (qmul rows by TMA) against main's at d64
causal, full and GQA 32/8 causal, with a ring of 3 slots at causal, and issue 28's d128 rows (causal, full, GQA
32/8 causal) as they are, both modes; four passes in one process (medians).
Phases: `warm` (one child per job, all at once: build, check each mode against float64 at a small shape with
lengths not a multiple of the block, exact zeros of row 0 (causal), the real shape twice, bitwise equal in the
deterministic mode; a mutant's check must FAIL), `time` (one child: per case, float64 gradients of head 0 at the
real shape, each run's error there, then TF/s beside cuDNN, do_bench median, three passes).
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

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/, for _phases
from _phases import child_env, run_phase as run_child  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# case -> (D, B, Hq, Hkv, S_real, causal, check shape (B, Hq, Hkv, Sq, Sk)); check lengths not multiples of 64 / 128
ROUND = os.environ.get("BWDSTD_ROUND", "B")
CASES = {"d64 causal B1 H32 s16k": (64, 1, 32, 32, 16384, True, (1, 32, 32, 208, 208)),
         "d128 causal B1 H16 s16k": (128, 1, 16, 16, 16384, True, (1, 16, 16, 208, 208))}
C6, CC = CASES
if ROUND != "A":  # round B: the flip's other d64 cases too (bwd_d64 serves d64 full and GQA causal)
    CASES.update({"d64 full B1 H32 s16k": (64, 1, 32, 32, 16384, False, (1, 32, 32, 208, 336)),
                  "d64 gqa 32/8 causal B4 s4k": (64, 4, 32, 8, 4096, True, (4, 32, 8, 208, 208)),
                  "d128 full B1 H16 s16k": (128, 1, 16, 16, 16384, False, (1, 16, 16, 208, 336)),
                  "d128 gqa 32/8 causal B4 s4k": (128, 4, 32, 8, 4096, True, (4, 32, 8, 208, 208))})
    C6F, C6G, CF, CG = list(CASES)[2:]
PASSES = ("", " #2", " #3") if ROUND == "A" else ("", " #2", " #3", " #4")
D64 = {"bwd_fixed": 1, "bwd_sections": 8}  # main's bwd_d64 (447db1c)
T = {"bwd_fixed_tma": 1}
UL = {"bwd_named": 2, "bwd_epi_tma": 1, "bwd_snake": 1}  # main's bwd_unordered_levers
D128 = {"bwd_fixed": 1, "bwd_fixed_tma": 1, "bwd_sections": 4}  # main's bwd_d128
# the qmul rows mutant: the producer brings the delta rows in place of qmul (tenth session's gluon-bwd-fixed-tma-rows)
MROWS = ("[num_bh * GQA + off_b * num_heads + h0 + g, m0]", "[off_b * num_heads + h0 + g, m0]")
# job -> (case, variant overrides, modes, mutant); modes: 'fixed' (deterministic=True: the render's deterministic
# mode), 'unord' (deterministic=False)
JOBS = {}
if ROUND == "A":
    # round A (13:48 UTC): d64 candidates over main's bwd_d64; d128 causal's unordered mode with other sections and
    # without its levers
    JOBS.update({"6-def": (C6, {}, ("fixed", "unord"), None),
                 "6-T": (C6, {"bwd_d64": {**D64, **T}}, ("fixed", "unord"), None),
                 "6-T4": (C6, {"bwd_d64": {**D64, **T, "bwd_sections": 4}}, ("fixed", "unord"), None),
                 "6-T0": (C6, {"bwd_d64": {**D64, **T, "bwd_sections": 0}}, ("fixed", ), None),
                 "6-TF3": (C6, {"bwd_d64": {**D64, **T, "bwd_fixed_fma": 3}}, ("fixed", ), None),
                 "6-TR3": (C6, {"bwd_d64": {**D64, **T, "bwd_ring": 3}}, ("fixed", "unord"), None),
                 "6-TR4": (C6, {"bwd_d64": {**D64, **T, "bwd_ring": 4}}, ("fixed", ), None),
                 "6-TQ": (C6, {"bwd_d64": {**D64, **T, "bwd_dq_slots": 2}}, ("fixed", "unord"), None),
                 "6-mrows!": (C6, {"bwd_d64": {**D64, **T}}, ("fixed", ), MROWS),
                 "c-def": (CC, {}, ("fixed", "unord"), None),
                 "c-S2": (CC, {"bwd_d128": {**D128, "bwd_sections": 2}}, ("fixed", "unord"), None),
                 "c-S8": (CC, {"bwd_d128": {**D128, "bwd_sections": 8}}, ("fixed", "unord"), None),
                 "c-S0": (CC, {"bwd_d128": {**D128, "bwd_sections": 0}}, ("unord", ), None),
                 "c-Lne": (CC, {"bwd_unordered_levers": {"bwd_named": 2, "bwd_epi_tma": 1}}, ("unord", ), None)})
    FWD = {C6: "6-def", CC: "c-def"}  # the job whose module gives (out, lse)
else:
    # round B (14:30 UTC): the flipped d64 default (bwd_d64 with the qmul rows by TMA, c1f317f) against main's
    # (old: without them) at d64 causal, full and GQA causal; with a ring of 3 slots (round A's steadiest d64 row);
    # d128 causal's default in both modes (round A: no candidate beat it); the new default's mutant must fail
    JOBS.update({"6-def": (C6, {}, ("fixed", "unord"), None),
                 "6-old": (C6, {"bwd_d64": D64}, ("fixed", ), None),
                 "6-TR3": (C6, {"bwd_d64": {**D64, **T, "bwd_ring": 3}}, ("fixed", "unord"), None),
                 "6-mrows!": (C6, {}, ("fixed", ), MROWS),
                 "6f-def": (C6F, {}, ("fixed", ), None),
                 "6f-old": (C6F, {"bwd_d64": D64}, ("fixed", ), None),
                 "6g-def": (C6G, {}, ("fixed", ), None),
                 "6g-old": (C6G, {"bwd_d64": D64}, ("fixed", ), None),
                 "c-def": (CC, {}, ("fixed", "unord"), None),
                 "f-def": (CF, {}, ("fixed", "unord"), None),  # issue 28's other rows, the defaults as they are
                 "g-def": (CG, {}, ("fixed", "unord"), None)})
    FWD = {C6: "6-def", CC: "c-def", C6F: "6f-def", C6G: "6g-def", CF: "f-def", CG: "g-def"}
WARM_LIMIT, TIME_LIMIT, TOTAL = 30, 44, 76
BOUND = 6e-3  # relative L2 error of each gradient against float64 at the check shape (bf16: ~2.4e-3)


def log(*parts):
    print(*parts, flush=True)


_MODULES = {}


def module(job):
    if job not in _MODULES:
        _MODULES[job] = _module(job)
    return _MODULES[job]


def _module(job):
    import fagen
    from fagen import backends
    from fagen.codegen import render as _render
    from fagen.runtime.loader import load_source
    from fagen.spec.kernel import KernelSpec
    case, over, _, mut = JOBS[job]
    d, b, hq, hkv, _, causal, _ = CASES[case]
    spec = KernelSpec(head_dim=d, mask="causal" if causal else "none", gqa=hq // hkv, dtype="bf16",
                      direction="bwd", backend="gluon")
    if not over and not mut:
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
    tag = re.sub(r"\W", "", "_".join(f"{k}{v}" for k, v in over.items())) or "def"
    if mut:
        assert mut[0] in source, "the mutant's text is not in the render"
        source, tag = source.replace(mut[0], mut[1]), tag + "_mut"
    return load_source(source, f"{spec.name}_{tag}")


def inputs(d, b, hq, hkv, sq, sk, seed=0):
    import torch
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(shape, generator=g, device="cuda").bfloat16()
            for shape in ((b, hq, sq, d), (b, hkv, sk, d), (b, hkv, sk, d), (b, hq, sq, d))]


def reference(q, k, v, do, causal, scale):
    """float64 gradients (dq, dk, dv), bottom-right causal, by hand (no autograd graph: s16k fits); GQA: K, V
    repeated, dK, dV summed over each KV head's query heads."""
    import torch
    gqa = q.shape[1] // k.shape[1]
    q, do = q.double(), do.double()
    k, v = (t.double().repeat_interleave(gqa, dim=1) for t in (k, v))
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        sq, sk = q.shape[-2], k.shape[-2]
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        s.masked_fill_(j > i + (sk - sq), float("-inf"))
    p = torch.softmax(s, -1).nan_to_num_(0.0)
    del s
    o = p @ v
    dv = p.transpose(-1, -2) @ do
    dp = do @ v.transpose(-1, -2)
    delta = (do * o).sum(-1, keepdim=True)
    dp.sub_(delta).mul_(p)  # dS
    del p
    dq = (dp @ k) * scale
    dk = (dp.transpose(-1, -2) @ q) * scale
    b, h, sk, d = dk.shape
    return dq, dk.view(b, h // gqa, gqa, sk, d).sum(2), dv.view(b, h // gqa, gqa, sk, d).sum(2)


def rel(a, b):
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()


def backward_fn(job, q, k, v, do, mode):
    mod, fwd = module(job), module(FWD[JOBS[job][0]])
    scale = q.shape[-1] ** -0.5
    out, lse = fwd.forward(q, k, v, scale=scale)
    det = mode != "unord"
    return lambda: mod.backward(do, q, k, v, out, lse, scale=scale, deterministic=det)


# -- phases --------------------------------------------------------------------------------------------------
def phase_warm(results, job):
    import torch
    t0 = time.time()
    case, _, modes, mut = JOBS[job]
    d, b, h, hkv, s, causal, (cb, ch, chkv, csq, csk) = CASES[case]
    q, k, v, do = inputs(d, cb, ch, chkv, csq, csk)
    ref = reference(q, k, v, do, causal, d ** -0.5)
    ready = []
    for mode in modes:
        got = backward_fn(job, q, k, v, do, mode)()
        errs = [rel(x, r) for x, r in zip(got, ref)]
        ok = all(e <= BOUND for e in errs) and all(bool(torch.isfinite(x).all()) for x in got)
        zeros = ""
        if causal and csq == csk:
            z = bool((got[0][:, :, 0] == 0).all())
            ok, zeros = ok and z, f", dq row 0 {'== 0' if z else '!= 0'}"
        verdict = ("caught" if not ok else "NOT CAUGHT") if mut else ("PASS" if ok else "FAIL")
        log(f"check {job:<9} {mode:<6} B{cb} H{ch} {csq}x{csk}: rel dq {errs[0]:.2e} dk {errs[1]:.2e} "
            f"dv {errs[2]:.2e}{zeros} -> {verdict} ({time.time() - t0:.1f}s)")
        results.append(dict(job=job, mode=mode, check="float64", ok=(not ok) if mut else ok))
    if mut:
        results.append(dict(job=job, ready=[]))
        return
    q, k, v, do = inputs(d, b, h, hkv, s, s, seed=1)
    for mode in modes:
        runs = [backward_fn(job, q, k, v, do, mode)() for _ in range(1 if mode == "unord" else 2)]
        torch.cuda.synchronize()
        same = all(torch.equal(a, c) for r in runs[1:] for a, c in zip(r, runs[0]))
        log(f"real  {job:<9} {mode:<6} x{len(runs)} {'bitwise equal' if same else 'DIFFER'} ({time.time() - t0:.1f}s)")
        results.append(dict(job=job, mode=mode, check="bitwise", ok=same))
        ready.append(mode)
        del runs
    results.append(dict(job=job, ready=ready))
    if job in ("6-def", "c-def", "6f-def", "6g-def", "f-def", "g-def"):  # the public path: fagen.attention takes this render, bitwise twice
        try:
            import fagen
            from fagen.runtime import hopper
            from fagen.spec.kernel import KernelSpec
            want = hopper.backward_spec(KernelSpec(head_dim=d, mask="causal" if causal else "none", dtype="bf16",
                                                   gqa=h // hkv, direction="bwd"), q.device)
            picked = fagen.load(want)
            grads = []
            for _ in range(2):
                leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
                out = fagen.attention(*leaves, mask="causal" if causal else "none")
                grads.append(torch.autograd.grad(out, leaves, do))
            torch.cuda.synchronize()
            same = all(torch.equal(a, c) for a, c in zip(*grads))
            ok = same and picked.BWD_DET_MODE == 2 and picked.BWD_GRID_ALL == 1
            if d == 64 and ROUND != "A":  # the flip reached the public path: qmul rows by TMA, the plain host path
                ok = ok and picked.BWD_FIXED_FAST == 0 and "m_smem" in Path(picked.__file__).read_text()
            log(f"route {job:<9} fagen.attention: {want.name if want else None} (BWD_DET_MODE {picked.BWD_DET_MODE}, "
                f"BWD_GRID_ALL {picked.BWD_GRID_ALL}), x2 {'bitwise equal' if same else 'DIFFER'} -> "
                f"{'PASS' if ok else 'FAIL'}")
            results.append(dict(job=job, mode="route", check="fagen.attention", ok=ok))
        except Exception as e:  # the route check must not keep the job from its timing
            log(f"route {job:<9} ERROR {type(e).__name__}: {str(e)[:200]}")


def phase_time(results, ready):
    """Per mask: float64 gradients of head 0 at the real shape, then each ready (job, mode): its head-0 errors and
    TF/s beside cuDNN (do_bench median)."""
    import torch
    import triton
    for case, (d, b, h, hkv, s, causal, _) in CASES.items():
        t0 = time.time()
        flops = 2.5 * 4 * b * h * s * s * d * (0.5 if causal else 1.0)
        q, k, v, do = inputs(d, b, h, hkv, s, s, seed=2)
        g = h // hkv  # KV head 0 of batch 0 and its query heads
        ref = reference(q[:1, :g], k[:1, :1], v[:1, :1], do[:1, :g], causal, d ** -0.5)
        torch.cuda.synchronize()
        log(f"{case}: float64 head 0 in {time.time() - t0:.1f}s")
        row, steps = dict(case=case), {}
        runs = [("cudnn", None)] + [(job, mode) for job, (c, _, modes, _) in JOBS.items() if c == case
                                    for mode in modes if mode in ready.get(job, ())]
        name = lambda j, m: "cudnn" if j == "cudnn" else f"{j.split('-', 1)[1]} {m}"  # noqa: E731
        for job, mode, label in [(j, m, name(j, m) + p) for p in PASSES for j, m in runs]:
            try:
                if "#" in label:  # a later pass: the same kernels again, later in the process
                    step = steps[label[:-3]]
                    errs = row[label[:-3]][1:]
                else:
                    if job == "cudnn":
                        from torch.nn.attention import SDPBackend, sdpa_kernel
                        qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
                        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                            out = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=causal,
                                                                                   enable_gqa=h != hkv)
                        step = lambda: torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True)  # noqa: E731
                    else:
                        step = backward_fn(job, q, k, v, do, mode)
                    got = step()
                    torch.cuda.synchronize()
                    errs = [rel(x[:1, :n], r) for x, n, r in zip(got, (g, 1, 1), ref)]
                    del got
                    steps[label] = step
                ms = triton.testing.do_bench(step, warmup=5, rep=45)
                tf = flops / ms / 1e9
                row[label] = [tf, *errs]
                peer = "cudnn" + (label[label.index(" #"):] if " #" in label else "")
                ratio = f"{tf / row[peer][0]:.2f}x cudnn" if peer in row else ""
                log(f"{case:<24} {label:<14} {ms:7.3f} ms {tf:6.1f} TF/s {ratio:<12} head0 f64 rel dq {errs[0]:.2e} "
                    f"dk {errs[1]:.2e} dv {errs[2]:.2e}")
            except Exception as e:
                log(f"{case:<24} {label:<14} ERROR {type(e).__name__}: {str(e)[:200]}")
        print("ROW " + json.dumps(row), flush=True)
        del ref
        torch.cuda.empty_cache()


def dry_run():
    sys.path.insert(0, str(ROOT / "tests"))
    from sm90 import ptxas
    ok = True
    for job, (case, over, modes, mut) in JOBS.items():
        try:
            mod = module(job)
            line = f"dry {job:<9} {mod.__name__}"
            if os.environ.get("GPU_BWDSTD_DRY") == "2" and not mut:
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
    log("\n| case | label | TF/s | / cudnn | head 0 f64 dq / dk / dv |")
    log("|---|---|---:|---:|---|")
    for r in rows:
        for label, (tf, *errs) in ((k, v) for k, v in r.items() if k != "case"):
            peer = "cudnn" + (label[label.index(" #"):] if " #" in label else "")  # cuDNN of the same pass
            ratio = f"{tf / r[peer][0]:.2f}x" if peer in r else "-"
            log(f"| {r['case']} | {label} | {tf:.0f} | {ratio} | {' / '.join(f'{e:.2e}' for e in errs)} |")
    log("(bf16, backward only, TF/s = 2.5 x forward FLOPs / do_bench median; fixed = deterministic mode, unord = "
        "deterministic=False; def = main's default render; d64: T = bwd_d64 + bwd_fixed_tma 1 (sections of 8), T4 / "
        "T0 = with sections of 4 / none, TF3 = + bwd_fixed_fma 3, TR3 / TR4 = + bwd_ring 3 / 4, TQ = + bwd_dq_slots 2; d128: S2 / S8 / S0 = bwd_d128 with "
        "sections of 2 / 8 / none, Lne = named 2 + TMA epilogue (no snake); #2, #3 = "
        "later passes)")
    medians(rows)


def medians(rows):
    """The median of the passes of each label, and its ratio to cuDNN's median."""
    log("\n| case | label | median TF/s | / cudnn median |")
    log("|---|---|---:|---:|")
    for r in rows:
        by = {}
        for label, (tf, *_) in ((k, v) for k, v in r.items() if k != "case"):
            by.setdefault(label.split(" #")[0], []).append(tf)
        med = {k: sorted(v)[len(v) // 2] for k, v in by.items()}
        for label, m in med.items():
            ratio = f"{m / med['cudnn']:.3f}x" if "cudnn" in med else "-"
            log(f"| {r['case']} | {label} | {m:.0f} ({len(by[label])}) | {ratio} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phase", help="one phase here (no child): warm:JOB or time")
    ap.add_argument("--ready", default=None, help="time: the ready modes per job (JSON), default every job's")
    args = ap.parse_args()
    if os.environ.get("GPU_BWDSTD_DRY"):
        sys.exit(0 if dry_run() else 1)
    if args.phase:
        ready = args.ready if args.ready is not None else json.dumps(
            {job: list(j[2]) for job, j in JOBS.items() if not j[3]})
        run_phase(args.phase, ready)
        return
    t0 = time.time()
    env = child_env("/tmp/fagen-cache-gpu-bwdstd", ROOT)
    log(f"#### phase warm: {len(JOBS)} children at once (timeout {WARM_LIMIT}s)")
    tmp = tempfile.mkdtemp(prefix="bwdstd-")
    files = {job: open(os.path.join(tmp, f"{job.replace('!', '')}.log"), "w+") for job in JOBS}
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
            elif line.startswith(("check", "real", "route", "warm", "Traceback")) or "Error" in line:
                print(line, flush=True)
    bad = [f"{r['job']} {r['mode']} {r['check']}" for r in checks if not r["ok"]]
    verdict = "ALL PASS" if not bad else "FAILED: " + ", ".join(bad)
    log(f"#### warm: {len(ready)}/{len(JOBS)} jobs done, checks {verdict} ({time.time() - t0:.0f}s)")
    rows = []
    rc, lines = run_child(__file__, "time", min(TIME_LIMIT, max(5.0, TOTAL - (time.time() - t0))), env,
                          lambda line: line.startswith(("RESULTS ", "ROW ")) or print(line, end="", flush=True),
                          ("--ready", json.dumps(ready)))
    for line in lines:
        if line.startswith("ROW "):
            rows.append(json.loads(line[4:]))
    logs += lines
    log(f"#### phase time: rc={rc}, {time.time() - t0:.0f}s so far")
    table(rows)
    out = os.environ.get("OUTX") or os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "gpu_bwdstd_s11.log").write_text("".join(logs))


if __name__ == "__main__":
    main()
