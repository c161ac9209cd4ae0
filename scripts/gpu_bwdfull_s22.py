"""The d128 full backward against cuDNN: the profile, and one lever (issue 28, twenty-second session, helper bwdfull).

    PYTHONPATH=$PWD python3 scripts/gpu_bwdfull_s22.py --round A   # every phase, each in a child with a timeout
    python scripts/gpu_bwdfull_s22.py --phase time                 # one phase here (no child, no timeout)
    python scripts/gpu_bwdfull_s22.py --dry-run                    # any machine: renders, sm_90 builds, ptxas

Case: d128 bf16 full (non-causal) B1 H16 s16k, the standard suite's bwd-d128-full-s16k row. Jobs: def (main's
render), nodq (a probe, not a product: the dQ writer's TMA reduce-adds skipped under `if seq_q < 0`, so dQ stays 0;
everything else as def) and, round B, the lever's rows (LEVERS below).
Phases: `warm` (a child per job at once: the builds; def: float64 at a small shape, both modes; nodq: dq == 0 and
dk, dv bitwise def's in the deterministic mode), `prof` (round A: one child under `ncu --profile-from-start off`:
cuDNN's backward, def unordered, def deterministic, nodq unordered, one call each, separated by a spin kernel;
sections SpeedOfLight, LaunchStats, Occupancy, WarpStateStats plus
the metrics named in EXTRA that this ncu knows; the raw CSV to $OUT), `time` (one child: back-to-back pairs against
def, then TF/s in shuffled passes with per-pass ratios). Tables also to $OUT/table.txt.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import random
import re
import shutil
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

ROUND = "B" if "B" in sys.argv[1:] else "A"
D, B, H, S = 128, 1, 16, 16384
SPEC = dict(head_dim=D, mask="none", gqa=1, dtype="bf16", direction="bwd", backend="gluon")
BOUND = 6e-3  # relative L2 error of each gradient against float64 (bf16: ~2.4e-3)
# the probe: the unordered kernel's dQ writer issues no reduce-add (its barriers and waits stay)
NODQ = ('                _named_bar(j, "sync", _BAR_DQ_FULL + w, 160)  # warpgroup w\'s threads stored and fenced\n'
        '                _tma_reduce_add(',
        '                _named_bar(j, "sync", _BAR_DQ_FULL + w, 160)  # warpgroup w\'s threads stored and fenced\n'
        '                if seq_q < 0:  # probe: no dQ adds\n'
        '                    _tma_reduce_add(')
JOBS = {"def": ({}, None), "nodq": ({}, NODQ)}
TIME_ROWS = ("def", "nodq")
CANDS = ("nodq", )
OUTX = os.environ.get("OUTX") or os.environ.get("OUT")
WARM_LIMIT, PROF_LIMIT, TOTAL = 18, 27, 49
REP, PASSES, PAIRS = 30, 3, 12
SECTIONS = ("SpeedOfLight", "LaunchStats", "Occupancy", "WarpStateStats")
STALLS = ("long_scoreboard", "barrier", "math_pipe_throttle", "wait", "short_scoreboard", "mio_throttle",
          "lg_throttle", "not_selected", "selected", "dispatch_stall", "membar", "sleeping", "no_instruction",
          "imc_miss", "drain", "branch_resolving", "misc", "tex_throttle", "gmma")
EXTRA = ("sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
         "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed",
         "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
         "sm__cycles_active.avg", "sm__cycles_elapsed.avg", "sm__warps_active.avg.pct_of_peak_sustained_active",
         "smsp__issue_active.avg.pct_of_peak_sustained_active", "smsp__inst_executed.sum",
         "lts__t_bytes.sum", "lts__t_sector_hit_rate.pct", "lts__t_sectors_op_red.sum", "lts__t_sectors_op_atom.sum",
         "dram__bytes_read.sum", "dram__bytes_write.sum", "lts__throughput.avg.pct_of_peak_sustained_elapsed",
         "dram__throughput.avg.pct_of_peak_sustained_elapsed",
         "smsp__sass_inst_executed_op_shared_ld.sum", "smsp__sass_inst_executed_op_shared_st.sum",
         "smsp__sass_inst_executed_op_local_ld.sum", "smsp__sass_inst_executed_op_local_st.sum",
         "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum",
         "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum",
         "launch__waves_per_multiprocessor", "launch__shared_mem_per_block_dynamic",
         "launch__shared_mem_per_block_static", "launch__occupancy_limit_shared_mem",
         "sm__maximum_warps_per_active_cycle_pct") + tuple(
    f"smsp__average_warps_issue_stalled_{s}_per_issue_active.ratio" for s in STALLS)
PROF_ROWS = ("cudnn", "def unord", "def det", "nodq unord")


def log(*parts):
    print(*parts, flush=True)


_MODULES = {}


def module(job):
    if job not in _MODULES:
        over, mut = JOBS[job]
        _MODULES[job] = bt.module(SPEC, over, mut, tag="s22" + job)
    return _MODULES[job]


def backward_fn(job, q, k, v, do, det):
    mod, fwd = module(job), module("def")
    scale = q.shape[-1] ** -0.5
    out, lse = fwd.forward(q, k, v, scale=scale)
    return lambda: mod.backward(do, q, k, v, out, lse, scale=scale, deterministic=det)


def row_fn(label, q, k, v, do):
    if label == "cudnn":
        return bt.cudnn_backward(q, k, v, do, False)
    job, mode = label.split()
    return backward_fn(job, q, k, v, do, mode == "det")


def phase_warm(results, job):
    import torch
    t0 = time.time()
    q, k, v, do = bt.inputs(D, 1, 4, 4, 1000, 700, seed=3)
    ref = bt.reference(q, k, v, do, False, D ** -0.5) if job == "def" else None
    base = {m: backward_fn("def", q, k, v, do, m == "det")() for m in ("det", "unord")} if job != "def" else {}
    for det in (True, False):
        mode = "det" if det else "unord"
        got = backward_fn(job, q, k, v, do, det)()
        if job == "def":
            errs = [bt.rel(x, r) for x, r in zip(got, ref)]
            ok = all(e <= BOUND for e in errs) and all(bool(torch.isfinite(x).all()) for x in got)
            log(f"check def {mode:<5} B1 H4 1000x700: rel dq {errs[0]:.2e} dk {errs[1]:.2e} dv {errs[2]:.2e} -> "
                f"{'PASS' if ok else 'FAIL'} ({time.time() - t0:.1f}s)")
            results.append(dict(job=job, mode=mode, check="float64", ok=ok))
        else:  # the probe: dq 0, dk dv as def's (bitwise where the mode is)
            z = bool((got[0] == 0).all())
            same = all(torch.equal(a, b) for a, b in zip(got[1:], base[mode][1:]))
            close = all(bt.rel(a, b.double()) < 1e-2 for a, b in zip(got[1:], base[mode][1:]))
            ok = z and (same if det else close)
            log(f"check {job} {mode:<5}: dq {'== 0' if z else '!= 0'}, dk dv {'bitwise' if same else 'differ'} "
                f"from def -> {'PASS' if ok else 'FAIL'} ({time.time() - t0:.1f}s)")
            results.append(dict(job=job, mode=mode, check="probe", ok=ok))
    q, k, v, do = bt.inputs(D, B, H, H, S, S, seed=1)
    for det in (True, False):  # the real shape's kernels built and run once
        backward_fn(job, q, k, v, do, det)()
    torch.cuda.synchronize()
    results.append(dict(job=job, ready=["det", "unord"]))


def phase_prof(results):
    """Under ncu (--profile-from-start off): one call of each PROF_ROWS row, a spin kernel before each."""
    import torch
    q, k, v, do = bt.inputs(D, B, H, H, S, S, seed=2)
    fns = {label: row_fn(label, q, k, v, do) for label in PROF_ROWS}
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for label, fn in fns.items():
        torch.cuda._sleep(1000)  # the separator (spin_kernel)
        fn()
        torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    log("PROFROWS " + json.dumps(list(fns)))


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
    fns["cudnn"] = bt.cudnn_backward(q, k, v, do, False)
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    log(f"time  rows built ({time.time() - t0:.1f}s)")
    for mode in ("unord", "det"):
        for cand in CANDS:
            a, b = f"def {mode}", f"{cand} {mode}"
            if a in fns and b in fns:
                paired(fns, a, b)
    labels = list(fns)
    tfs = {label: [] for label in labels}
    rng = random.Random(22)
    for p in range(PASSES):
        order = labels[p % len(labels):] + labels[:p % len(labels)]
        rng.shuffle(order)
        for label in order:
            ms = triton.testing.do_bench(fns[label], warmup=5, rep=REP)
            tfs[label].append(flops / ms / 1e9)
            log(f"pass {p} {label:<10} {ms:7.3f} ms {tfs[label][-1]:6.1f} TF/s ({time.time() - t0:.1f}s)")
    print("ROW " + json.dumps(dict(case="d128 full B1 H16 s16k", tfs=tfs)), flush=True)


def paired(fns, a, b, n=PAIRS):
    """n pairs of single calls (a b, then b a), CUDA events around each: t_a / t_b per pair. Prints `PAIR {json}`."""
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


# ---- ncu ------------------------------------------------------------------------------------------------------------

def ncu_bin():
    return shutil.which("ncu") or next((p for p in ("/usr/local/cuda/bin/ncu", "/opt/nvidia/nsight-compute/ncu")
                                        if os.path.exists(p)), None)


def known_metrics(ncu):
    """EXTRA less the hardware metrics whose base name this ncu does not list (launch__ ones are always there)."""
    try:
        r = subprocess.run([ncu, "--query-metrics"], capture_output=True, text=True, timeout=15)
        bases = {line.split()[0] for line in r.stdout.splitlines() if line.strip()}
    except Exception as e:  # noqa: BLE001
        log(f"ncu --query-metrics failed ({e}): every EXTRA metric asked")
        return list(EXTRA), []
    if len(bases) < 50:
        return list(EXTRA), []
    keep = [m for m in EXTRA if m.startswith("launch__") or m.split(".")[0] in bases]
    return keep, [m for m in EXTRA if m not in keep]


def run_prof(env, limit, tmp):
    ncu = ncu_bin()
    if ncu is None:
        log("prof: no ncu on this machine")
        return None, []
    t0 = time.time()
    metrics, dropped = known_metrics(ncu)
    if dropped:
        log("prof: metrics this ncu does not know, left out: " + ", ".join(dropped))
    path = os.path.join(tmp, "ncu.csv")
    cmd = [ncu, "--clock-control", "none", "--profile-from-start", "off", "--csv", "--page", "raw",
           "--print-units", "base", "--log-file", path, "--metrics", ",".join(metrics)]
    for s in SECTIONS:
        cmd += ["--section", s]
    cmd += [sys.executable, __file__, "--phase", "prof", "--round", ROUND]
    try:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=max(limit - (time.time() - t0), 5))
        rc, app = r.returncode, r.stdout + r.stderr
    except subprocess.TimeoutExpired as e:
        rc, app = "timeout", (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (
            e.stdout or "")
    log(f"prof: ncu exit {rc} ({time.time() - t0:.0f}s)")
    for line in app.splitlines():
        if "ERROR" in line or "Traceback" in line or "Error" in line:
            log("  " + line[:200])
    labels = next((json.loads(line[9:]) for line in app.splitlines() if line.startswith("PROFROWS ")), [])
    text = Path(path).read_text(errors="replace") if os.path.exists(path) else ""
    for line in text.splitlines():
        if line.startswith("==ERROR==") or line.startswith("==WARNING=="):
            log("  " + line[:200])
    return text, labels


def ncu_rows(text):
    start = text.find('"ID"')
    if start < 0:
        return []
    table = list(csv.DictReader(io.StringIO(text[start:])))
    return [r for r in table if r.get("ID", "").strip().isdigit()]


def num(r, key):
    try:
        return float(str(r.get(key, "")).replace(",", ""))
    except ValueError:
        return float("nan")


def short(name):
    name = re.sub(r"\(.*", "", name).strip()
    for k in ("flash_bprop", "dot_do_o", "convert_dq", "_attn_bwd_hopper_u", "_bwd_preprocess", "_dq_convert",
              "_bwd_kv_bound_rows", "_bwd_tail_sum"):
        if k in name:
            return k
    return name[:28]


def prof_tables(text, labels, out):
    """Two markdown tables, the same metrics per kernel: launch / occupancy / pipes, then memory / stalls."""
    rows, label, per = ncu_rows(text), None, []
    it = iter(labels)
    for r in rows:
        if "spin_kernel" in r.get("Kernel Name", ""):
            label = next(it, "?")
            continue
        per.append((label or "?", r))
    out(f"\nncu kernels profiled: {len(rows)} ({len(per)} without the spin separators)")
    out("\n| row | kernel | us | regs | smem KB | grid x block | waves | occ. % ach / theor | SM busy % | "
        "SM thru % | tensor % act / elap | issue % |")
    out("|---|---|---:|---:|---:|---|---:|---|---:|---:|---|---:|")
    for label, r in per:
        smem = (num(r, "launch__shared_mem_per_block_dynamic") + num(r, "launch__shared_mem_per_block_static")) / 1024
        busy = 100 * num(r, "sm__cycles_active.avg") / num(r, "sm__cycles_elapsed.avg")
        out(f"| {label} | `{short(r.get('Kernel Name', '?'))}` | {num(r, 'gpu__time_duration.sum') / 1e3:.0f} | "
            f"{num(r, 'launch__registers_per_thread'):.0f} | {smem:.1f} | {r.get('launch__grid_size', '?')} x "
            f"{r.get('launch__block_size', '?')} | {num(r, 'launch__waves_per_multiprocessor'):.2f} | "
            f"{num(r, 'sm__warps_active.avg.pct_of_peak_sustained_active'):.1f} / "
            f"{num(r, 'sm__maximum_warps_per_active_cycle_pct'):.1f} | {busy:.1f} | "
            f"{num(r, 'sm__throughput.avg.pct_of_peak_sustained_elapsed'):.1f} | "
            f"{num(r, 'sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active'):.1f} / "
            f"{num(r, 'sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed'):.1f} | "
            f"{num(r, 'smsp__issue_active.avg.pct_of_peak_sustained_active'):.1f} |")
    out("\n| row | kernel | L2 GB | L2 hit % | L2 red / atom M sect | DRAM rd / wr GB | L2 / DRAM thru % | "
        "smem bank confl. ld / st M | local ld / st M | top stalls (warps per issue) |")
    out("|---|---|---:|---:|---|---|---|---|---|---|")
    for label, r in per:
        stalls = sorted(((num(r, k), m.group(1)) for k in r
                         if (m := re.match(r"smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio$", k))),
                        reverse=True)
        stalls = [(v, s) for v, s in stalls if v == v][:6]
        out(f"| {label} | `{short(r.get('Kernel Name', '?'))}` | {num(r, 'lts__t_bytes.sum') / 1e9:.2f} | "
            f"{num(r, 'lts__t_sector_hit_rate.pct'):.1f} | {num(r, 'lts__t_sectors_op_red.sum') / 1e6:.2f} / "
            f"{num(r, 'lts__t_sectors_op_atom.sum') / 1e6:.2f} | {num(r, 'dram__bytes_read.sum') / 1e9:.2f} / "
            f"{num(r, 'dram__bytes_write.sum') / 1e9:.2f} | "
            f"{num(r, 'lts__throughput.avg.pct_of_peak_sustained_elapsed'):.1f} / "
            f"{num(r, 'dram__throughput.avg.pct_of_peak_sustained_elapsed'):.1f} | "
            f"{num(r, 'l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum') / 1e6:.2f} / "
            f"{num(r, 'l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum') / 1e6:.2f} | "
            f"{num(r, 'smsp__sass_inst_executed_op_local_ld.sum') / 1e6:.2f} / "
            f"{num(r, 'smsp__sass_inst_executed_op_local_st.sum') / 1e6:.2f} | "
            + ", ".join(f"{s} {v:.2f}" for v, s in stalls) + " |")
    return per


# ---- the round's driver ---------------------------------------------------------------------------------------------

def dry_run():
    sys.path.insert(0, str(ROOT / "tests"))
    from sm90 import ptxas
    from gpu_bwdfull_s21 import sass_loops
    for job in JOBS:
        mod = module(job)
        for det in (True, False):
            ck = mod.compile_backward_for(deterministic=det)
            res, _, dump = ptxas(ck.asm["ptx"], sass=True)
            res = next(iter(res.values()))
            n_red = ck.asm["ptx"].count("cp.reduce.async.bulk.tensor")
            log(f"dry {job} {'det' if det else 'unord'}: {res}, shared {ck.metadata.shared} B; reduce-adds in PTX "
                f"{n_red}; SASS step loops (HGMMA, STL, LDL) {sass_loops(dump)}")
    return True


def run_phase(name, ready_json="{}"):
    import torch
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        log(f"{name}: needs an sm_90 GPU")
        return
    results = []
    try:
        if name.startswith("warm:"):
            phase_warm(results, name[5:])
        elif name == "prof":
            phase_prof(results)
        elif name == "time":
            phase_time(results, json.loads(ready_json))
    except Exception as e:  # noqa: BLE001
        log(f"{name}: ERROR {type(e).__name__}: {e}")
        traceback.print_exc()
    print("RESULTS " + json.dumps(results), flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def ratios(tfs, a, b):
    per = [x / y for x, y in zip(tfs.get(a, []), tfs.get(b, []))]
    if not per:
        return f"| {a} / {b} | - | - |"
    o = sorted(per)
    spread = f"{bt.median(per):.3f} ({o[len(o) // 4]:.3f}-{o[len(o) - 1 - len(o) // 4]:.3f}; {o[0]:.3f}-{o[-1]:.3f})"
    return f"| {a} / {b} | {' / '.join(f'{x:.3f}' for x in per)} | {spread} |"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phase", help="one phase here (no child): warm:JOB, prof or time")
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
    env = child_env("/tmp/fagen-cache-gpu-bwdfull22", ROOT)
    text = []

    def out(line):
        text.append(line)
        log(line)
    log(f"#### round {ROUND}, phase warm: {len(JOBS)} children at once (timeout {WARM_LIMIT}s)")
    tmp = tempfile.mkdtemp(prefix="bwdfull22-")
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
        for line in outs.splitlines():
            if line.startswith("RESULTS "):
                for r in json.loads(line[8:]):
                    (ready.__setitem__(job, r["ready"]) if "ready" in r else checks.append(r))
            elif line.startswith(("check", "Traceback")) or "Error" in line or "killed" in line:
                print(line, flush=True)
    bad = [f"{r['job']} {r['mode']} {r['check']}" for r in checks if not r["ok"]]
    log(f"#### warm: {len(ready)}/{len(JOBS)} jobs done, checks {'ALL PASS' if checks and not bad else bad or 'NONE'}"
        f" ({time.time() - t0:.0f}s)")
    ready = {job: modes for job, modes in ready.items() if not any(r["job"] == job and not r["ok"] for r in checks)}
    if ROUND == "A":
        csv_text, labels = run_prof(env, min(PROF_LIMIT, TOTAL - 8 - (time.time() - t0)), tmp)
        if csv_text:
            prof_tables(csv_text, labels, out)
            if OUTX:
                Path(OUTX).mkdir(parents=True, exist_ok=True)
                (Path(OUTX) / "ncu_raw.csv").write_text(csv_text)
        log(f"#### prof done ({time.time() - t0:.0f}s)")
    rc, lines = run_child(__file__, "time", max(5.0, TOTAL - (time.time() - t0)), env,
                          lambda line: line.startswith(("RESULTS ", "ROW ", "pass ")) or print(line, end="", flush=True),
                          ("--ready", json.dumps(ready), "--round", ROUND))
    logs += lines
    pairs = [json.loads(line[5:]) for line in lines if line.startswith("PAIR ")]
    rows = [json.loads(line[4:]) for line in lines if line.startswith("ROW ")]
    if not rows:  # cut short: the passes it printed
        tfs = {}
        for line in lines:
            m = re.match(r"pass (\d+) (.+?)\s+[\d.]+ ms\s+([\d.]+) TF/s", line)
            if m:
                tfs.setdefault(m.group(2).strip(), []).append(float(m.group(3)))
        rows = [dict(case="d128 full B1 H16 s16k (cut short)", tfs=tfs)] if tfs else []
    log(f"#### phase time: rc={rc}, {time.time() - t0:.0f}s so far")
    for r in rows:
        out("\n| case | row | TF/s, passes in run order | median | / cuDNN median |")
        out("|---|---|---|---:|---:|")
        bt.medians_table(r["case"], r["tfs"], log=out)
        out("\n| ratio | per pass | median (quartiles; range) |")
        out("|---|---|---|")
        for mode in ("det", "unord"):
            for cand in CANDS:
                out(ratios(r["tfs"], f"{cand} {mode}", f"def {mode}"))
            for cand in ("def", ) + CANDS:
                out(ratios(r["tfs"], f"{cand} {mode}", "cudnn"))
    if pairs:
        out("\n| back-to-back pairs | n | t_a / t_b median | p25 - p75 |")
        out("|---|---|---|---|")
        for p in pairs:
            out(f"| {p['b']} against {p['a']} | {p['n']} | {p['median']:.3f} | {p['p25']:.3f} - {p['p75']:.3f} |")
    out(f"(bf16, TF/s = 2.5 x forward FLOPs / do_bench's time ({REP} ms runs); det = deterministic=True, unord = "
        "deterministic=False; def = main's render; nodq = def without the dQ reduce-adds (a probe); H200)")
    if OUTX:
        Path(OUTX).mkdir(parents=True, exist_ok=True)
        (Path(OUTX) / "table.txt").write_text("\n".join(text) + "\n")
        (Path(OUTX) / "gpu_bwdfull_s22.log").write_text("".join(logs))
    if any(not r["ok"] for r in checks) or not checks:
        sys.exit(1)


if __name__ == "__main__":
    main()
