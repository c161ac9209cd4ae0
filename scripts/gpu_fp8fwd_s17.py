"""The fp8 (e4m3) Gluon forward against cuDNN's fp8 SDPA, seventeenth session (issue 28): where the full mask's
cycles go, on an H100.

Phases (each a child process with a timeout; scripts/_phases.py), < 60 s in all:
  build  a pool warms every module at the timed shape (B1 H16 s16k, the bench rows' per-KV-head descales) and at a
         small one (fills triton's cache for the other phases);
  check  every candidate against float64 on the dequantized inputs (scripts/gpu_fp8.py's check: RMSE within 1.5x
         the e4m3 emulation's, lse, the fingerprint that fails a P V in bf16, empty rows; lengths not multiples of
         the blocks; a full row of 216 tiles, more than the 132 programs), bit for bit against the product's out
         and lse where the arithmetic is unchanged;
  ncu    Nsight Compute at base clock (--clock-control base), one kernel filter, one call each of fagen's fp8
         product and cuDNN's fp8 SDPA on the standard suite's full-mask row (fwd-fp8-d128-full-s16k, input set 0),
         the sections SourceCounters, InstructionStats, WarpStateStats and SchedulerStats, exported and read back
         twice: the raw page (a compact table) and the source page in SASS (per instruction: warp-level executions
         and warp-stall samples). Printed: each kernel's instructions by opcode class per 16 rows x 128 keys (a
         consumer warp's step: the call's 16 heads x 16384 rows x 16384 keys are 2,097,152 of them), the stall
         samples by opcode class, and the instructions holding the most samples with their neighbours. The pages go
         to $OUTX (ncu_raw.csv, ncu_source.csv.gz, ncu_table.md);
  time   TF/s in the standard suite's measure (fagen.bench.timing.measure: the rows' 3 input sets rotated,
         do_bench's L2 flush): cudnn-fp8 and fagen bf16 through the bench's preparers, the fp8 candidates called as
         prepare_fagen calls the product; every pass a fresh seeded permutation of the rows (a row right after a
         bf16 row reads 5-9% low on this power-capped card), each candidate's per-pass time ratio to the product
         (median, quartiles, range, passes above).

    FP8FWD17_ROUND=A python3 scripts/gpu_fp8fwd_s17.py   # round A; the default is round B

docs/hopper.md, "fp8 forward (seventeenth session)".
"""

from __future__ import annotations

import collections
import csv
import gzip
import io
import json
import multiprocessing as mp
import os
import random
import re
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

ROUND = os.environ.get("FP8FWD17_ROUND", "B")
OUTX = Path(os.environ.get("OUTX") or os.environ.get("OUT") or "/tmp/fp8fwd17-out")
# name -> None (the product) or {"variant": GluonBackend.variant keys, "fields": spec fields, "patch": ((regex, repl),
# ...) on the render, "equal": bit for bit the product's (True: required, "note": reported), "masks": the masks it
# is built, checked and timed at}
VARIANTS = {
    "product": None,
    # [Note] fp8 full head-major: the full mask's tiles query block fastest (one or two heads' K and V a round)
    "head-major": {"variant": {"fp8_full_hm": 1}, "equal": True, "masks": ("none", )},
    # [Note] fp8 softmax under the P V (tenth session: lost 2.5-5% with 28-44 spill operations at P_CVT 2): today's
    # packed P builds it without spills (sm_90: 66 MUFU.EX2 between the S wait and the P V wait, 0 spills)
    "pv overlap": {"variant": {"fp8_pv_overlap": 1}, "equal": "note", "masks": ("none", )},
    # [Note] fp8 256-key steps (cuDNN's kernel is ..._64x256x128_...): P V waited inside the step, S after it
    "n256": {"variant": {"fp8_n256": 1}, "block_n": 256, "masks": ("none", )},
    "n256 + head-major": {"variant": {"fp8_n256": 1, "fp8_full_hm": 1}, "block_n": 256, "masks": ("none", ),
                          "equal_to": "n256"},
    # cuDNN's turns: one named barrier a step, reached by the warpgroups at different places (fp8_n256 2)
    "n256 turns": {"variant": {"fp8_n256": 2}, "block_n": 256, "masks": ("none", ), "equal_to": "n256"},
    # diagnostics (wrong numerics: built and timed, not checked): what a step's exponentials cost (P = the exp2's
    # argument), and the step without its softmax (no row max, exp2 or row sum; P = S): the matmuls, barriers, P's
    # rounding and O's rescale, the ceiling of any softmax schedule
    "diag: no exp2": {"patch": ((r"p = gl\.exp2\((s_acc \* qk_scale - \(m_use - 8\.0\)\[:, None\])\)", r"p = \1"), ),
                      "diag": True, "masks": ("none", )},
    "diag: no softmax": {"patch": ((r"m_new = gl\.maximum\(m_i, gl\.max\(s_acc, 1\) \* qk_scale\)", "m_new = m_i"),
                                   (r"p = gl\.exp2\(s_acc \* qk_scale - \(m_use - 8\.0\)\[:, None\]\)", "p = s_acc"),
                                   (r"l_i = l_i \* alpha \+ gl\.sum\(p, 1\)", "l_i = l_i * alpha")),
                         "diag": True, "masks": ("none", )},
}
CANDIDATES = ("head-major", "pv overlap", "n256", "diag: no exp2", "diag: no softmax") if ROUND == "A" else \
    ("head-major", "n256", "n256 turns", "n256 + head-major")  # round A: the P V overlap lost 9% on both masks
TIMED = ("head-major", "pv overlap", "n256", "diag: no softmax") if ROUND == "A" else CANDIDATES  # time's rows
NCU_CANDIDATES = CANDIDATES  # round B's ncu cycles
s7.VARIANTS = VARIANTS
PHASE_TIMEOUT = ({"build": 14, "check": 9, "ncu": 24, "time": 10} if ROUND == "A" else
                 {"build": 20, "check": 10, "ncu_cycles": 13, "time": 14})
TOTAL = 57.5  # the round's 60 s less the parent's start and end: the time phase takes what the others left
RISKY = ()  # checked last (a hang costs only its own rows)
PASSES = 30  # the time phase stops early when its time runs short
BENCH_MS = (10, 50)  # the bench's measure's warm-up and rep ms (the bench's own: 25, 100)
# a full-mask row of 2 x 6 heads x 18 query blocks = 216 tiles: more than the 132 programs (a program takes two)
BIG_FULL = ("none", 1, 2, 6, 2200, 1300, True)
UNIT = 16 * 16384 // 16 * (16384 // 128)  # 16 rows x 128 keys of the timed call: 2,097,152


def masks_of(name):
    return (VARIANTS[name] or {}).get("masks", s7.MASKS)


def check_cases():
    """(variant, head_dim, s7.CHECKS-style row, window): the product and the candidates on the full rows (s7's and
    BIG_FULL); a candidate at causal also on s7's causal rows."""
    full = [c for c in s7.CHECKS if c[0] == "none"] + [BIG_FULL]
    cases = []
    for n in [n for n in VARIANTS if not (VARIANTS[n] or {}).get("diag") and (n == "product" or n in CANDIDATES)]:
        rows = [c for c in s7.CHECKS + (BIG_FULL, ) if (c in full and (n in ("product", "n256", "n256 turns") or ROUND == "A"
                                                                 or c == BIG_FULL)) or (c == s7.CHECKS[0] and ROUND == "A")
                or (n != "product" and c[0] == "causal" and c[0] in masks_of(n))]
        cases += [(n, 128, c, None) for c in rows if c[0] in masks_of(n)]
    return [c for c in cases if c[0] not in RISKY] + [c for c in cases if c[0] in RISKY]


def jobs():
    used = ("product", ) + TIMED + (NCU_CANDIDATES if ROUND == "B" else ()) + tuple(c[0] for c in check_cases())
    out = [(mask, n, 128, False, 1) for n in VARIANTS if n in used for mask in masks_of(n)]
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
        if not window and gqa == 1:
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
        saved = gpu_fp8.emulate
        if v.get("block_n"):  # the emulation blocked as the module's steps
            gpu_fp8.emulate = lambda *a, _e=saved, _n=v["block_n"], **kw: _e(*a, block_n=_n, **kw)
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
            outs[(name, key)] = got
            if name == "product":
                outs[key] = got
            elif v.get("equal_to") and (v["equal_to"], key) in outs:  # bit for bit another candidate's
                same = all(torch.equal(x, y) for a, b_ in zip(got, outs[(v["equal_to"], key)]) for x, y in zip(a, b_))
                ok = ok and same
                note += f"; {'==' if same else '!='} {v['equal_to']} bitwise"
            elif (v.get("equal") or v.get("mutant")) and key in outs:
                same = all(torch.equal(x, y) for a, b_ in zip(got, outs[key]) for x, y in zip(a, b_))
                ok = ok and (same or v.get("equal") == "note")  # "note": reported, not required
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
        finally:
            gpu_fp8.emulate = saved


NCU_SCRIPT = r"""
import sys, time, torch
sys.path.insert(0, "scripts")
import gpu_fp8fwd_s17 as me, gpu_fp8_fwd_s7 as s7
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
NCU_SECTIONS = ("SourceCounters", "InstructionStats", "WarpStateStats", "SchedulerStats")
NCU_METRICS = "gpc__cycles_elapsed.max,dram__bytes_read.sum,lts__t_sector_hit_rate.pct,smsp__inst_executed.sum"
KERNELS = "regex:attn_fwd_hopper|sdpa"


def phase_ncu():
    """One profiling run (export), then the raw and the source pages read back from the report, in parallel."""
    ncu = _ncu_bin()
    s7.log(f"== ncu: {ncu}")
    if not ncu:
        return
    OUTX.mkdir(parents=True, exist_ok=True)
    rep = OUTX / "prof"
    t0 = time.time()
    base = [ncu, "--profile-from-start", "off", "--clock-control", "base", "-k", KERNELS, "-f", "-o", str(rep)]
    for sec in NCU_SECTIONS:
        base += ["--section", sec]
    app = [sys.executable, "-c", NCU_SCRIPT]
    limit = PHASE_TIMEOUT["ncu"] - 6  # the reads need ~4 s
    r = _run_group(base + ["--metrics", NCU_METRICS] + app, limit)
    if not Path(str(rep) + ".ncu-rep").exists() and time.time() - t0 < 8:  # an unknown metric: the sections alone
        s7.log(f"ncu rc {r.returncode} with the extra metrics ({r.stderr.strip()[-300:]}); again without them")
        r = _run_group(base + app, limit - (time.time() - t0))
    s7.log(f"ncu profile rc {r.returncode} in {time.time() - t0:.1f}s; " + " ".join(
        ln for ln in r.stdout.splitlines() if ln.startswith(("CALLS", "cudnn-fp8 ERROR"))))
    s7.log(" / ".join(ln for ln in r.stderr.splitlines() if ln.startswith("APP ")))
    s7.log(" / ".join(ln for ln in (r.stdout + r.stderr).splitlines() if ln.startswith("==") and "PROF" in ln)[-800:])
    names = next((ln[6:].split("|") for ln in r.stdout.splitlines() if ln.startswith("CALLS ")), ["product", "cudnn-fp8"])
    path = Path(str(rep) + ".ncu-rep")
    if not path.exists():
        s7.log(r.stderr[-800:])
        return
    s7.log(f"report {path.stat().st_size / 1e6:.1f} MB")
    deadline = T_PHASE + PHASE_TIMEOUT["ncu"] - 1.5
    raw_cmd = [ncu, "-i", str(path), "--page", "raw", "--csv"]
    src_cmd = [ncu, "-i", str(path), "--page", "source", "--csv", "--print-source", "sass"]
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
             for c in (raw_cmd, src_cmd)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=max(1.0, deadline - time.time())))
        except subprocess.TimeoutExpired:
            import signal
            os.killpg(p.pid, signal.SIGKILL)
            outs.append(p.communicate())
    (raw, raw_err), (src, src_err) = outs
    if procs[1].returncode and deadline - time.time() > 2:  # an older ncu without --print-source: its default view
        s7.log(f"source page rc {procs[1].returncode}: {src_err.strip()[-300:]}; again without --print-source")
        r2 = _run_group(src_cmd[:-2], deadline - time.time())
        src, src_err = r2.stdout, r2.stderr
    (OUTX / "ncu_raw.csv").write_text(raw + "\n---- stderr\n" + raw_err)
    with gzip.open(OUTX / "ncu_source.csv.gz", "wt") as f:
        f.write(src + "\n---- stderr\n" + src_err)
    s7.log(f"pages read in {time.time() - t0:.1f}s: raw {len(raw)} chars (rc {procs[0].returncode}), source "
           f"{len(src)} chars (rc {procs[1].returncode}) {src_err.strip()[-300:]}")
    path.unlink()  # the pages came back as text; the report (MBs) stays off $OUTX
    text = report_raw(raw, names) + "\n\n" + report_source(src, names)
    s7.log(text)
    (OUTX / "ncu_table.md").write_text(text + "\n")


# Round B: each implementation's kernel cycles at base clock on the full mask, one pass, REPS calls of every
# implementation, interleaved (the order rotated each repetition): argv = REPS, then the candidates.
NCU_CYCLES_SCRIPT = r"""
import sys, torch
sys.path.insert(0, "scripts")
import gpu_fp8fwd_s17 as me, gpu_fp8_fwd_s7 as s7
from fagen.bench import peer_cudnn_fp8 as peer
from fagen.bench.cases import CaseContext
from fagen.bench.workloads import standard_suite
reps, names = int(sys.argv[1]), sys.argv[2:]
keep, calls = [], []
for mask in ("none", ):  # the full mask's gap (causal: the time phase)
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
    mine += [(f"{n} {word}", call(s7.module(mask, n))) for n in names if mask in me.masks_of(n)]
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
NCU_CYCLES_METRICS = "gpc__cycles_elapsed.max,gpu__time_duration.sum,smsp__inst_executed.sum"
NCU_REPS = 2


def phase_ncu_cycles():
    """Round B: each implementation's kernel cycles at base clock (gpc max), NCU_REPS calls a mask, interleaved;
    a candidate's ratio to the product call by call (the product's cycles over the candidate's: above 1 faster)."""
    ncu = _ncu_bin()
    s7.log(f"== ncu cycles: {ncu}")
    if not ncu:
        return
    OUTX.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    skip = os.environ.get("FP8FWD_SKIP", "").split("|")
    cmd = [ncu, "--profile-from-start", "off", "--clock-control", "base", "-k", KERNELS,
           "--metrics", NCU_CYCLES_METRICS, "--page", "raw", "--csv", sys.executable, "-c", NCU_CYCLES_SCRIPT,
           str(NCU_REPS), *[n for n in NCU_CANDIDATES if n not in skip]]
    r = _run_group(cmd, PHASE_TIMEOUT["ncu_cycles"] - 1.5)
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
    for name, k in zip(order, kern):  # the profiled order is the calls' (one attention kernel a call)
        cyc.setdefault(name, []).append(_num(k[col["gpc__cycles_elapsed.max"]]))
    for name, v in cyc.items():
        word = name.rsplit(" ", 1)[1]
        base = cyc.get(f"product {word}")
        note = ""
        if base and len(base) == len(v) and not name.startswith("product"):
            rr = sorted(b / x for b, x in zip(base, v))
            note = (f"; product / this, call by call: median {statistics.median(rr):.4f}, "
                    f"range {rr[0]:.4f}-{rr[-1]:.4f}")
        s7.log(f"ncu cycles {name}: median {statistics.median(v) / 1e6:.4f} M (" +
               " ".join(f"{x / 1e6:.4f}" for x in v) + ")" + note)
        s7.emit(section="ncu", variant=name, mask=word, value=round(statistics.median(v) / 1e6, 4), note=note)



# the rows of the compact table: (label, metric name in the raw page)
NCU_ROWS = (
    ("duration (ns)", "gpu__time_duration.sum"), ("cycles (gpc max)", "gpc__cycles_elapsed.max"),
    ("grid", "launch__grid_size"), ("threads a CTA", "launch__block_size"),
    ("registers a thread", "launch__registers_per_thread"),
    ("instructions (warp)", "smsp__inst_executed.sum"),
    ("issue active % (SMSP)", "smsp__issue_active.avg.pct_of_peak_sustained_active"),
    ("warp cycles per issue", "smsp__average_warp_latency_per_inst_issued.ratio"),
    ("eligible warps / cycle", "smsp__warps_eligible.avg.per_cycle_active"),
    ("no eligible %", "smsp__issue_inst0.avg.pct_of_peak_sustained_active"),
    ("DRAM bytes read", "dram__bytes_read.sum"), ("L2 hit %", "lts__t_sector_hit_rate.pct"),
)
STALL = "smsp__average_warps_issue_stalled_"


def _num(x):
    try:
        return float(str(x).replace(",", ""))
    except ValueError:
        return 0.0


def report_raw(text, names):
    """The compact table from the raw page's CSV: one column a profiled kernel (the calls' order)."""
    rows = list(csv.reader(io.StringIO("\n".join(ln for ln in text.splitlines() if ln.startswith('"')))))
    if len(rows) < 3:
        return "ncu raw: no rows"
    head = rows[0]
    col = {h: i for i, h in enumerate(head)}
    kern = [r for r in rows[1:] if "ID" not in col or r[col["ID"]].strip().isdigit()]  # not the units row

    def val(k, m):
        i = col.get(m)
        return k[i] if i is not None and i < len(k) else ""
    labels = [f"{names[j] if j < len(names) else '?'}: {val(k, 'Kernel Name')[:28]}" for j, k in enumerate(kern)]
    out = ["| ncu, base clock | " + " | ".join(labels) + " |", "|---|" + "---:|" * len(kern)]
    for label, m in NCU_ROWS:
        out.append(f"| {label} | " + " | ".join(val(k, m) for k in kern) + " |")
    stalls = [h for h in head if h.startswith(STALL) and h.endswith("_per_issue_active.ratio")]
    score = {h: max((_num(val(k, h)) for k in kern), default=0) for h in stalls}
    for h in sorted(stalls, key=lambda h: -score[h])[:12]:
        out.append(f"| stall {h[len(STALL):-len('_per_issue_active.ratio')]} (warps / issue) | "
                   + " | ".join(val(k, h) for k in kern) + " |")
    out += [f"kernel {j}: {val(k, 'Kernel Name')[:300]}" for j, k in enumerate(kern)]
    return "\n".join(out)


def opclass(text):
    """A SASS instruction's class for the tables (its opcode without the predicate and modifiers, grouped)."""
    op = re.sub(r"^@!?U?P\w+\s+", "", text.strip()).split(" ")[0]
    base = op.split(".")[0]
    if base in ("HGMMA", "QGMMA", "IGMMA", "BGMMA"):
        return "GMMA"
    if op.startswith("WARPGROUP.DEPBAR"):
        return "GMMA wait (DEPBAR)"
    if op.startswith("WARPGROUP.ARRIVE"):
        return "GMMA fence (WARPGROUP.ARRIVE)"
    if op.startswith("SYNCS.PHASECHK"):
        return "mbarrier wait (SYNCS.PHASECHK)"
    if op.startswith("SYNCS"):
        return "mbarrier arrive (SYNCS)"
    if base in ("BAR", "NANOSLEEP", "WARPSYNC"):
        return base
    if base in ("F2F", "F2FP", "I2F", "F2I", "I2FP"):
        return "conversion (" + base + ")"
    if base in ("LDS", "LDSM", "STS", "STSM", "LDGSTS", "UBLKCP", "UTMALDG", "UTMASTG", "LDG", "STG", "LDL", "STL"):
        return "memory (" + base + ")"
    if base.startswith("U") and base not in ("UTMALDG", "UTMASTG"):
        return "uniform (U*)"
    if base in ("IMAD", "IADD3", "VIADD", "LEA", "ISETP", "IABS", "SHF", "LOP3", "PLOP3", "SEL", "MOV", "S2R", "CS2R",
                "S2UR", "R2UR", "P2R", "R2P", "ELECT", "VOTE", "VOTEU", "POPC", "FLO", "BREV"):
        return "integer / moves (" + base + ")" if base in ("LOP3", "SHF", "SEL", "IMAD", "MOV") else "integer / other"
    if base in ("BRA", "EXIT", "CALL", "RET", "BSSY", "BSYNC", "YIELD", "JMP", "BRX"):
        return "control"
    return base


def _source_blocks(text):
    """The source page's CSV split by kernel: [(header, rows)], one per header row ("Address" and "Source")."""
    blocks = []
    for row in csv.reader(io.StringIO("\n".join(ln for ln in text.splitlines() if ln.startswith('"')))):
        if any("Address" in h for h in row) and "Source" in row:
            blocks.append(([("Address" if h.endswith("Address") else h) for h in row], []))
        elif blocks and len(row) == len(blocks[-1][0]):
            blocks[-1][1].append(row)
    return blocks


def report_source(text, names, top=28, unit=UNIT):
    """Per kernel: warp-level instructions executed by opcode class per `unit`, stall samples by opcode class, and
    the instructions with the most samples (with the two before them)."""
    blocks = _source_blocks(text)
    if not blocks:
        return "ncu source: no rows (" + text.strip()[:300].replace("\n", " / ") + ")"
    out = []
    for j, (head, rows) in enumerate(blocks):
        name = names[j] if j < len(names) else f"kernel {j}"
        col = {h: i for i, h in enumerate(head)}
        ex_c = next((i for h, i in col.items() if h == "Instructions Executed"), None)
        all_c = next((i for h, i in col.items() if "Sampling (All" in h), None)
        ni_c = next((i for h, i in col.items() if "Not-issued" in h or "Not Issued" in h), None)
        reasons = [(h, i) for h, i in col.items() if "stall" in h.lower() and i not in (all_c, ni_c)]
        out.append(f"### {name}: {len(rows)} SASS instructions; columns: {head}")
        ins = [(r[col["Address"]], r[col["Source"]], _num(r[ex_c]) if ex_c is not None else 0.0,
                _num(r[all_c]) if all_c is not None else 0.0, _num(r[ni_c]) if ni_c is not None else 0.0,
                {h: _num(r[i]) for h, i in reasons}) for r in rows]
        tot_ex = sum(x[2] for x in ins) or 1.0
        tot_s = sum(x[3] for x in ins) or 1.0
        by = collections.defaultdict(lambda: [0.0, 0.0, 0.0])
        for _, src, ex, sa, ni, _ in ins:
            c = opclass(src)
            by[c][0] += ex
            by[c][1] += sa
            by[c][2] += ni
        out.append(f"executed {tot_ex:.4g} warp instructions ({tot_ex / unit:.1f} per 16 rows x 128 keys), "
                   f"{tot_s:.0f} stall samples")
        out.append("| class | executed per 16x128 | % of executed | stall samples % | not-issued samples % |")
        out.append("|---|---:|---:|---:|---:|")
        for c, (ex, sa, ni) in sorted(by.items(), key=lambda kv: -max(kv[1][0] / tot_ex, kv[1][1] / tot_s)):
            if ex / tot_ex < 0.002 and sa / tot_s < 0.002:
                continue
            out.append(f"| {c} | {ex / unit:.1f} | {100 * ex / tot_ex:.1f} | {100 * sa / tot_s:.1f} | "
                       f"{100 * ni / tot_s:.1f} |")
        out.append(f"top {top} instructions by stall samples (address, executed per 16x128, samples %, not-issued %, "
                   f"reasons; the two before):")
        order = sorted(range(len(ins)), key=lambda i: -ins[i][3])[:top]
        for i in sorted(order):
            a, src, ex, sa, ni, rs = ins[i]
            why = ", ".join(f"{h} {100 * v / tot_s:.1f}" for h, v in sorted(rs.items(), key=lambda kv: -kv[1])[:3]
                            if v > 0)
            prev = " | ".join(ins[k][1].strip()[:48] for k in range(max(0, i - 2), i))
            out.append(f"  {a} {src.strip()[:60]:<60} ex {ex / unit:6.2f} samp {100 * sa / tot_s:5.2f}% ni "
                       f"{100 * ni / tot_s:5.2f}% {why} <- {prev}")
    return "\n".join(out)


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
        makers += [(f"fp8 {n}", lambda n=n, mask=mask: fp8_call(s7.module(mask, n)), cc) for n in TIMED
                   if n not in skip and mask in masks_of(n)]
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
            left = float(os.environ.get("FP8FWD17_TIME_LIMIT", PHASE_TIMEOUT["time"])) - (time.time() - T_PHASE)
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
        {"build": phase_build, "ncu": phase_ncu, "ncu_cycles": phase_ncu_cycles, "check": phase_check,
         "time": phase_time}[sys.argv[2]]()
        return
    env = child_env("/tmp/fagen-cache-gpu-fp8fwd-s17")
    env["FP8FWD17_ROUND"] = ROUND
    env["OUTX"] = str(OUTX)
    rows = []
    for name in PHASE_TIMEOUT:
        limit = PHASE_TIMEOUT[name]
        if name == "time":  # what the earlier phases left
            limit = max(6.0, TOTAL - (time.time() - s7.T0))
            env["FP8FWD17_TIME_LIMIT"] = f"{limit:.1f}"
        s7.log(f"#### phase {name} (timeout {limit:.0f}s, {time.time() - s7.T0:.0f}s so far)")

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
    ncu = OUTX / "ncu_table.md"
    (OUTX / "table.txt").write_text(text + "\n" + (ncu.read_text() if ncu.exists() else "(no ncu table)\n"))


if __name__ == "__main__":
    try:
        main()
    except Exception:  # noqa: BLE001
        traceback.print_exc()
