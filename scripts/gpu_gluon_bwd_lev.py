"""Levers on the lab's FA3-style Gluon backward (lab/gluon_bwd.py v1, issue 28) on an H100: checks, then one table.

    PYTHONPATH=$PWD python3 scripts/gpu_gluon_bwd_lev.py      # every phase, each in a child with a timeout
    python scripts/gpu_gluon_bwd_lev.py --phase check         # one phase here (no child, no timeout)
    GPU_GLUON_BWD_LEV_DRY=1 python scripts/gpu_gluon_bwd_lev.py   # any machine: sm_90 builds, ptxas numbers only

Levers (constexpr knobs of v1, docs/hopper.md "Levers on v1"): ORDER 1 ([Note] Wave order), NAMED 1 (the dQ
handoff through named barriers) / 2 (and the dS^T exchange), EPI_TMA 1 (dK, dV through shared memory and TMA),
SNAKE 1 (odd waves of tiles in reverse: the causal tiles' lengths balanced over the programs), HEADROT 1
(unordered only: key block n walks the query heads from n % GQA), DQ_SPLIT k (deterministic: k float32 dQ
accumulators, key block n adds into n % k after n - k; the postprocess sums them in order).
Phases: `warm` builds every (variant, case) kernel in parallel children by tiny launches (each child with its own
timeout: a variant whose launch hangs or faults is dropped from the later phases); `check` compares each lever
variant with a float64 autograd reference (several waves of tiles, lengths not multiples of the blocks, causal and
none, GQA 1 and 4), runs the no-reduce mutant (must fail), exact zeros, bitwise repeatability over 3 runs on
shapes of several waves; `time0..2` time fagen's Triton backward, cuDNN (SDPA) and the variants, one row at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_gluon_bwd as base  # noqa: E402  (inputs, reference, rel, triton_module)

log = base.log
NES = {"NAMED": 2, "EPI_TMA": 1, "SNAKE": 1}
D128 = (0, 1, 2)
# (label, dq_mode, constexprs, the CASES it is timed in: None = all); dq_mode 1 = deterministic=False; a * marks
# a mutant (wrong dQ by construction).
# Seventh session (docs/hopper.md "Levers on v1"): ORDER, SNAKE, HEADROT, DQ_SPLIT lost in the deterministic mode,
# NAMED and EPI_TMA about even; the unordered mode took SNAKE (causal 478 -> 537). Eighth session, round A: the
# launch order ([Note] Launch order in lab/gluon_bwd.py): GRID 1 (one CTA per tile, FA3's backward grid), SPT 1
# (causal: shortest tiles first, descending turns: FA3's deterministic causal), both; the unordered mode on GRID 1;
# the full mask's wave order with neighbours 4 and 8 steps apart (slack in the chain; ORDER 2 lost 5%, 1 lost 45%);
# dq_mode 4, fixed-point dQ ([Note] Fixed-point dQ: deterministic in any order, the unordered mode's schedule).
GRID = {"GRID": 1}
GRID_SPT = {"GRID": 1, "SPT": 1}
CAUSALS = (0, 2)
VARIANTS = [("det", 0, {}, None), ("nondet", 1, {}, None), ("fixed", 4, {}, None), ("fixed+grid", 4, GRID, None),
            ("det+grid", 0, GRID, None), ("det+gridspt", 0, GRID_SPT, CAUSALS), ("nondet+grid", 1, GRID, None),
            ("det+order4", 0, {"ORDER": 4}, (1, )), ("det+order8", 0, {"ORDER": 8}, (1, ))]
# GBWD_LEV_SET=gqa: GQA 32/8 causal only (the case where the unordered adds, hence fixed-point ones, lost in the
# seventh session: 289 against 372): the chain on GRID 1 (ascending, SPT), fixed-point on GRID 1 and in L2 sections
# of 1 and 2 (batch, KV head) pairs.
if os.environ.get("GBWD_LEV_SET") == "gqa":
    G = (2, )
    VARIANTS = [("det", 0, {}, G), ("nondet", 1, {}, G), ("fixed", 4, {}, G), ("fixed+grid", 4, GRID, G),
                ("det+grid", 0, GRID, G), ("det+gridspt", 0, GRID_SPT, G), ("nondet+grid", 1, GRID, G),
                ("fixed+gridhg1", 4, {"GRID": 1, "HGROUP": 1}, G), ("fixed+gridhg2", 4, {"GRID": 1, "HGROUP": 2}, G),
                ("det+gridspthg2", 0, {"GRID": 1, "SPT": 1, "HGROUP": 2}, G)]
MUTANT = ("noreduce+gridspt*", 2, GRID_SPT, (0, ))
MUTANTS = [MUTANT, ("fixed-noscale*", 4, {"FIXED_MUT": 1}, (0, ))]
# (case, B, Hq, Hkv, S, D, causal)
CASES = [("d128 causal B1 H16 s16k", 1, 16, 16, 16384, 128, True),
         ("d128 full B1 H16 s16k", 1, 16, 16, 16384, 128, False),
         ("gqa 32/8 causal B4 s4k", 4, 32, 8, 4096, 128, True)]
WARM_WORKERS = 15
PHASE_TIMEOUT = {"warm": 45, "check": 22, "time0": 12, "time1": 10, "time2": 8}


def live_variants():
    skip = set(filter(None, os.environ.get("GBWD_LEV_SKIP", "").split(",")))
    return [v for v in VARIANTS if v[0] not in skip]


def run_v1(do, q, k, v, out, lse, scale, causal, mode, kw):
    from lab import gluon_bwd as gb
    return gb.backward(do, q, k, v, out, lse, scale, causal, "v1", mode, **kw)


# -- phases --------------------------------------------------------------------------------------------------
def warm_jobs():
    """Every kernel the later phases launch: (label, mode, kw, causal, gqa); one list, split among the workers
    (each worker takes every WARM_WORKERS-th)."""
    return [(label, mode, kw, causal, hq // hkv, d) for (label, mode, kw, cases) in VARIANTS + MUTANTS
            for c, (_, _, hq, hkv, _, d, causal) in enumerate(CASES) if cases is None or c in cases]


def torch_forward(q, k, v, causal, scale):
    """(out, lse) in float32 math, cast like the forward's (Sq = Sk here; GQA by repeat)."""
    import torch
    gqa = q.shape[1] // k.shape[1]
    kk, vv = (t.float().repeat_interleave(gqa, dim=1) for t in (k, v))
    s = (q.float() @ kk.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    return (torch.softmax(s, -1) @ vv).to(q.dtype), lse.contiguous()


def phase_warm(results, part):
    """Worker `part` of WARM_WORKERS: a tiny launch of its share of the kernels (fills the triton cache)."""
    import torch
    jobs = warm_jobs()[part::WARM_WORKERS]
    if part < len(CASES):  # the Triton backward of each case too
        _, b, hq, hkv, s, d, causal = CASES[part]
        base.triton_module(d, causal, hq // hkv)
    for (label, mode, kw, causal, gqa, d) in jobs:
        t0 = time.time()
        log(f"WARM start {label} causal={causal} gqa={gqa} d={d}")
        q, k, v, do = base.inputs(1, gqa, 1, 300, 300, d)
        out, lse = torch_forward(q, k, v, causal, 0.1)  # no fagen build in every worker at once
        run_v1(do, q, k, v, out, lse, 0.1, causal, mode, kw)
        torch.cuda.synchronize()
        log(f"WARM ok {label} causal={causal} gqa={gqa} d={d} ({time.time() - t0:.1f}s)")


def guarded(label, fn):
    """fn() between START/DONE lines: the driver drops a label whose launch started in a phase that was killed."""
    import torch
    log(f"START {label}")
    r = fn()
    torch.cuda.synchronize()
    log(f"DONE {label}")
    return r


def check_one(shape, name, mode, kw, ref, bound, args, results):
    import torch
    got = guarded(name, lambda: run_v1(*args, mode, kw))
    errs = [base.rel(x, r) for x, r in zip(got, ref)]
    ok = all(e <= bd for e, bd in zip(errs, bound)) and all(torch.isfinite(x).all() for x in got)
    if name.endswith("*"):
        log(f"{shape:<36} mutant {name} rel dq {errs[0]:.2e} -> {'caught' if not ok else 'NOT CAUGHT'}")
        results.append(dict(check="mutant", variant=name, ok=not ok))
        return
    log(f"{shape:<36} {name:<11} rel dq {errs[0]:.2e} dk {errs[1]:.2e} dv {errs[2]:.2e} -> {'PASS' if ok else 'FAIL'}")
    if not ok:
        for t, x, r in zip(("dq", "dk", "dv"), got, ref):
            base.where_wrong(t, x, r)
    results.append(dict(check="reference", shape=shape, variant=name, ok=bool(ok)))


def phase_check(results):
    import torch
    lev = [v for v in live_variants() if v[0] not in ("det", "nondet")]  # v1 itself: checked in session 6

    def checked(case):  # the variants built for CASES[case]'s mask and GQA (the warm phase's kernels)
        return [v[:3] for v in lev if v[3] is None or case in v[3]]

    # several waves of tiles on 132 SMs (the wave order's turns cross waves), S not multiples of 64 / 128
    # (full: 11 key blocks x 48 heads = 528 tiles, 2-3 key blocks of a head per wave: the rotated starts)
    shapes = [(1, 2, 2, 300, 300, 128, True), (2, 24, 24, 317, 1333, 128, False), (4, 64, 16, 257, 390, 128, True)]
    for i, (b, hq, hkv, sq, sk, d, causal) in enumerate(shapes):  # shape i: the mask and GQA of CASES[i]
        if not checked(i) and i != 0:
            continue  # no variant built for this case (GBWD_LEV_SET)
        scale = d ** -0.5
        q, k, v, do = base.inputs(b, hq, hkv, sq, sk, d)
        mod = base.triton_module(d, causal, hq // hkv)
        out, lse = mod.forward(q, k, v, scale=scale)
        ref = base.reference(q, k, v, do, causal, scale)
        tri = mod.backward(do, q, k, v, out, lse, scale=scale)
        bound = [max(2 * base.rel(t, r), 5e-3) for t, r in zip(tri, ref)]
        tiles = b * hkv * -(-sk // 128)
        shape = f"B{b} H{hq}/{hkv} {sq}x{sk} {'causal' if causal else 'none'} {tiles}t"
        log(f"{shape:<36} triton      rel dq {base.rel(tri[0], ref[0]):.2e} dk {base.rel(tri[1], ref[1]):.2e} "
            f"dv {base.rel(tri[2], ref[2]):.2e}")
        for name, mode, kw in checked(i) + ([m[:3] for m in MUTANTS] if i == 0 else []):
            try:
                check_one(shape, name, mode, kw, ref, bound, (do, q, k, v, out, lse, scale, causal), results)
            except Exception as e:
                log(f"{shape:<36} {name:<11} ERROR {type(e).__name__}: {str(e)[:200]}")
                results.append(dict(check="reference", shape=shape, variant=name, ok=False))
        del ref
    # exact zeros: full mask with Sk = 1 (every row sees one key); causal Sq = Sk (row 0 sees key 0 only)
    for (sq, sk, causal, case) in ((100, 1, False, 1), (200, 200, True, 0)):
        if not checked(case):
            continue
        q, k, v, do = base.inputs(1, 2, 2, sq, sk, 128, seed=1)
        mod = base.triton_module(128, causal, 1)
        out, lse = mod.forward(q, k, v, scale=0.1)
        for name, mode, kw in checked(case):
            dq, dk, dv = guarded(name, lambda: run_v1(do, q, k, v, out, lse, 0.1, causal, mode, kw))
            ok = bool((dq[:, :, 0] == 0).all()) if causal else bool((dq == 0).all() and (dk == 0).all())
            what = "dq[row 0]" if causal else "dq, dk (Sk = 1)"
            log(f"exact zeros {what:<16} {name:<11} -> {'PASS' if ok else 'FAIL'}")
            results.append(dict(check="zeros", variant=name, ok=ok))
    # bitwise repeatability over 3 runs (deterministic variants), shapes of 8 and 2 waves; and the same result as
    # v1's (another order of the float32 adds: equal to rounding)
    for (b, hq, hkv, s, causal, case) in ((2, 16, 16, 4000, False, 1), (4, 8, 2, 3000, True, 2)):
        if not any(mode in (0, 4) for _, mode, _ in checked(case)):
            continue
        q, k, v, do = base.inputs(b, hq, hkv, s, s, 128, seed=2)
        mod = base.triton_module(128, causal, hq // hkv)
        out, lse = mod.forward(q, k, v, scale=0.09)
        v1 = guarded("det", lambda: run_v1(do, q, k, v, out, lse, 0.09, causal, 0, {}))
        for name, mode, kw in checked(case):
            if mode not in (0, 4):  # deterministic: ordered adds, or fixed-point adds in any order
                continue
            runs = guarded(name, lambda: [run_v1(do, q, k, v, out, lse, 0.09, causal, mode, kw) for _ in range(3)])
            same = all(torch.equal(a, c) for r in runs[1:] for a, c in zip(r, runs[0]))
            near = max(base.rel(a, c.double()) for a, c in zip(runs[0], v1))
            ok = same and near < 1e-2
            log(f"bitwise x3 B{b} H{hq}/{hkv} s{s} {'causal' if causal else 'none'} {name:<11} -> "
                f"{'equal' if same else 'DIFFER'}; rel to v1 {near:.1e} -> {'PASS' if ok else 'FAIL'}")
            results.append(dict(check="bitwise", variant=name, ok=ok))


def phase_time(results, which):
    import torch
    import triton
    name_c, b, hq, hkv, s, d, causal = CASES[which]
    scale = d ** -0.5
    flops = 2.5 * 4 * b * hq * s * s * d * (0.5 if causal else 1.0)
    q, k, v, do = base.inputs(b, hq, hkv, s, s, d)
    mod = base.triton_module(d, causal, hq // hkv)
    out, lse = mod.forward(q, k, v, scale=scale)
    row = dict(case=name_c)

    def run(label, fn):
        try:
            guarded(label, fn)
            ms = triton.testing.do_bench(fn, warmup=5, rep=40)
            row[label] = flops / ms / 1e9
            log(f"{name_c:<26} {label:<13} {ms:8.3f} ms {row[label]:6.1f} TF/s")
            print("ROW " + json.dumps(row), flush=True)  # the row so far: a later hang keeps it
        except Exception as e:
            log(f"{name_c:<26} {label:<13} ERROR {type(e).__name__}: {str(e)[:200]}")

    run("triton", lambda: mod.backward(do, q, k, v, out, lse, scale=scale))
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        o = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=causal, scale=scale,
                                                             enable_gqa=hq != hkv)
        run("cudnn", lambda: torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True))
    dq_det = None
    for label, mode, kw, cases in live_variants():
        if cases is None or which in cases:
            run(label, lambda: run_v1(do, q, k, v, out, lse, scale, causal, mode, kw))
            try:
                if label == "det":
                    dq_det = run_v1(do, q, k, v, out, lse, scale, causal, mode, kw)[0]
                elif mode == 4 and dq_det is not None:  # fixed-point against the ordered float32 adds, in bf16
                    dq = run_v1(do, q, k, v, out, lse, scale, causal, mode, kw)[0]
                    diff = (dq.float() - dq_det.float()).abs()
                    log(f"{name_c:<26} {label:<13} dq vs det: {(diff == 0).float().mean().item():.4f} equal, "
                        f"max diff {diff.max().item() / dq_det.float().abs().max().item():.1e} of max|dq|")
            except Exception as e:
                log(f"{name_c:<26} {label:<13} compare ERROR {type(e).__name__}: {str(e)[:200]}")
    results.append(row)


def dry_run():
    """Any machine: build each variant's main kernel for sm_90 (d128 GQA 2, causal and full); ptxas numbers."""
    from lab import gluon_bwd as gb
    ok = True
    for label, mode, kw, _ in VARIANTS + MUTANTS:
        for causal in (True, False):
            try:
                ck = gb.compile_for("v1", head_dim=128, gqa=2, causal=causal, dq_mode=mode, **kw)
                r = gb.resources(ck)
                st = gb.step_sass(ck)
                log(f"{label:<14} {'causal' if causal else 'full  '}: " + " ".join(f"{k} {v}" for k, v in r.items())
                    + " | steps " + "; ".join(f"{x['instructions']} ins {x['ldl']}/{x['stl']} LDL/STL" for x in st))
            except Exception as e:
                ok = False
                log(f"{label:<14} causal={causal}: BUILD ERROR {type(e).__name__}: {str(e)[:300]}")
    log(f"dry run: {'OK' if ok else 'FAILED'}")
    return ok


# -- driver --------------------------------------------------------------------------------------------------
def run_phase(name):
    import torch
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        log(f"{name}: needs an sm_90 GPU")
        return
    results = []
    if name.startswith("warm"):
        phase_warm(results, int(name[4:]))
    elif name == "check":
        phase_check(results)
    else:
        phase_time(results, int(name[-1]))


def spawn(name, env):
    return subprocess.Popen([sys.executable, __file__, "--phase", name], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True)


def pump(proc, lines, prefix=""):
    def go():
        for line in proc.stdout:
            lines.append(line)
            if not line.startswith(("START ", "DONE ", "ROW ", "WARM start ")):  # bookkeeping: in the log only
                print(prefix + line, end="", flush=True)
    th = threading.Thread(target=go, daemon=True)
    th.start()
    return th


def finish(proc, deadline):
    try:
        return proc.wait(timeout=max(deadline - time.time(), 0.1))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the child and anything it started
        proc.wait()
        return "killed (timeout: a hung kernel?)"


def table(rows):
    log("\n| case | impl | TF/s | / triton | / cudnn |")
    log("|---|---|---:|---:|---:|")
    for r in rows:
        for label in ["triton", "cudnn"] + [v[0] for v in VARIANTS]:
            if label in r:
                t = f"{r[label] / r['triton']:.2f}x" if "triton" in r else "-"
                c = f"{r[label] / r['cudnn']:.2f}x" if "cudnn" in r else "-"
                log(f"| {r['case']} | {label} | {r[label]:.0f} | {t} | {c} |")
    log("(H100 bf16, backward only, TF/s = 2.5 x forward FLOPs / median time; det = deterministic, the default)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phase", help="run one phase here (no child): warm0..warm14, check, time0..time2")
    args = ap.parse_args()
    if os.environ.get("GPU_GLUON_BWD_LEV_DRY"):
        sys.exit(0 if dry_run() else 1)
    if args.phase:
        run_phase(args.phase)
        return
    t0 = time.time()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("FAGEN_CACHE_DIR", "/tmp/fagen-cache-gpu-gluon-bwd-lev")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    logs = []
    # warm: WARM_WORKERS children at once; a variant not reported ok by its worker is dropped later
    log(f"#### phase warm ({WARM_WORKERS} children, {PHASE_TIMEOUT['warm']}s)")
    deadline = time.time() + PHASE_TIMEOUT["warm"]
    procs = [(i, spawn(f"warm{i}", env), []) for i in range(WARM_WORKERS)]
    threads = [pump(p, lines, f"[w{i}] ") for i, p, lines in procs]
    rcs = [finish(p, deadline) for _, p, _ in procs]
    for th in threads:
        th.join(timeout=2)
    warm_lines = "".join(line for _, _, lines in procs for line in lines)
    logs.append(warm_lines)
    # dropped: a variant whose launch started and did not finish (a hang, a fault, an error); one never reached
    # (a slow worker) stays and builds in its phase
    seen = {kind: {tuple(line.split()[2:6]) for line in warm_lines.splitlines() if line.startswith(f"WARM {kind} ")}
            for kind in ("start", "ok")}
    bad = sorted({key[0] for key in seen["start"] - seen["ok"] if not key[0].endswith("*")})
    log(f"#### warm: rc {rcs}, {time.time() - t0:.0f}s; dropped: {bad or 'none'}")
    env["GBWD_LEV_SKIP"] = ",".join(bad)
    rows = []
    timed = sorted({c for v in live_variants() for c in (v[3] if v[3] is not None else range(len(CASES)))})
    for name in ["check"] + [f"time{i}" for i in timed]:
        log(f"#### phase {name} ({PHASE_TIMEOUT[name]}s)")
        proc = spawn(name, env)
        lines = []
        th = pump(proc, lines)
        rc = finish(proc, time.time() + PHASE_TIMEOUT[name])
        th.join(timeout=2)
        logs.append("".join(lines))
        rows += [json.loads(line[4:]) for line in lines if line.startswith("ROW ")][-1:]
        started = {line.split()[1] for line in lines if line.startswith("START ")}
        done = {line.split()[1] for line in lines if line.startswith("DONE ")}
        hung = {x for x in started - done if x not in ("triton", "cudnn")}
        if hung:
            bad = sorted(set(bad) | hung)
            env["GBWD_LEV_SKIP"] = ",".join(bad)
            log(f"#### dropped from here on (started, never finished): {sorted(hung)}")
        log(f"#### phase {name}: rc={rc}, {time.time() - t0:.0f}s so far")
    table(rows)
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "gpu_gluon_bwd_lev.log").write_text("".join(logs))


if __name__ == "__main__":
    main()
