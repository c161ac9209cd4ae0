"""The d128 full backward against cuDNN: the profile, and one lever (issue 28, twenty-second session, helper bwdfull).

    PYTHONPATH=$PWD python3 scripts/gpu_bwdfull_s22.py --round A   # every phase, each in a child with a timeout
    python scripts/gpu_bwdfull_s22.py --phase time                 # one phase here (no child, no timeout)
    python scripts/gpu_bwdfull_s22.py --dry-run                    # any machine: renders, sm_90 builds, ptxas

Case: d128 bf16 full (non-causal) B1 H16 s16k, the standard suite's bwd-d128-full-s16k row. Jobs: def (main's
render), nodq (a probe, not a product: the dQ writer's TMA reduce-adds skipped under `if seq_q < 0`, so dQ stays 0;
everything else as def) and the lever's rows.
Phases: `warm` (a child per job at once: float64 at s21's check shapes, both modes, twice bitwise in the
deterministic mode, Sk 1 exact zeros, the real shape twice bitwise; the mutant must fail; nodq: dq == 0 and dk, dv
bitwise def's in the deterministic mode), `prof` (round A: one child under `ncu --profile-from-start off`:
cuDNN's backward, def unordered, def deterministic, one call each, the main kernels (flash_bprop,
_attn_bwd_hopper_u); sections SpeedOfLight, LaunchStats, Occupancy, WarpStateStats plus the metrics of EXTRA that
this ncu knows; no rules; the raw CSV to $OUT; after the time phase a second ncu run of nodq and R3 unordered), `time` (one child: back-to-back pairs against def,
then TF/s in shuffled passes with per-pass ratios; round B first head 0 of the real shape against float64).
Round A: def, nodq, R3 (bwd_full_levers' bwd_ring 3, [Note] Full ring), Rmut (R3 with dO loaded into the next ring
slot: must fail). Round B (no ncu): def, S (the profile's lever: bwd_full_levers' bwd_dq_swap 1, [Note] dQ column
swap), R3, SR3 (both), Smut (S with the conversion reading the columns unswapped: must fail). Tables also to
$OUT/table.txt.
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
D128 = {"bwd_fixed": 1, "bwd_fixed_tma": 1, "bwd_sections": 4}  # main's bwd_d128
L = {"bwd_named": 2, "bwd_epi_tma": 1}  # main's full levers before this session (bwd_dq_swap 1 flipped after round B)


def lever(**keys):
    return {"bwd_d128": {**D128, "bwd_full_levers": {**L, **keys}}}


# def: main's render as the rounds ran it (before bwd_dq_swap's flip), explicit so the script keeps its meaning
DEF = lever()


# the lever ([Note] Full ring): a third Q/dO ring slot at full; its mutant loads dO into the next slot, not slot s
RING3 = lever(bwd_ring=3)
MRING = ("            tma.async_copy_global_to_shared(do_desc, [off_b, h0 + g, m0, 0], ready.index(s),\n"
         "                                            do_smem.index(s)._reinterpret(",
         "            tma.async_copy_global_to_shared(do_desc, [off_b, h0 + g, m0, 0], ready.index(s),\n"
         "                                            do_smem.index((s + 1) % STAGES)._reinterpret(")
# the profile's lever ([Note] dQ column swap): the dQ halves staged with column bits 2 and 4 swapped (the wgmma
# layout's STS.64 without 2-way bank conflicts), _dq_convert reading them back; its mutant reads them unswapped
SWAP = lever(bwd_dq_swap=1)
MSWAP = ("+ rows[:, None] * HEAD_DIM + src[None, :])", "+ rows[:, None] * HEAD_DIM + cols[None, :])")
if ROUND == "A":
    JOBS = {"def": (DEF, None), "nodq": (DEF, NODQ), "R3": (RING3, None), "Rmut": (RING3, MRING)}
    TIME_ROWS, CANDS = ("def", "nodq", "R3"), ("nodq", "R3")
else:  # round B: the profile's lever (the dQ column swap), the ring, both; the swap's mutant
    JOBS = {"def": (DEF, None), "S": (SWAP, None), "R3": (RING3, None), "SR3": (lever(bwd_dq_swap=1, bwd_ring=3), None),
            "Smut": (SWAP, MSWAP)}
    TIME_ROWS, CANDS = ("def", "S", "R3", "SR3"), ("S", "R3", "SR3")
# check shapes (B, H, Sq, Sk, SMs forced for bwd_tail's plan), s21's: lengths not multiples of 64 / 128, tiles split
# where a tail job's plan allows; 2 query blocks (no split); Sk = 1 (every row sees one key: dq = dk = 0 exactly)
CHECKS = ((1, 16, 208, 336, 5), (1, 4, 1000, 700, 7), (2, 3, 200, 300, 7), (1, 5, 150, 260, 9),
          (2, 3, 100, 300, 4), (1, 4, 333, 1, 3), (1, 4, 600, 520, 8))
OUTX = os.environ.get("OUTX") or os.environ.get("OUT")
WARM_LIMIT, TOTAL = 18, 50
PROF1, TIME_A = 19, 9  # round A: ncu of cuDNN and def, then the pairs, then ncu of the probes (the rest)
REP, PASSES, PAIRS = (30, 2, 8) if ROUND == "A" else (40, 8, 16)
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
PROF_ROWS = (("cudnn", "def unord", "def det"), ("nodq unord", "R3 unord"))  # two ncu runs


# The NVML sampler of scripts/gpu_fp8full_s14.py (ctypes, no pynvml): wall time, SM clock MHz, memory clock MHz,
# power mW (the driver's average), instant power mW (field 186, -1 if absent), clock-event reasons, temperature C.
SAMPLER = r"""
import ctypes, sys, time
nv = ctypes.CDLL("libnvidia-ml.so.1")
assert nv.nvmlInit_v2() == 0
h = ctypes.c_void_p()
assert nv.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(h)) == 0
class FV(ctypes.Structure):
    _fields_ = [("fieldId", ctypes.c_uint), ("scopeId", ctypes.c_uint), ("timestamp", ctypes.c_longlong),
                ("latencyUsec", ctypes.c_longlong), ("valueType", ctypes.c_int), ("nvmlReturn", ctypes.c_int),
                ("value", ctypes.c_ulonglong)]
u, u2, p, t = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint()
r = ctypes.c_ulonglong()
lim = ctypes.c_uint()
nv.nvmlDeviceGetEnforcedPowerLimit(h, ctypes.byref(lim))
reasons = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or nv.nvmlDeviceGetCurrentClocksThrottleReasons
out = open(sys.argv[1], "w", buffering=1)
out.write(f"# power limit {lim.value} mW\n")
fv = FV(); fv.fieldId = 186
end = time.time() + float(sys.argv[2])
while time.time() < end:
    nv.nvmlDeviceGetClockInfo(h, 1, ctypes.byref(u))
    nv.nvmlDeviceGetClockInfo(h, 2, ctypes.byref(u2))
    nv.nvmlDeviceGetPowerUsage(h, ctypes.byref(p))
    inst = -1
    if nv.nvmlDeviceGetFieldValues(h, 1, ctypes.byref(fv)) == 0 and fv.nvmlReturn == 0:
        inst = fv.value & 0xFFFFFFFF
    reasons(h, ctypes.byref(r))
    nv.nvmlDeviceGetTemperature(h, 0, ctypes.byref(t))
    out.write(f"{time.time():.4f} {u.value} {u2.value} {p.value} {inst} {r.value} {t.value}\n")
    time.sleep(0.004)
"""


def window_clocks(path, windows):
    """Per label: the median SM clock (MHz) and instant power (W; the average where absent) of the samples taken
    inside its do_bench windows."""
    rows = []
    if not os.path.exists(path):  # the sampler not started yet
        return {}
    for line in Path(path).read_text().splitlines():
        if not line.startswith("#"):
            x = line.split()
            rows.append((float(x[0]), int(x[1]), int(x[4]) if int(x[4]) >= 0 else int(x[3])))
    per = {}
    for label, t0, t1 in windows:
        got = per.setdefault(label, ([], []))
        for t, clk, mw in rows:
            if t0 <= t <= t1:
                got[0].append(clk)
                got[1].append(mw / 1000)
    return {label: (bt.median(c), bt.median(w), len(c)) for label, (c, w) in per.items() if c}


def log(*parts):
    print(*parts, flush=True)


_MODULES = {}


def module(job):
    if job not in _MODULES:
        over, mut = JOBS[job]
        _MODULES[job] = bt.module(SPEC, over, mut, tag="s22" + job)
    return _MODULES[job]


def backward_fn(job, q, k, v, do, det, sms=0):
    """sms: the host's _BWD_TAIL_SMS for a bwd_tail job (0: the device's)."""
    mod, fwd = module(job), module("def")
    scale = q.shape[-1] ** -0.5
    out, lse = fwd.forward(q, k, v, scale=scale)

    def run():
        if hasattr(mod, "_BWD_TAIL_SMS"):
            mod._BWD_TAIL_SMS = sms
        return mod.backward(do, q, k, v, out, lse, scale=scale, deterministic=det)
    return run


def row_fn(label, q, k, v, do):
    if label == "cudnn":
        return bt.cudnn_backward(q, k, v, do, False)
    job, mode = label.split()
    return backward_fn(job, q, k, v, do, mode == "det")


def phase_warm(results, job):
    import torch
    t0 = time.time()
    mut = JOBS[job][1] if job not in ("nodq", ) else None
    ok_all = True
    for cb, ch, csq, csk, sms in (CHECKS if job != "nodq" else CHECKS[1:2]):
        q, k, v, do = bt.inputs(D, cb, ch, ch, csq, csk, seed=csq)
        ref = bt.reference(q, k, v, do, False, D ** -0.5) if job != "nodq" else None
        for det in (True, False):
            mode = "det" if det else "unord"
            fn = backward_fn(job, q, k, v, do, det, sms=sms)
            got = fn()
            if job == "nodq":  # the probe: dq 0, dk dv as def's (bitwise in the deterministic mode)
                base = backward_fn("def", q, k, v, do, det)()
                z = bool((got[0] == 0).all())
                same = all(torch.equal(a, b) for a, b in zip(got[1:], base[1:]))
                close = all(bt.rel(a, b.double()) < 1e-2 for a, b in zip(got[1:], base[1:]))
                ok = z and (same if det else close)
                log(f"check nodq  {mode:<5} B{cb} H{ch} {csq}x{csk}: dq {'== 0' if z else '!= 0'}, dk dv "
                    f"{'bitwise' if same else 'not bitwise'} def's -> {'PASS' if ok else 'FAIL'} ({time.time() - t0:.1f}s)")
                results.append(dict(job=job, mode=mode, check="probe", ok=ok))
                continue
            errs = [bt.rel(x, r) for x, r in zip(got, ref)]
            ok = all(bool(torch.isfinite(x).all()) for x in got)
            zeros = ""
            if csk == 1:  # dS = 0: dq = dk = 0 exactly; dv = the sum of dO
                z = bool((got[0] == 0).all()) and bool((got[1] == 0).all())
                ok, zeros = ok and z and errs[2] <= BOUND, f", dq dk {'== 0' if z else '!= 0'}"
            else:
                ok = ok and all(e <= BOUND for e in errs)
            if det:
                again = fn()
                same = all(torch.equal(a, c) for a, c in zip(got, again))
                ok, zeros = ok and same, zeros + (" x2 bitwise" if same else " x2 DIFFER")
            split = ""
            if hasattr(module(job), "_bwd_tail_plan") and module(job).BWD_TAIL:
                nt = -(-csk // 128) * cb * ch
                m = module(job)
                split = f" split {m._bwd_tail_plan(nt, sms, m.BWD_TAIL, -(-csq // 64))}/{nt}"
            ok_all = ok_all and ok
            log(f"check {job:<5} {mode:<5} B{cb} H{ch} {csq}x{csk}{split}: rel dq {errs[0]:.2e} dk {errs[1]:.2e} "
                f"dv {errs[2]:.2e}{zeros}{'' if mut else ' -> ' + ('PASS' if ok else 'FAIL')} ({time.time() - t0:.1f}s)")
            if not mut:
                results.append(dict(job=job, mode=mode, check=f"float64 {csq}x{csk}", ok=ok))
    if mut:
        log(f"check {job:<5} mutant: {'caught' if not ok_all else 'NOT CAUGHT'}")
        results.append(dict(job=job, mode="mutant", check="must fail", ok=not ok_all))
        results.append(dict(job=job, ready=[]))
        return
    if job in ("R3", "S"):  # the causal render does not read bwd_full_levers' bwd_ring, bwd_dq_swap
        import fagen
        from fagen import backends
        from fagen.codegen import render as _render
        from fagen.spec.kernel import KernelSpec
        cspec = KernelSpec(**{**SPEC, "mask": "causal"})
        _render.render.cache_clear()
        plain = fagen.generate(cspec)
        saved = dict(backends.GLUON.variant)
        backends.GLUON.variant.update(JOBS[job][0])
        _render.render.cache_clear()
        try:
            lev = fagen.generate(cspec)
        finally:
            backends.GLUON.variant.clear()
            backends.GLUON.variant.update(saved)
            _render.render.cache_clear()
        same = plain == lev and "\nBWD_RING_SLOTS = 2 " in lev
        on = module(job).BWD_RING_SLOTS == 3 if job == "R3" else hasattr(module(job), "_dq_swap")
        log(f"check causal render with {job}'s key: {'identical to the default' if same else 'DIFFERS'}; "
            f"the full render {'has' if on else 'LACKS'} the lever")
        results.append(dict(job=job, mode="causal", check="render unchanged", ok=same and on))
    q, k, v, do = bt.inputs(D, B, H, H, S, S, seed=1)
    runs = [backward_fn(job, q, k, v, do, True)() for _ in range(2)]
    torch.cuda.synchronize()
    same = all(torch.equal(a, c) for a, c in zip(*runs))
    log(f"real  {job:<5} det x2 {'bitwise equal' if same else 'DIFFER'} ({time.time() - t0:.1f}s)")
    if job != "nodq":
        results.append(dict(job=job, mode="det", check="bitwise real", ok=same))
    backward_fn(job, q, k, v, do, False)()  # the unordered kernel built
    torch.cuda.synchronize()
    results.append(dict(job=job, ready=["det", "unord"]))


def phase_prof(results, group):
    """Under ncu (--profile-from-start off): one call of each row of PROF_ROWS[group], in order."""
    import torch
    q, k, v, do = bt.inputs(D, B, H, H, S, S, seed=2)
    fns = {label: row_fn(label, q, k, v, do) for label in PROF_ROWS[group]}
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for fn in fns.values():
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
    if ROUND == "B":  # head 0 of the real shape against float64, each candidate and mode
        ref = bt.reference(q[:1, :1], k[:1, :1], v[:1, :1], do[:1, :1], False, D ** -0.5)
        for label in [x for x in fns if x.split()[0] in CANDS]:
            got = fns[label]()
            errs = [bt.rel(x[:1, :1], r) for x, r in zip(got, ref)]
            ok = all(e <= BOUND for e in errs)
            log(f"real  {label:<9} head 0 vs float64: rel dq {errs[0]:.2e} dk {errs[1]:.2e} dv {errs[2]:.2e} -> "
                f"{'PASS' if ok else 'FAIL'} ({time.time() - t0:.1f}s)")
            results.append(dict(job=label, mode="real", check="float64 head 0", ok=ok))
            del got
        del ref
    for mode in ("unord", "det"):
        for cand in CANDS:
            a, b = f"def {mode}", f"{cand} {mode}"
            if a in fns and b in fns:
                paired(fns, a, b)
    labels = list(fns)
    tfs = {label: [] for label in labels}
    rng = random.Random(22)
    samples, sampler, windows = os.path.join(tempfile.mkdtemp(prefix="bwdfull22-nvml-"), "s.txt"), None, []
    try:  # SM clock and power inside each do_bench run (round B: is a row's gap its clock?)
        sampler = subprocess.Popen([sys.executable, "-c", SAMPLER, samples, "45"], stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL) if ROUND == "B" else None
    except Exception as e:  # noqa: BLE001
        log(f"time  no NVML sampler ({type(e).__name__})")
    for p in range(PASSES):
        order = labels[p % len(labels):] + labels[:p % len(labels)]
        rng.shuffle(order)
        for label in order:
            w0 = time.time()
            ms = triton.testing.do_bench(fns[label], warmup=5, rep=REP)
            windows.append((label, w0, time.time()))
            tfs[label].append(flops / ms / 1e9)
            log(f"pass {p} {label:<10} {ms:7.3f} ms {tfs[label][-1]:6.1f} TF/s ({time.time() - t0:.1f}s)")
        print("ROW " + json.dumps(dict(case="d128 full B1 H16 s16k", tfs=tfs)), flush=True)  # each pass: kept if cut
        if sampler is not None:
            try:
                print("CLOCKS " + json.dumps(window_clocks(samples, windows)), flush=True)
            except Exception as e:  # noqa: BLE001
                log(f"time  clocks unread ({type(e).__name__}: {e}); the sampler stopped")
                sampler.kill()
                sampler.wait()
                sampler = None
    if sampler is not None:
        sampler.terminate()
        sampler.wait()


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


def query_start():
    """`ncu --query-metrics --chip gh100` in the background (no GPU needed): started beside the warm phase."""
    ncu = ncu_bin()
    if ncu is None:
        return None
    return subprocess.Popen([ncu, "--query-metrics", "--chip", "gh100"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)


_KNOWN = []


def known_metrics(proc):
    """EXTRA less the hardware metrics whose base name the query does not list (launch__ ones are always there);
    every EXTRA metric where the query gave no list."""
    if _KNOWN:
        return _KNOWN[0]
    try:
        text = proc.communicate(timeout=10)[0] if proc is not None else ""
    except Exception as e:  # noqa: BLE001
        proc.kill()
        log(f"ncu --query-metrics failed ({type(e).__name__}): every EXTRA metric asked")
        text = ""
    bases = {line.split()[0] for line in text.splitlines() if line.strip()}
    if len(bases) < 50:
        _KNOWN.append((list(EXTRA), []))
    else:
        keep = [m for m in EXTRA if m.startswith("launch__") or m.split(".")[0] in bases]
        _KNOWN.append((keep, [m for m in EXTRA if m not in keep]))
    return _KNOWN[0]


def run_prof(env, limit, tmp, group, query):
    ncu = ncu_bin()
    if ncu is None:
        log("prof: no ncu on this machine")
        return None, [], ""
    t0 = time.time()
    metrics, dropped = known_metrics(query)
    if dropped and not group:
        log(f"prof: {len(dropped)} metrics this ncu does not list, left out: " + ", ".join(dropped)[:300])
    path = os.path.join(tmp, f"ncu{group}.csv")
    # the main kernels only (cuDNN's dot_do_o / convert_dq and our preprocess / conversion are ~1% of the time),
    # no rules: the fifteenth session's ncu of four kernels and seven sections was killed at 17 s after the app's calls
    cmd = [ncu, "--clock-control", "none", "--profile-from-start", "off", "--csv", "--page", "raw",
           "--print-units", "base", "--apply-rules", "no", "--log-file", path, "--metrics", ",".join(metrics),
           "--kernel-name", "regex:flash_bprop|_attn_bwd_hopper"]
    for s in SECTIONS:
        cmd += ["--section", s]
    cmd += [sys.executable, __file__, "--phase", f"prof:{group}", "--round", ROUND]
    app_path = os.path.join(tmp, f"ncu{group}.app")
    with open(app_path, "w+") as app_file:  # ncu and its target in a session of their own: a timeout ends both
        proc = subprocess.Popen(cmd, env=env, stdout=app_file, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=max(limit - (time.time() - t0), 5))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            rc = "killed (timeout)"
        app_file.seek(0)
        app = app_file.read()
    log(f"prof {group}: ncu exit {rc} ({time.time() - t0:.0f}s)")
    for line in [x for x in app.splitlines() if "ERROR" in x or "Traceback" in x or "Error" in x][:4]:
        log("  " + line[:200])
    labels = next((json.loads(line[9:]) for line in app.splitlines() if line.startswith("PROFROWS ")),
                  list(PROF_ROWS[group]))
    text = Path(path).read_text(errors="replace") if os.path.exists(path) else ""
    for line in sorted({x[:200] for x in text.splitlines() if x.startswith(("==ERROR==", "==WARNING=="))})[:4]:
        log("  " + line)
    return text, labels, app


_SCALE = {"nsecond": 1, "usecond": 1e3, "msecond": 1e6, "second": 1e9, "byte": 1, "Kbyte": 1e3, "Mbyte": 1e6,
          "Gbyte": 1e9, "Tbyte": 1e12, "KB": 1024, "MB": 1024 ** 2}
_UNITS = {}


def ncu_rows(text):
    """The raw page's kernel rows; the units line (ID empty) kept in _UNITS, so num() reads base units (ns, bytes)
    whatever --print-units did."""
    start = text.find('"ID"')
    if start < 0:
        return []
    table = list(csv.DictReader(io.StringIO(text[start:])))
    units = next((r for r in table if not r.get("ID", "").strip()), {})
    _UNITS.update({k: v for k, v in units.items() if v})
    return [r for r in table if r.get("ID", "").strip().isdigit()]


def num(r, key):
    try:
        return float(str(r.get(key, "")).replace(",", "")) * _SCALE.get(_UNITS.get(key, ""), 1)
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
    rows, per = ncu_rows(text), []
    ours = [x for x in labels if x != "cudnn"]
    label, n, prev = ("cudnn" if labels and labels[0] == "cudnn" else None), 0, ""
    for r in rows:  # a row of ours starts at its first kernel: the bound kernel or the preprocess (or the main one)
        k = short(r.get("Kernel Name", "?"))
        start = k == "_bwd_kv_bound_rows" or (k == "_bwd_preprocess" and prev != "_bwd_kv_bound_rows") or (
            k == "_attn_bwd_hopper_u" and prev not in ("_bwd_preprocess", "_bwd_kv_bound_rows"))
        if start:
            label, n = (ours[n] if n < len(ours) else "?"), n + 1
        per.append((label or "?", r))
        prev = k
    out(f"\nncu: {len(rows)} kernels, rows {', '.join(labels)}")
    out("\n| row | kernel | us | regs | smem KB | grid x block | waves | occ. % ach / theor | SM busy % | "
        "SM thru % | tensor % act / elap | issue % |")
    out("|---|---|---:|---:|---:|---|---:|---|---:|---:|---|---:|")
    for label, r in per:
        smem = sum(x for x in (num(r, "launch__shared_mem_per_block_dynamic"),
                               num(r, "launch__shared_mem_per_block_static")) if x == x) / 1024
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
    ok = True
    for job in JOBS:
        mod = module(job)
        for tail in ((None, 3) if getattr(mod, "BWD_TAIL", 0) else (None, )):
            for det in (True, False):
                ck = mod.compile_backward_for(deterministic=det, **({} if tail is None else {"tail": tail}))
                res, _, dump = ptxas(ck.asm["ptx"], sass=True)
                res = next(iter(res.values()))
                ok = ok and ck.metadata.shared <= 232448
                log(f"dry {job}{'' if tail is None else ' TAIL 3'} {'det' if det else 'unord'}: ring "
                    f"{mod.BWD_RING_SLOTS}, {res}, shared {ck.metadata.shared} B; SASS step loops (HGMMA, STL, LDL) "
                    f"{sass_loops(dump)}")
    return ok


def run_phase(name, ready_json="{}"):
    import torch
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        log(f"{name}: needs an sm_90 GPU")
        return
    results = []
    try:
        if name.startswith("warm:"):
            phase_warm(results, name[5:])
        elif name.startswith("prof:"):
            phase_prof(results, int(name[5:]))
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
    ap.add_argument("--phase", help="one phase here (no child): warm:JOB, prof:GROUP or time")
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
    query = query_start() if ROUND == "A" else None
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
        worst, n = 0.0, 0
        for line in outs.splitlines():
            if line.startswith("RESULTS "):
                for r in json.loads(line[8:]):
                    (ready.__setitem__(job, r["ready"]) if "ready" in r else checks.append(r))
                continue
            m = re.search(r"rel dq (\S+) dk (\S+) dv (\S+)", line)
            if m and job not in ("Rmut", "Smut"):
                worst, n = max([worst] + [float(x.rstrip(",")) for x in m.groups()]), n + 1
            # stdout stays short: failures, the mutant's verdict, the causal check, the real shape, one line a job
            if ("mutant" in line or "causal" in line or line.startswith("real") or any(
                    w in line for w in ("FAIL", "DIFFER", "NOT CAUGHT", "Traceback", "Error", "killed"))):
                print(line, flush=True)
        if job not in ("Rmut", "Smut", "nodq"):
            splits = sorted(set(re.findall(r"split (\d+/\d+)", outs)))
            log(f"warm {job:<4}: {n} float64 checks, worst rel. L2 {worst:.2e}; splits {' '.join(splits) or '-'}")
    bad = [f"{r['job']} {r['mode']} {r['check']}" for r in checks if not r["ok"]]
    log(f"#### warm: {len(ready)}/{len(JOBS)} jobs done, checks {'ALL PASS' if checks and not bad else bad or 'NONE'}"
        f" ({time.time() - t0:.0f}s)")
    # the time phase takes every job but those with a failed check (a job cut by the warm limit builds there)
    ready = {job: ["det", "unord"] for job in TIME_ROWS if not any(r["job"] == job and not r["ok"] for r in checks)}
    def prof(group, limit):
        csv_text, labels, app = run_prof(env, limit, tmp, group, query)
        logs.append(app)
        if csv_text:
            prof_tables(csv_text, labels, out)
            if OUTX:
                Path(OUTX).mkdir(parents=True, exist_ok=True)
                (Path(OUTX) / f"ncu_raw{group}.csv").write_text(csv_text)
        log(f"#### prof {group} done ({time.time() - t0:.0f}s)")
    if ROUND == "A":
        prof(0, PROF1)
    limit = min(TIME_A, TOTAL - (time.time() - t0)) if ROUND == "A" else TOTAL - (time.time() - t0)
    rc, lines = run_child(__file__, "time", max(5.0, limit), env,
                          lambda line: line.startswith(("RESULTS ", "ROW ", "pass ", "CLOCKS ")) or print(line, end="", flush=True),
                          ("--ready", json.dumps(ready), "--round", ROUND))
    if ROUND == "A":
        if TOTAL - (time.time() - t0) >= 7:
            prof(1, TOTAL - (time.time() - t0))
        else:
            log("#### prof 1 (the probes under ncu) skipped: the time is spent")
    logs += lines
    pairs = [json.loads(line[5:]) for line in lines if line.startswith("PAIR ")]
    rows = [json.loads(line[4:]) for line in lines if line.startswith("ROW ")][-1:]
    clocks = [json.loads(line[7:]) for line in lines if line.startswith("CLOCKS ")][-1:]
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
    if clocks and clocks[0]:
        out("\n| row | SM clock MHz, median in its runs | power W, median | samples |")
        out("|---|---:|---:|---:|")
        for label, (clk, watts, n) in clocks[0].items():
            out(f"| {label} | {clk} | {watts:.0f} | {n} |")
    if pairs:
        out("\n| back-to-back pairs | n | t_a / t_b median | p25 - p75 |")
        out("|---|---|---|---|")
        for p in pairs:
            out(f"| {p['b']} against {p['a']} | {p['n']} | {p['median']:.3f} | {p['p25']:.3f} - {p['p75']:.3f} |")
    out(f"(bf16, TF/s = 2.5 x forward FLOPs / do_bench's time ({REP} ms runs); det = deterministic=True, unord = "
        "deterministic=False; def = main's render; nodq = def without the dQ reduce-adds (a probe); R3 = bwd_full_levers' "
        "bwd_ring 3; S = bwd_dq_swap 1; SR3 = both; H200)")
    if OUTX:
        Path(OUTX).mkdir(parents=True, exist_ok=True)
        (Path(OUTX) / "table.txt").write_text("\n".join(text) + "\n")
        (Path(OUTX) / "gpu_bwdfull_s22.log").write_text("".join(logs))
    if any(not r["ok"] for r in checks) or not checks:
        sys.exit(1)


if __name__ == "__main__":
    main()
