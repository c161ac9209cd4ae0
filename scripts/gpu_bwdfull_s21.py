"""The d128 full backward's last wave, split (issue 28, twenty-first session, helper bwdfull) on an H200.

    PYTHONPATH=$PWD python3 scripts/gpu_bwdfull_s21.py --round A   # every phase, each in a child with a timeout
    python scripts/gpu_bwdfull_s21.py --phase time                 # one phase here (no child, no timeout)
    python scripts/gpu_bwdfull_s21.py --dry-run                    # any machine: renders, sm_90 builds, ptxas

Candidate T (bwd_d128's bwd_full_levers + bwd_tail P; [Note] Split tail in gluon/backward.py.j2): the last wave's
tiles split into P pieces along the query blocks in a second launch of the kernel (launch_pdl, TAIL P), the others
run by the product's kernel (TAIL 1: plus launch_dependents), each piece's dK, dV partials (float32) summed in piece
order by _bwd_tail_sum.
Phases: `warm` (one child per job, all at once: float64 at shapes with the split forced on small problems
(_BWD_TAIL_SMS), both modes, twice bitwise in the deterministic mode; Sk = 1: dq = dk = 0 exactly; the real shape
twice bitwise (deterministic); the mutant must FAIL; the causal render unchanged by the key), `time` (one child:
T3 / T4 / T5 / T8 head 0 of the real shape against float64, back-to-back pairs against the product, then TF/s of
def / T3 / T4 / T5 / T8 / cuDNN, both modes, in shuffled passes; per-pass ratios' medians and quartiles). Table also to
$OUT/table.txt.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import re
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/, for _phases and _bwd_timing
from _phases import child_env, run_phase as run_child  # noqa: E402
import _bwd_timing as bt  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ROUND = "B" if "B" in sys.argv[1:] else "A"
D, B, H, S = 128, 1, 16, 16384
# check shapes (B, H, Sq, Sk, forced SMs): lengths not multiples of 64 / 128, each with tiles split (48 tiles: 3
# split; 24: 3; B2 18: 4 over L2 sections of 4 heads; 15 tiles of 3 query blocks: one step a piece, 6); Sq of 2
# query blocks (fewer than P: no split); Sk = 1 (every row sees one key; 1 split); 10 query blocks, 20 tiles on 8
# SMs (4 split at P 3, 4, 5; P 5: pieces of 2 blocks; the s21 plan leaves 16 blocks unsplit at P 5, a piece empty;
# round A had 7 SMs there, where no P gains)
CHECKS = ((1, 16, 208, 336, 5), (1, 4, 1000, 700, 7), (2, 3, 200, 300, 7), (1, 5, 150, 260, 9),
          (2, 3, 100, 300, 4), (1, 4, 333, 1, 3), (1, 4, 600, 520, 8 if ROUND == "B" else 7))
D128 = {"bwd_fixed": 1, "bwd_fixed_tma": 1, "bwd_sections": 4}  # main's bwd_d128
L = {"bwd_named": 2, "bwd_epi_tma": 1}  # main's full levers
PS = (3, 4, 5, 8) if ROUND == "A" else (3, 4, 5)  # the candidates' P (round B: round A's best three)


def tail(p):
    return {"bwd_d128": {**D128, "bwd_full_levers": {**L, "bwd_tail": p}}}


TAIL = tail(3)
# the mutants: the sum leaves piece 1's partial out (round A), adds piece 0's twice (round B)
MDROP = ("    for p in tl.static_range(1, P):\n        dk +=", "    for p in tl.static_range(2, P):\n        dk +=")
MTWICE = ("    for p in tl.static_range(1, P):\n        dk +=", "    for p in tl.static_range(0, P):\n        dk +=")
JOBS = {"def": ({}, None), **{f"T{p}": (tail(p), None) for p in PS},
        "Tmut": (TAIL, MDROP if ROUND == "A" else MTWICE)}
CANDS = tuple(f"T{p}" for p in PS)  # the timed candidates
TIME_ROWS = ("def", ) + CANDS
# round A: 30 ms do_bench runs (2 timed calls of 10.4 ms, their mean), 10 passes (3-4 ran), 32 pairs; round B: 60
# ms runs (5 calls), 8 passes, 24 pairs, fitting the time phase's ~25 s
REP = 30 if ROUND == "A" else 60
PASSES = 10 if ROUND == "A" else 8
PAIRS = 32 if ROUND == "A" else 24  # back-to-back pairs a comparison
WARM_LIMIT, TOTAL = 24, 48
BOUND = 6e-3  # relative L2 error of each gradient against float64 (bf16: ~2.4e-3)
SPEC = dict(head_dim=D, mask="none", gqa=1, dtype="bf16", direction="bwd", backend="gluon")
OUTX = os.environ.get("OUTX") or os.environ.get("OUT")
NOSPLIT = 1 << 30  # _BWD_TAIL_SMS past any tile count: no split


def log(*parts):
    print(*parts, flush=True)


_MODULES = {}


def module(job):
    if job not in _MODULES:
        over, mut = JOBS[job]
        _MODULES[job] = bt.module(SPEC, over, mut, tag="s21" + job)
    return _MODULES[job]


def backward_fn(job, q, k, v, do, det, sms=0):
    """sms: the host's _BWD_TAIL_SMS (0: the device's; NOSPLIT: no tile splits, the lever's kernel as it is)."""
    mod, fwd = module(job), module("def")
    scale = q.shape[-1] ** -0.5
    out, lse = fwd.forward(q, k, v, scale=scale)

    def run():
        if job != "def":
            mod._BWD_TAIL_SMS = sms
        return mod.backward(do, q, k, v, out, lse, scale=scale, deterministic=det)
    return run


def phase_warm(results, job):
    import torch
    t0 = time.time()
    mut = JOBS[job][1]
    ok_all = True
    for cb, ch, csq, csk, sms in CHECKS:
        q, k, v, do = bt.inputs(D, cb, ch, ch, csq, csk, seed=csq)
        ref = bt.reference(q, k, v, do, False, D ** -0.5)
        for det in (True, False):
            mode = "det" if det else "unord"
            fn = backward_fn(job, q, k, v, do, det, sms=sms)
            got = fn()
            errs = [bt.rel(x, r) for x, r in zip(got, ref)]
            ok = all(bool(torch.isfinite(x).all()) for x in got)
            zeros = ""
            if csk == 1:  # every row sees one key: dS = 0, so dq = dk = 0 exactly; dv = the sum of dO
                z = bool((got[0] == 0).all()) and bool((got[1] == 0).all())
                ok, zeros = ok and z and errs[2] <= BOUND, f", dq dk {'== 0' if z else '!= 0'}"
            else:
                ok = ok and all(e <= BOUND for e in errs)
            if det:
                again = fn()
                same = all(torch.equal(a, c) for a, c in zip(got, again))
                ok, zeros = ok and same, zeros + (" x2 bitwise" if same else " x2 DIFFER")
            split = ""
            if job != "def":
                nt = -(-csk // 128) * cb * ch
                m = module(job)
                split = f" split {m._bwd_tail_plan(nt, sms, m.BWD_TAIL, -(-csq // 64))}/{nt}"
            ok_all = ok_all and ok
            verdict = "" if mut else f" -> {'PASS' if ok else 'FAIL'}"
            log(f"check {job:<5} {mode:<5} B{cb} H{ch} {csq}x{csk} sms {sms}{split}: rel dq {errs[0]:.2e} "
                f"dk {errs[1]:.2e} dv {errs[2]:.2e}{zeros}{verdict} ({time.time() - t0:.1f}s)")
            if not mut:
                results.append(dict(job=job, mode=mode, check=f"float64 {csq}x{csk}", ok=ok))
    if mut:
        log(f"check {job:<5} mutant: {'caught' if not ok_all else 'NOT CAUGHT'}")
        results.append(dict(job=job, mode="mutant", check="must fail", ok=not ok_all))
        results.append(dict(job=job, ready=[]))
        return
    if job == "T3":  # the causal render does not read bwd_full_levers: the same source with the lever
        import fagen
        from fagen import backends
        from fagen.codegen import render as _render
        from fagen.spec.kernel import KernelSpec
        cspec = KernelSpec(**{**SPEC, "mask": "causal"})
        _render.render.cache_clear()
        plain = fagen.generate(cspec)
        saved = dict(backends.GLUON.variant)
        backends.GLUON.variant.update(TAIL)
        _render.render.cache_clear()
        try:
            lever = fagen.generate(cspec)
        finally:
            backends.GLUON.variant.clear()
            backends.GLUON.variant.update(saved)
            _render.render.cache_clear()
        same = plain == lever and "def _bwd_tail_sum(" not in lever and "TAIL" not in lever.split("BWD_TAIL = 0")[0]
        log(f"check causal render with bwd_tail: {'identical to the default (split off)' if same else 'DIFFERS'}")
        results.append(dict(job=job, mode="causal", check="render unchanged", ok=same))
    q, k, v, do = bt.inputs(D, B, H, H, S, S, seed=1)
    runs = [backward_fn(job, q, k, v, do, True)() for _ in range(2)]
    torch.cuda.synchronize()
    same = all(torch.equal(a, c) for a, c in zip(*runs))
    log(f"real  {job:<5} det x2 {'bitwise equal' if same else 'DIFFER'} ({time.time() - t0:.1f}s)")
    results.append(dict(job=job, mode="det", check="bitwise real", ok=same))
    backward_fn(job, q, k, v, do, False)()  # the unordered kernel built
    torch.cuda.synchronize()
    results.append(dict(job=job, ready=["det", "unord"]))


def phase_time(results, ready):
    import torch
    import triton
    t0 = time.time()
    flops = 2.5 * 4 * B * H * S * S * D
    q, k, v, do = bt.inputs(D, B, H, H, S, S, seed=2)
    fns = {}
    for job in TIME_ROWS:
        for mode in ready.get(job, []):
            fns[f"{job} {mode}"] = backward_fn(job, q, k, v, do, mode == "det")
    if any(c in ready for c in CANDS):  # head 0 against float64, and T against def
        ref = bt.reference(q[:1, :1], k[:1, :1], v[:1, :1], do[:1, :1], False, D ** -0.5)
        for label in [x for x in fns if x.split()[0] in CANDS]:
            got = fns[label]()
            errs = [bt.rel(x[:1, :1], r) for x, r in zip(got, ref)]
            ok = all(e <= BOUND for e in errs)
            log(f"real  {label:<9} head 0 vs float64: rel dq {errs[0]:.2e} dk {errs[1]:.2e} dv {errs[2]:.2e} -> "
                f"{'PASS' if ok else 'FAIL'} ({time.time() - t0:.1f}s)")
            results.append(dict(job=label, mode="real", check="float64 head 0", ok=ok))
            del got
        mod = module(next(c for c in CANDS if c in ready))
        nt = S // 128 * B * H
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        log(f"plan  split of {nt} tiles on {sms} SMs: " + ", ".join(
            f"P{p} {mod._bwd_tail_plan(nt, sms, p)}" for p in PS))
    fns["cudnn"] = bt.cudnn_backward(q, k, v, do, False)
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    log(f"time  rows built, cuDNN's first call done ({time.time() - t0:.1f}s)")
    if True:  # back-to-back pairs: each call of main's row next to the candidate's, the order alternating
        for mode in ("unord", "det"):
            for cand in CANDS:
                a, b = f"def {mode}", f"{cand} {mode}"
                if a in fns and b in fns:
                    paired(fns, a, b)
    log(f"time  pairs done ({time.time() - t0:.1f}s)")
    labels = list(fns)
    tfs = {label: [] for label in labels}
    rng = random.Random(17)
    for p in range(PASSES):
        order = labels[p % len(labels):] + labels[:p % len(labels)]
        rng.shuffle(order)
        for label in order:
            ms = triton.testing.do_bench(fns[label], warmup=5, rep=REP)
            tfs[label].append(flops / ms / 1e9)
            log(f"pass {p} {label:<9} {ms:7.3f} ms {tfs[label][-1]:6.1f} TF/s ({time.time() - t0:.1f}s)")
    print("ROW " + json.dumps(dict(case="d128 full B1 H16 s16k", tfs=tfs)), flush=True)


def paired(fns, a, b, n=PAIRS):
    """n pairs of single calls (a b, then b a), CUDA events around each: the per-pair speed-up t_a / t_b, whose
    neighbours ran at nearly the same clock. Prints `PAIR {json}`."""
    import torch
    per = []
    for i in range(n):
        ev = {lab: (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for lab in (a, b)}
        fns[b if i % 2 == 0 else a]()  # untimed: the GPU busy while the host queues the timed pair behind it
        for lab in ((a, b) if i % 2 == 0 else (b, a)):
            ev[lab][0].record()
            fns[lab]()
            ev[lab][1].record()
        torch.cuda.synchronize()
        per.append(ev[a][0].elapsed_time(ev[a][1]) / ev[b][0].elapsed_time(ev[b][1]))
    per.sort()
    print("PAIR " + json.dumps(dict(a=a, b=b, n=n, median=per[n // 2], p25=per[n // 4], p75=per[n - 1 - n // 4])),
          flush=True)


def sass_loops(dump):
    """(STL, LDL) counts of each innermost SASS loop holding HGMMA (the step loops)."""
    import re
    ins = [(int(m.group(1), 16), m.group(2).strip()) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", dump)]
    at = {a: i for i, (a, _) in enumerate(ins)}
    regions = []
    for j, (_, x) in enumerate(ins):
        m = re.search(r"\bBRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", x)
        if m and int(m.group(1), 16) in at and at[int(m.group(1), 16)] < j:
            regions.append((at[int(m.group(1), 16)], j))
    cnt = lambda r, w: sum(w in y for _, y in ins[r[0]:r[1] + 1])  # noqa: E731
    inner = [r for r in regions if cnt(r, "HGMMA") and not any(
        o != r and r[0] <= o[0] and o[1] <= r[1] and cnt(o, "HGMMA") for o in regions)]
    return [(cnt(r, "HGMMA"), cnt(r, "STL"), cnt(r, "LDL")) for r in inner]


def dry_run():
    sys.path.insert(0, str(ROOT / "tests"))
    from sm90 import ptxas
    ok = True
    for job, tails in (("def", (None, )), ("T3", (0, 1, 3)), *((f"T{p}", (p, )) for p in PS[1:])):
        mod = module(job)
        for tail in tails:
            for det in (True, False):
                kw = {} if tail is None else {"tail": tail}
                ck = mod.compile_backward_for(deterministic=det, **kw)
                res, _, dump = ptxas(ck.asm["ptx"], sass=True)
                res = next(iter(res.values()))
                log(f"dry {job} TAIL {tail} {'det' if det else 'unord'}: {res}, shared {ck.metadata.shared} B; "
                    f"SASS step loops (HGMMA, STL, LDL) {sass_loops(dump)}")
    return ok


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
    sys.stderr.flush()
    os._exit(0)  # round A: three warm children hung at exit (after their results) until the 24 s kill


def ratios(tfs, a, b):
    """Per-pass a / b (the same pass): median, quartiles and range."""
    per = [x / y for x, y in zip(tfs.get(a, []), tfs.get(b, []))]
    if not per:
        return f"| {a} / {b} | - | - |"
    o = sorted(per)
    spread = f"{bt.median(per):.3f} ({o[len(o) // 4]:.3f}-{o[len(o) - 1 - len(o) // 4]:.3f}; {o[0]:.3f}-{o[-1]:.3f})"
    return f"| {a} / {b} | {' / '.join(f'{x:.3f}' for x in per)} | {spread} |"


def table(rows, out):
    for r in rows:
        out(f"\n| case | row | TF/s, passes in run order | median | / cuDNN median |")
        out("|---|---|---|---:|---:|")
        bt.medians_table(r["case"], r["tfs"], log=out)
        out("\n| ratio | per pass | median (quartiles; range) |")
        out("|---|---|---|")
        for mode in ("det", "unord"):
            for cand in CANDS:
                out(ratios(r["tfs"], f"{cand} {mode}", f"def {mode}"))
            for cand in ("def", ) + CANDS:
                out(ratios(r["tfs"], f"{cand} {mode}", "cudnn"))
    out(f"(bf16, TF/s = 2.5 x forward FLOPs / do_bench's time (the mean of its timed calls, {REP} ms runs); det = "
        "deterministic=True (DQ_MODE 2), unord = deterministic=False; def = main's render; "
        f"{' / '.join(CANDS)} = bwd_tail {' / '.join(map(str, PS))}; each pass in a shuffled rotated order; H200)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phase", help="one phase here (no child): warm:JOB or time")
    ap.add_argument("--ready", default=None, help="time: the ready modes per job (JSON)")
    ap.add_argument("--round", default="A")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    if args.dry_run:
        sys.exit(0 if dry_run() else 1)
    if args.phase:
        run_phase(args.phase, args.ready or json.dumps({j: ["det", "unord"] for j in TIME_ROWS}))
        return
    t0 = time.time()
    env = child_env("/tmp/fagen-cache-gpu-bwdfull", ROOT)
    log(f"#### round {ROUND}, phase warm: {len(JOBS)} children at once (timeout {WARM_LIMIT}s)")
    tmp = tempfile.mkdtemp(prefix="bwdfull-")
    files = {job: open(os.path.join(tmp, f"{job}.log"), "w+") for job in JOBS}
    procs = {job: subprocess.Popen([sys.executable, __file__, "--phase", f"warm:{job}", "--round", ROUND], env=env,
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
        worst, n = 0.0, 0
        for line in outs.splitlines():
            if line.startswith("RESULTS "):
                for r in json.loads(line[8:]):
                    if "ready" in r:
                        ready[job] = r["ready"]
                    else:
                        checks.append(r)
            elif line.startswith(("check", "real", "warm", "Traceback")) or "Error" in line:
                m = re.search(r"rel dq (\S+) dk (\S+) dv (\S+)", line)
                if m and "mutant" not in line and job != "Tmut":
                    worst, n = max([worst] + [float(x.rstrip(",")) for x in m.groups()]), n + 1
                # stdout stays short: the failures, the mutant's verdict, the causal check, one line per job
                if (job == "Tmut" and "mutant" in line) or "causal" in line or any(
                        w in line for w in ("FAIL", "DIFFER", "NOT CAUGHT", "Traceback", "Error", "killed")):
                    print(line, flush=True)
        if job != "Tmut":
            splits = sorted(set(re.findall(r"split (\d+/\d+)", outs)))
            log(f"warm {job:<4}: {n} float64 checks, worst rel. L2 {worst:.2e}; splits {' '.join(splits) or '-'}")
    bad = [f"{r['job']} {r['mode']} {r['check']}" for r in checks if not r["ok"]]
    verdict = ("ALL PASS" if checks else "NONE RAN") if not bad else "FAILED: " + ", ".join(bad)
    log(f"#### warm: {len(ready)}/{len(JOBS)} jobs done, checks {verdict} ({time.time() - t0:.0f}s)")
    ready = {job: modes for job, modes in ready.items() if modes and not any(
        r["job"] == job and not r["ok"] for r in checks)}
    rows = []
    rc, lines = run_child(__file__, "time", max(5.0, TOTAL - (time.time() - t0)), env,
                          lambda line: line.startswith(("RESULTS ", "ROW ", "pass ")) or print(line, end="", flush=True),
                          ("--ready", json.dumps(ready), "--round", ROUND))
    pairs = [json.loads(line[5:]) for line in lines if line.startswith("PAIR ")]
    for line in lines:
        if line.startswith("ROW "):
            rows.append(json.loads(line[4:]))
        elif line.startswith("RESULTS "):
            bad = [f"{r['job']} {r['check']}" for r in json.loads(line[8:]) if not r["ok"]]
            if bad:
                log("time-phase checks FAILED: " + ", ".join(bad))
    if not rows:  # the phase was cut short: the passes it printed
        tfs = {}
        for line in lines:
            m = re.match(r"pass (\d+) (.+?)\s+[\d.]+ ms\s+([\d.]+) TF/s", line)
            if m:
                tfs.setdefault(m.group(2).strip(), []).append(float(m.group(3)))
        rows = [dict(case="d128 full B1 H16 s16k (cut short)", tfs=tfs)] if tfs else []
    logs += lines
    log(f"#### phase time: rc={rc}, {time.time() - t0:.0f}s so far")
    text = []
    table(rows, lambda line: (text.append(line), log(line)))
    if pairs:
        for line in ["", "| back-to-back pairs | n | t_a / t_b median | p25 - p75 |", "|---|---|---|---|"] + [
                f"| {p['b']} against {p['a']} | {p['n']} | {p['median']:.3f} | {p['p25']:.3f} - {p['p75']:.3f} |"
                for p in pairs]:
            text.append(line)
            log(line)
    if OUTX:
        Path(OUTX).mkdir(parents=True, exist_ok=True)
        (Path(OUTX) / "table.txt").write_text("\n".join(text) + "\n")
        (Path(OUTX) / "gpu_bwdfull_s21.log").write_text("".join(logs))
    if any(not r["ok"] for r in checks) or not checks:
        sys.exit(1)


if __name__ == "__main__":
    main()
