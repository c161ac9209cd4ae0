"""The fp8 (e4m3) Gluon forward against cuDNN's fp8 SDPA, sixteenth session (issue 28): the synchronisation, on an H100.

Phases (each a child process with a timeout; scripts/_phases.py), < 60 s in all:
  build  a pool warms every module at the timed shape (B1 H16 s16k, the bench rows' per-KV-head descales) and at a
         small one (fills triton's cache for the other phases);
  ncu    Nsight Compute at base clock (--clock-control base) on one call each of fagen's fp8 product and cuDNN's
         fp8 SDPA on the standard suite's full-mask row (fwd-fp8-d128-full-s16k, input set 0): the sections
         SpeedOfLight, WarpStateStats, InstructionStats, ComputeWorkloadAnalysis, SchedulerStats, LaunchStats,
         Occupancy and the pipes' metrics; the raw page (CSV) goes to $OUTX/ncu_raw.csv, a compact table to stdout
         and $OUTX/ncu_table.md (the first two candidates' kernels too);
  check  every variant against float64 on the dequantized inputs (scripts/gpu_fp8.py's check: RMSE within 1.5x
         the e4m3 emulation's, lse, the fingerprint that fails a P V in bf16, empty rows; lengths not multiples of
         the blocks), the exact ones bit for bit against the product's out and lse, the mutants must go red;
  time   TF/s in the standard suite's measure (fagen.bench.timing.measure: the rows' 3 input sets rotated,
         do_bench's L2 flush): cudnn-fp8 and fagen bf16 through the bench's preparers, the fp8 variants called as
         prepare_fagen calls the product; every pass a fresh seeded permutation of the rows (a row right after a
         bf16 row reads 5-9% low on this power-capped card), the candidates' per-pass ratio to the product (median,
         spread, passes above).

    FP8FWD16_ROUND=A python3 scripts/gpu_fp8fwd_s16.py   # round A; the default is round B

docs/hopper.md, "fp8 forward (sixteenth session)".
"""

from __future__ import annotations

import csv
import io
import json
import multiprocessing as mp
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_fp8_fwd_s7 as s7  # noqa: E402
from _phases import child_env, run_phase as run_child  # noqa: E402

ROUND = os.environ.get("FP8FWD16_ROUND", "B")
OUTX = Path(os.environ.get("OUTX") or os.environ.get("OUT") or "/tmp/fp8fwd16-out")
# name -> None (the product) or {"variant": GluonBackend.variant keys, "fields": spec fields, "patch": ((regex, repl),
# ...) on the render, "mutant": True (its checks must fail), "equal": bit for bit the product's}
VARIANTS = {
    "product": None,
    # [Note] fp8 waits without the partition barrier: the step's K wait and K / V releases without triton's bar.sync
    "nosync": {"variant": {"fp8_nosync": 1}, "equal": True},
    # a third K/V stage (cuDNN keeps 232 KB of shared memory; ours 131 KB at 2 stages, 164 KB at 3)
    "stages 3": {"fields": {"num_stages": 3}, "equal": True},
    "nosync + stages 3": {"variant": {"fp8_nosync": 1}, "fields": {"num_stages": 3}, "equal": True},
}
CANDIDATES = ("nosync", "stages 3", "nosync + stages 3")
s7.VARIANTS = VARIANTS
PHASE_TIMEOUT = ({"build": 16, "check": 12, "time": 24} if ROUND == "A" else
                 {"build": 16, "check": 12, "time": 24})  # ncu after check: no unchecked kernel profiled
RISKY = ("nosync", "nosync + stages 3")  # checked last (a hang costs only its own rows)
PASSES = 30  # the time phase stops early when its time runs short
BENCH_MS = (10, 50)  # the bench's measure's warm-up and rep ms (the bench's own: 25, 100)
NCU_SECTIONS = ("SpeedOfLight", "WarpStateStats", "InstructionStats", "ComputeWorkloadAnalysis", "SchedulerStats",
                "LaunchStats", "Occupancy")
NCU_METRICS = ("sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,"
               "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,"
               "sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active,"
               "sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,"
               "sm__inst_executed_pipe_xu.sum,sm__inst_executed_pipe_fma.sum,sm__inst_executed_pipe_alu.sum,"
               "gpc__cycles_elapsed.max,sm__cycles_active.avg")


def check_cases():
    """(variant, head_dim, s7.CHECKS-style row, window): the product first at each shape; the candidates also on
    the product's GQA 4 / 2 per-head and window rows in round B; the mutants on the first row."""
    cases = [(n, 128, c, None) for n in VARIANTS if not (VARIANTS[n] or {}).get("mutant") for c in s7.CHECKS]
    cases += [(n, 128, s7.CHECKS[0], None) for n in VARIANTS if (VARIANTS[n] or {}).get("mutant")]
    if ROUND == "B":
        cases += [(n, 128, c[:-1], c[-1]) for n in RISKY for c in s7.PRODUCT_CHECKS]  # float64 (no product row)
    return [c for c in cases if c[0] not in RISKY] + [c for c in cases if c[0] in RISKY]


def jobs():
    out = [(mask, n, 128, False, 1) for n in VARIANTS for mask in s7.MASKS
           if not (VARIANTS[n] or {}).get("mutant") or mask == s7.CHECKS[0][0]]
    out += [(mask, n, d, w is not None, gqa) for n, d, (mask, gqa, *_), w in check_cases() if gqa > 1 or w]
    return list(dict.fromkeys(out))


s7.check_cases = check_cases
s7.jobs = jobs


def _warm(job):
    """Build a module: a small call (the checks' specialisation) and, for the plain d128 ones, one at the timed
    shape with the bench rows' per-KV-head k / v descales (a head stride of 1 specialises too)."""
    t = time.time()
    try:
        import torch
        import fagen
        if job[0] == "bf16":
            m = fagen.load(s7.spec_of(job[1], "bf16"))
            x = [torch.randn(s7.TIME_SHAPE, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
            m.forward(*x)
            torch.cuda.synchronize()
            return f"built bf16 {job[1]} in {time.time() - t:.1f}s"
        mask, name, d, window, gqa = job
        m = s7.module(mask, name, d, window, gqa)
        q, k, v = (torch.randn(1, h, 200, d, device="cuda").to(torch.float8_e4m3fn) for h in (gqa, 1, 1))
        m.forward(q, k, v, **({"window": (64, 0)} if window else {}))
        if not window and gqa == 1 and not (VARIANTS[name] or {}).get("mutant"):
            b, h, s, d = s7.TIME_SHAPE
            x = [torch.randn((b, h, s, d), device="cuda").to(torch.float8_e4m3fn) for _ in range(3)]
            m.forward(*x, k_descale=torch.ones(h, device="cuda"), v_descale=torch.ones(h, device="cuda"))
        torch.cuda.synchronize()
        return f"built {name} {mask}{' window' if window else ''}{f' gqa{gqa}' if gqa > 1 else ''} in " \
               f"{time.time() - t:.1f}s"
    except Exception as e:  # noqa: BLE001
        return f"build ERROR {job}: {type(e).__name__}: {str(e).splitlines()[0][:200]}"


def phase_build():
    work = jobs() + [("bf16", m) for m in s7.MASKS]
    s7.log(f"== build: {len(work)} modules")
    with mp.get_context("spawn").Pool(min(len(work), 14)) as pool:
        for msg in pool.imap_unordered(_warm, work):
            s7.log(msg)


def phase_check():
    import torch
    import gpu_fp8
    outs = {}
    for name, d, (mask, gqa, b, hkv, sq, sk, per_head), window in check_cases():
        label = (f"{mask} gqa{gqa} b{b} h{gqa * hkv}/{hkv} sq{sq} sk{sk}{' per-head' if per_head else ''}"
                 f"{f' window{window}' if window else ''}")
        v = VARIANTS[name] or {}
        try:
            m = s7.module(mask, name, d, window is not None, gqa)
            got = []

            def fwd(*a, **kw):
                r = m.forward(*a, **kw)
                got.append(tuple(t.clone() for t in r))
                return r
            rows = [gpu_fp8.check(d, mask, gqa, b, hkv, sq, sk, False, per_head, window=window, seed=call,
                                  device=s7.DEV, forward=fwd) for call in range(2)]
            ok = all(r["pass"] for r in rows)
            r = max(rows, key=lambda r: r["rmse"] / r["emu_rmse"])
            note = (f"rmse {r['rmse']:.2e} (emu {r['emu_rmse']:.2e}) lse {r['lse_err']:.1e} "
                    f"finger {r['fingerprint']:.3f} empty {r['empty_rows']}")
            key = (d, label)
            if name == "product":
                outs[key] = got
            elif (v.get("equal") or v.get("mutant")) and key in outs:
                same = all(torch.equal(x, y) for a, b_ in zip(got, outs[key]) for x, y in zip(a, b_))
                ok = ok and same
                note += f"; {'==' if same else '!='} product bitwise"
            if v.get("mutant"):
                s7.emit(section="check", variant=name, case=label, note=note,
                        value="RED (as it must)" if not ok else "FAIL: the mutant passed")
            else:
                s7.emit(section="check", variant=name, case=label, note=note, value="PASS" if ok else "FAIL")
        except Exception as e:  # noqa: BLE001
            s7.emit(section="check", variant=name, case=label, value="FAIL",
                    note=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
            traceback.print_exc(limit=3)


NCU_SCRIPT = r"""
import sys, torch
sys.path.insert(0, "scripts")
import gpu_fp8fwd_s16 as me, gpu_fp8_fwd_s7 as s7
from fagen.bench import peer_cudnn_fp8 as peer
from fagen.bench.cases import CaseContext
from fagen.bench.workloads import standard_suite
case = next(c for c in standard_suite() if c.name == "fwd-fp8-d128-full-s16k")
cc = CaseContext(case, torch.device("cuda"), 1)
st = cc.sets[0]
def call(m):
    sc = {n: t for n, t in st.scores.items() if n not in ("k_scale", "v_scale")}
    return lambda: m.forward(st.q, st.k, st.v, k_descale=st.scores["k_scale"], v_descale=st.scores["v_scale"],
                             **st.kwargs, **sc)
calls = [("product", call(s7.module("none", "product")))]
try:
    prepared = peer.prepare_cudnn_fp8(cc.case, cc)
    calls.append(("cudnn-fp8", lambda: prepared.fn(st)))
except Exception as e:
    print("cudnn-fp8 ERROR", type(e).__name__, str(e)[:200])
for n in sys.argv[1:]:
    calls.append((n, call(s7.module("none", n))))
import time
t0 = time.time()
for _, f in calls:
    f(); f()
torch.cuda.synchronize()
print(f"APP warm done {time.time() - t0:.1f}s", file=sys.stderr, flush=True)
torch.cuda.profiler.start()
for name, f in calls:
    f()
    torch.cuda.synchronize()
    print(f"APP profiled {name} {time.time() - t0:.1f}s", file=sys.stderr, flush=True)
torch.cuda.profiler.stop()
print("CALLS " + "|".join(n for n, _ in calls), flush=True)
"""
# Round B's ncu: cycles at base clock, one pass, REPS calls of every implementation a mask, interleaved (the order
# rotated each repetition): argv = REPS, then the candidates.
NCU_CYCLES_SCRIPT = r"""
import sys, torch
sys.path.insert(0, "scripts")
import gpu_fp8fwd_s16 as me, gpu_fp8_fwd_s7 as s7
from fagen.bench import peer_cudnn_fp8 as peer
from fagen.bench.cases import CaseContext
from fagen.bench.workloads import standard_suite
reps, names = int(sys.argv[1]), sys.argv[2:]
keep, calls = [], []
for mask in ("none", "causal"):
    word = "full" if mask == "none" else "causal"
    case = next(c for c in standard_suite() if c.name == f"fwd-fp8-d128-{word}-s16k")
    cc = CaseContext(case, torch.device("cuda"), 1)
    st = cc.sets[0]
    keep.append(cc)
    def call(m, st=st):
        sc = {n: t for n, t in st.scores.items() if n not in ("k_scale", "v_scale")}
        return lambda: m.forward(st.q, st.k, st.v, k_descale=st.scores["k_scale"], v_descale=st.scores["v_scale"],
                                 **st.kwargs, **sc)
    mine = [(f"product {word}", call(s7.module(mask, "product")))]
    try:
        prepared = peer.prepare_cudnn_fp8(cc.case, cc)
        mine.append((f"cudnn-fp8 {word}", lambda p=prepared, st=st: p.fn(st)))
    except Exception as e:
        print("cudnn-fp8 ERROR", type(e).__name__, str(e)[:200])
    mine += [(f"{n} {word}", call(s7.module(mask, n))) for n in names]
    calls += mine
for _, f in calls:
    f(); f()
torch.cuda.synchronize()
order = []
torch.cuda.profiler.start()
for r in range(reps):
    k = r % len(calls)
    for name, f in calls[k:] + calls[:k]:
        f()
        order.append(name)
torch.cuda.synchronize()
torch.cuda.profiler.stop()
print("CALLS " + "|".join(order))
"""
NCU_CYCLES_METRICS = ("gpc__cycles_elapsed.max,gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,"
                      "smsp__inst_executed.sum")
NCU_REPS = 4


def phase_ncu_cycles():
    """Round B: each implementation's kernel cycles at base clock, NCU_REPS calls a mask, interleaved."""
    ncu = _ncu_bin()
    s7.log(f"== ncu cycles: {ncu}")
    if not ncu:
        return
    OUTX.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    cmd = [ncu, "--profile-from-start", "off", "--clock-control", "base", "-k", "regex:attn_fwd_hopper|sdpa",
           "--metrics", NCU_CYCLES_METRICS, "--page", "raw", "--csv", sys.executable, "-c", NCU_CYCLES_SCRIPT,
           str(NCU_REPS), *CANDIDATES]
    r = _run_group(cmd, PHASE_TIMEOUT["ncu"] - 2)
    (OUTX / "ncu_cycles.csv").write_text(r.stdout + "\n---- stderr\n" + r.stderr)
    s7.log(f"ncu rc {r.returncode} in {time.time() - t0:.1f}s")
    if r.returncode:
        s7.log(r.stderr[-600:])
    order = next((ln[6:].split("|") for ln in r.stdout.splitlines() if ln.startswith("CALLS ")), [])
    rows = list(csv.reader(io.StringIO("\n".join(ln for ln in r.stdout.splitlines() if ln.startswith('"')))))
    if len(rows) < 2:
        s7.log("ncu: no rows")
        return
    col = {h: i for i, h in enumerate(rows[0])}
    kern = [x for x in rows[1:] if x[col["ID"]].strip().isdigit()]
    cyc = {}
    for name, k in zip(order, kern):
        cyc.setdefault(name, []).append(float(k[col["gpc__cycles_elapsed.max"]].replace(",", "")))
    for name, v in cyc.items():
        word = name.rsplit(" ", 1)[1]
        base = cyc.get(f"product {word}")
        note = ""
        if base and len(base) == len(v) and not name.startswith("product"):
            rr = sorted(b / x for b, x in zip(base, v))
            note = f"; product / this, call by call: median {statistics.median(rr):.4f}, range {rr[0]:.4f}-{rr[-1]:.4f}"
        s7.log(f"ncu cycles {name}: median {statistics.median(v) / 1e6:.4f} M (" +
               " ".join(f"{x / 1e6:.4f}" for x in v) + ")" + note)
        s7.emit(section="ncu", variant=name, mask=word, value=round(statistics.median(v) / 1e6, 4), note=note)


# the rows of the compact table: (label, metric name in the raw page)
NCU_ROWS = (
    ("duration (ns)", "gpu__time_duration.sum"), ("cycles (gpc max)", "gpc__cycles_elapsed.max"),
    ("SM MHz", "sm__cycles_elapsed.avg.per_second"), ("grid", "launch__grid_size"),
    ("threads a CTA", "launch__block_size"), ("registers a thread", "launch__registers_per_thread"),
    ("smem a CTA, dynamic B", "launch__shared_mem_per_block_dynamic"),
    ("smem a CTA, static B", "launch__shared_mem_per_block_static"),
    ("warps active a SM", "sm__warps_active.avg.per_cycle_active"),
    ("instructions", "smsp__inst_executed.sum"),
    ("issue active % (SMSP)", "smsp__issue_active.avg.pct_of_peak_sustained_active"),
    ("IPC (SM, active)", "sm__inst_executed.avg.per_cycle_active"),
    ("tensor (gmma) pipe %", "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active"),
    ("XU (MUFU) pipe % inst", "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active"),
    ("FMA pipe % inst", "sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active"),
    ("ALU pipe % inst", "sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active"),
    ("XU inst", "sm__inst_executed_pipe_xu.sum"), ("FMA inst", "sm__inst_executed_pipe_fma.sum"),
    ("ALU inst", "sm__inst_executed_pipe_alu.sum"),
    ("SM throughput %", "sm__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("DRAM throughput %", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed"),
    ("warp cycles per issue", "smsp__average_warp_latency_per_inst_issued.ratio"),
    ("eligible warps / cycle", "smsp__warps_eligible.avg.per_cycle_active"),
    ("no eligible %", "smsp__issue_inst0.avg.pct_of_peak_sustained_active"),
)
STALL = "smsp__average_warps_issue_stalled_"


def _ncu_bin():
    return shutil.which("ncu") or next((str(p) for p in sorted(Path("/usr/local").glob("cuda*/bin/ncu"))), None)


def _run_group(cmd, timeout):
    """subprocess.run in a session of its own: on timeout the whole group (ncu and the profiled python) is killed,
    so no orphan keeps the GPU busy during the later phases."""
    import signal
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\nkilled after {timeout:.0f}s"
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def phase_ncu():
    ncu = _ncu_bin()
    s7.log(f"== ncu: {ncu}")
    if not ncu:
        return
    OUTX.mkdir(parents=True, exist_ok=True)
    skip = os.environ.get("FP8FWD_SKIP", "").split("|")
    extra = [n for n in CANDIDATES[:2] if n not in skip]  # a candidate whose checks failed is not profiled
    base = [ncu, "--profile-from-start", "off", "--clock-control", "base", "-k", "regex:attn_fwd_hopper|sdpa",
            "--page", "raw", "--csv"]
    if ROUND == "B":  # round A's ncu was killed at 17 s: two kernels (and the product's V pass), no rules
        extra = []
        base = [ncu, "--profile-from-start", "off", "--clock-control", "base", "--apply-rules", "no",
                "--page", "raw", "--csv"]
    for sec in NCU_SECTIONS:
        base += ["--section", sec]
    t0 = time.time()
    cmd = base + ["--metrics", NCU_METRICS, sys.executable, "-c", NCU_SCRIPT, *extra]
    r = _run_group(cmd, PHASE_TIMEOUT["ncu"] - 2)
    profiled = any(ln.startswith('"') and "attn_fwd_hopper" in ln for ln in r.stdout.splitlines())
    if not profiled and time.time() - t0 < 8:  # an unknown metric name: the sections alone
        s7.log(f"ncu rc {r.returncode} with the extra metrics ({r.stderr.strip()[-300:]}); again without them")
        r = _run_group(base + [sys.executable, "-c", NCU_SCRIPT, *extra], PHASE_TIMEOUT["ncu"] - 2 - (time.time() - t0))
    (OUTX / "ncu_raw.csv").write_text(r.stdout + "\n---- stderr\n" + r.stderr)
    s7.log(f"ncu rc {r.returncode} in {time.time() - t0:.1f}s; " + " ".join(
        ln for ln in r.stdout.splitlines() if ln.startswith(("CALLS", "cudnn-fp8 ERROR"))))
    s7.log(" / ".join(ln for ln in r.stderr.splitlines() if ln.startswith("APP ")))
    s7.log(" / ".join(ln for ln in r.stdout.splitlines() if ln.startswith("==PROF==") or "passes" in ln)[-600:])
    if r.returncode:
        s7.log(r.stderr[-600:])
    names = next((ln[6:].split("|") for ln in r.stdout.splitlines() if ln.startswith("CALLS ")), [])
    report_ncu(r.stdout, names)


def report_ncu(text, names):
    """The compact table from the raw page's CSV: one column a profiled kernel (the calls' order)."""
    rows = list(csv.reader(io.StringIO("\n".join(ln for ln in text.splitlines() if ln.startswith('"')))))
    if len(rows) < 3:
        s7.log("ncu: no raw rows")
        return
    head = rows[0]
    col = {h: i for i, h in enumerate(head)}
    kern = [r for r in rows[1:] if "ID" not in col or r[col["ID"]].strip().isdigit()]  # not the units row
    if "Kernel Name" in col:  # the attention kernels only (not the product's V pass)
        kern = [r for r in kern if "attn_fwd_hopper" in r[col["Kernel Name"]] or "sdpa" in r[col["Kernel Name"]]]

    def val(k, m):
        i = col.get(m)
        return k[i] if i is not None and i < len(k) else ""
    labels = [f"{names[j] if j < len(names) else '?'}: {val(k, 'Kernel Name')[:32]}" for j, k in enumerate(kern)]
    out = ["| ncu, base clock | " + " | ".join(labels) + " |", "|---|" + "---:|" * len(kern)]
    for label, m in NCU_ROWS:
        out.append(f"| {label} | " + " | ".join(val(k, m) for k in kern) + " |")
    stalls = [h for h in head if h.startswith(STALL) and h.endswith("_per_issue_active.ratio")]
    def num(x):
        try:
            return float(x.replace(",", ""))
        except ValueError:
            return 0.0
    score = {h: max((num(val(k, h)) for k in kern), default=0) for h in stalls}
    for h in sorted(stalls, key=lambda h: -score[h])[:10]:
        out.append(f"| stall {h[len(STALL):-len('_per_issue_active.ratio')]} (warps / issue) | "
                   + " | ".join(val(k, h) for k in kern) + " |")
    text = "\n".join(out)
    s7.log(text)
    OUTX.mkdir(parents=True, exist_ok=True)
    (OUTX / "ncu_table.md").write_text(text + "\n")


T_PHASE = time.time()


def phase_time():
    import torch
    import triton
    from fagen.bench import impls, peer_cudnn_fp8 as peer
    from fagen.bench.cases import CaseContext
    from fagen.bench.timing import measure
    from fagen.bench.workloads import standard_suite
    b, h, s, d = s7.TIME_SHAPE
    s7.log(f"== time (bench measure): B{b} H{h} S{s}; {torch.cuda.get_device_name()}; torch {torch.__version__}, "
           f"triton {triton.__version__}")
    dev = torch.device("cuda")
    suite = {c.name: c for c in standard_suite()}
    skip = os.environ.get("FP8FWD_SKIP", "").split("|")
    rows, keep = [], []

    def fp8_call(m):
        def call(st):
            sc = {n: t for n, t in st.scores.items() if n not in ("k_scale", "v_scale")}
            return m.forward(st.q, st.k, st.v, k_descale=st.scores["k_scale"], v_descale=st.scores["v_scale"],
                             **st.kwargs, **sc)[0]
        return call
    for mask in s7.MASKS:
        flops = 4 * b * h * s * s * d / (2 if mask == "causal" else 1)
        word = "causal" if mask == "causal" else "full"
        try:
            cc = CaseContext(suite[f"fwd-fp8-d128-{word}-s16k"], dev, 3)
            bcc = CaseContext(suite[f"fwd-d128-{word}-s16k"], dev, 3)
            keep += [cc, bcc]
        except Exception as e:  # noqa: BLE001
            s7.emit(section="time", variant="setup", mask=mask, value="ERROR",
                    note=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
            continue
        makers = [("cudnn-fp8", lambda cc=cc: peer.prepare_cudnn_fp8(cc.case, cc).fn, cc),
                  ("fagen bf16 (bench row)", lambda bcc=bcc: impls.prepare_fagen(bcc.case, bcc).fn, bcc),
                  ("fp8 product", lambda mask=mask: fp8_call(s7.module(mask, "product")), cc)]
        makers += [(f"fp8 {n}", lambda n=n, mask=mask: fp8_call(s7.module(mask, n)), cc) for n in CANDIDATES
                   if n not in skip]
        for label, make, c in makers:
            try:
                fn = make()
                rows.append((label, mask, flops, lambda i, fn=fn, c=c: fn(c.sets[i]), len(c.sets)))
            except Exception as e:  # noqa: BLE001
                s7.emit(section="time", variant=label, mask=mask, value="ERROR",
                        note=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
    times = {}
    with torch.no_grad():
        for label, mask, _, fn, n in rows:
            try:
                fn(0)
            except Exception as e:  # noqa: BLE001
                times[(label, mask)] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        torch.cuda.synchronize()
        t_passes = time.time()
        for p in range(PASSES):
            left = PHASE_TIMEOUT["time"] - (time.time() - T_PHASE)
            if p and (time.time() - t_passes) / p * 1.15 > left - 1.5:
                s7.log(f"pass {p} skipped: the phase's time is short")
                break
            for label, mask, flops, fn, n in random.Random(1000 + p).sample(rows, len(rows)):
                if isinstance(times.get((label, mask)), str):
                    continue
                try:
                    times.setdefault((label, mask), []).append(measure(fn, n, dev, *BENCH_MS))
                except Exception as e:  # noqa: BLE001
                    times[(label, mask)] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            s7.log(f"pass {p} done ({time.time() - s7.T0:.0f}s)")
    tf = {(label, mask): flops / statistics.median(times[(label, mask)]) / 1e9 for label, mask, flops, _, _ in rows
          if isinstance(times.get((label, mask)), list) and times[(label, mask)]}
    for label, mask, flops, _, _ in rows:
        t = times.get((label, mask))
        if isinstance(t, str) or not t:
            s7.emit(section="time", variant=label, mask=mask, value="ERROR", note=str(t)[:160])
            continue
        notes = []
        if label.startswith("fp8 "):
            for ref, word in (("fagen bf16 (bench row)", "bf16"), ("cudnn-fp8", "cudnn")):
                if tf.get((ref, mask)):
                    notes.append(f"{tf[(label, mask)] / tf[(ref, mask)]:.3f}x {word}")
                r = times.get((ref, mask))
                if ref == "cudnn-fp8" and isinstance(r, list) and len(r) == len(t):  # per pass: cudnn's time / ours
                    rr = sorted(x / y for x, y in zip(r, t))
                    notes.append(f"(per pass vs cudnn: median {statistics.median(rr):.3f}, "
                                 f"range {rr[0]:.3f}-{rr[-1]:.3f})")
            pp = times.get(("fp8 product", mask))
            if label != "fp8 product" and isinstance(pp, list) and len(pp) == len(t):
                rr = sorted(y / x for x, y in zip(t, pp))  # the product's time / the row's, pass by pass
                q = len(rr) // 4
                notes.append(f"(per pass vs product: median {statistics.median(rr):.3f}, quartiles "
                             f"{rr[q]:.3f}-{rr[-1 - q]:.3f}, range {rr[0]:.3f}-{rr[-1]:.3f}, "
                             f"{sum(x > 1 for x in rr)}/{len(rr)} above)")
        s7.emit(section="time", variant=label, mask=mask, value=round(tf[(label, mask)], 1),
                ms=round(statistics.median(t), 4),
                note=(" ".join(notes) + f" [passes {' '.join(f'{flops / x / 1e9:.0f}' for x in t)}]").strip())


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--phase":
        {"build": phase_build, "ncu": phase_ncu, "check": phase_check,
         "time": phase_time}[sys.argv[2]]()
        return
    env = child_env("/tmp/fagen-cache-gpu-fp8fwd-s16")
    env["FP8FWD16_ROUND"] = ROUND
    env["OUTX"] = str(OUTX)
    rows = []
    for name in PHASE_TIMEOUT:
        limit = PHASE_TIMEOUT[name]
        s7.log(f"#### phase {name} (timeout {limit}s, {time.time() - s7.T0:.0f}s so far)")

        def on_line(line):
            print(line, end="", flush=True)
            if line.startswith("ROW "):
                rows.append(json.loads(line[4:]))
        rc, _ = run_child(__file__, name, limit, env, on_line)
        s7.log(f"#### phase {name}: rc={rc}")
        if name == "check":  # a candidate whose checks failed or did not all run is not timed
            done = [r for r in rows if r.get("section") == "check"]
            want = {}
            for n, *_ in check_cases():
                want[n] = want.get(n, 0) + 1
            bad = [n for n in CANDIDATES if sum(r["variant"] == n for r in done) < want.get(n, 0)
                   or any(r["variant"] == n and r["value"] != "PASS" for r in done)]
            env["FP8FWD_SKIP"] = "|".join(bad)
            if bad:
                s7.log(f"not timed (checks failed or unfinished): {bad}")
    text = s7.table(rows) + "".join(f"\nncu cycles at base clock, {r['variant']}: {r['value']} M{r.get('note', '')}"
                                    for r in rows if r.get("section") == "ncu")
    s7.log(text)
    s7.log(f"total {time.time() - s7.T0:.0f}s")
    OUTX.mkdir(parents=True, exist_ok=True)
    (OUTX / "table.txt").write_text(text + "\n")


if __name__ == "__main__":
    try:
        main()
    except Exception:  # noqa: BLE001
        traceback.print_exc()
