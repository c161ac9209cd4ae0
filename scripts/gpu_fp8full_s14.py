"""The fp8 (e4m3) Gluon forward, fourteenth session (issue 28): the spread and the full mask's last wave, on an H100.

Round A (FP8FULL_ROUND=A): every timed row with the GPU's SM clock, power draw and clock-event (throttle) reasons
sampled beside it (NVML through ctypes in a separate process, every 5 ms; each do_bench call's window is logged and
the samples inside it are that call's clock / power): cuDNN's fp8 SDPA (the bench's cudnn-fp8 peer) and fagen's fp8
product on the standard suite's own fp8 inputs, the fp8 product on random inputs (scripts/gpu_fp8.py's quantize), fagen
bf16, causal and full, PASSES passes with the row order rotated; then the full mask's idle share: the product at H 16
(2048 tiles: 15.5 waves of 132), H 32 and H 33 (4224 tiles: 32 whole waves) on random inputs; then, where ncu is on
the machine, Nsight Compute of the full-mask kernel on random and on the bench's inputs (clocks locked to base).
The full mask's tail split (GluonBackend.variant fp8_tail_split, [Note] fp8 tail split): checked against the product
(bit for bit before the split) and float64 on the split rows, timed at C 8 and C 4 on random inputs and C 8 on the
bench's inputs beside the product.

    PYTHONPATH=$PWD FP8FULL_ROUND=A python3 scripts/gpu_fp8full_s14.py   # < 70 s on an H100; $OUTX gets the samples

Phases (each a child process with a timeout; scripts/_phases.py): build, time, ncu.
docs/hopper.md, "fp8 forward: the full mask and the spread (fourteenth session)".
"""

from __future__ import annotations

import json
import os
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

ROUND = os.environ.get("FP8FULL_ROUND", "B")
s7.VARIANTS = {"product": None, "tail split": {"variant": {"fp8_tail_split": 8}}}
PHASE_TIMEOUT = {"build": 16, "time": 32, "ncu": 18} if ROUND == "B" else {"build": 20, "time": 30, "ncu": 16}
PASSES = 8
PASSES_B = 10
TAIL_CS = (8, 4)  # round B: the tail split's chunk counts timed
OUTX = Path(os.environ.get("OUTX") or os.environ.get("OUT") or "/tmp/fp8full-out")
SAMPLES = OUTX / "nvml_samples.txt"
WINDOWS = OUTX / "windows.jsonl"

# The sampler: NVML by ctypes (no pynvml needed), one line per sample: wall time, SM clock MHz, memory clock MHz,
# power mW (the driver's average), instant power mW (field 186, -1 if absent), clock-event reasons (bit mask),
# temperature C.
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
REASONS = {0x1: "idle", 0x2: "app", 0x4: "swpower", 0x8: "hwslow", 0x20: "swthermal", 0x40: "hwthermal",
           0x80: "powerbrake"}


def _warm_real(job):
    """Build a module by calling it at the timed shape (B1 H16 s16k: the launches' integer specialisations), with
    per-tensor descales or the bench rows' per-KV-head k / v descales (a head stride of 1 specialises too)."""
    kind, mask, per_head = job
    t = time.time()
    try:
        import torch
        import fagen
        b, h, s, d = s7.TIME_SHAPE
        h = 33 if per_head == "H33" else h
        per_head = per_head is True
        if kind == "bench":  # the standard suite's row through the bench's own preparer (its spec, its inputs)
            from fagen.bench import impls
            from fagen.bench.cases import CaseContext
            from fagen.bench.workloads import standard_suite
            case = next(c for c in standard_suite() if c.name == mask)
            cc = CaseContext(case, torch.device("cuda"), 1)
            impls.prepare_fagen(case, cc).fn(cc.sets[0])
        elif kind == "bf16":
            x = [torch.randn((b, h, s, d), device="cuda", dtype=torch.bfloat16) for _ in range(3)]
            fagen.load(s7.spec_of(mask, "bf16")).forward(*x)
        else:
            m = s7.module(mask, kind)
            x = [torch.randn((b, h, s, d), device="cuda").to(torch.float8_e4m3fn) for _ in range(3)]
            sc = {"k_descale": torch.ones(h, device="cuda"), "v_descale": torch.ones(h, device="cuda")} if per_head \
                else {}
            m.forward(*x, **sc)
        torch.cuda.synchronize()
        return f"built {kind} {mask} H{h}{' per-head' if per_head else ''} in {time.time() - t:.1f}s"
    except Exception as e:  # noqa: BLE001
        return f"build ERROR {kind} {mask}: {type(e).__name__}: {str(e).splitlines()[0][:200]}"


def phase_build():
    import multiprocessing as mp
    work = [("bf16", m, False) for m in s7.MASKS] + [("product", m, ph) for m in s7.MASKS for ph in (False, True)]
    work += [("tail split", "none", ph) for ph in (False, True)] + [("product", "none", "H33")]
    if ROUND == "B":
        work = [("bench", f"fwd{x}-d128-{m}-s16k", False) for x in ("", "-fp8") for m in ("causal", "full")]
        work += [("tail split", "none", ph) for ph in (False, True)] + [("product", "none", False)]
    s7.log(f"== build: {len(work)} modules / specialisations")
    with mp.get_context("spawn").Pool(len(work)) as pool:
        for msg in pool.imap_unordered(_warm_real, work):
            s7.log(msg)


def bench_set(mask, peer_too=True):
    """The standard suite's fwd-fp8-d128-<mask>-s16k row: (CaseContext, its peer's Prepared or an error string)."""
    import torch
    from fagen.bench import peer_cudnn_fp8 as peer
    from fagen.bench.cases import CaseContext
    from fagen.bench.workloads import standard_suite
    row = f"fwd-fp8-d128-{'causal' if mask == 'causal' else 'full'}-s16k"
    case = next(c for c in standard_suite() if c.name == row)
    cc = CaseContext(case, torch.device("cuda"), 1)
    if not peer_too:
        return cc, None
    try:
        return cc, peer.prepare_cudnn_fp8(cc.case, cc)
    except Exception as e:  # noqa: BLE001
        return cc, f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"


def fp8_bench_call(m, st):
    sc = {n: t for n, t in st.scores.items() if n not in ("k_scale", "v_scale")}
    return lambda: m.forward(st.q, st.k, st.v, k_descale=st.scores["k_scale"], v_descale=st.scores["v_scale"],
                             **st.kwargs, **sc)


def fp8_random_call(m, t):
    return lambda: m.forward(t[0][0], t[1][0], t[2][0], q_descale=t[0][1], k_descale=t[1][1], v_descale=t[2][1])


def random_fp8(g, b, h, s, d):
    import torch
    import gpu_fp8
    return [gpu_fp8.quantize(torch.randn((b, h, s, d), generator=g, device="cuda"), False) for _ in range(3)]


def check_split(m, sp, t):
    """The tail split (GluonBackend.variant fp8_tail_split; module sp) against the product (m): rows before the split
    bit for bit, and both against float64 on the dequantized inputs on head 0's and the last head's rows past it."""
    import torch
    import gpu_fp8
    (q, dq), (k, dk), (v, dv) = t
    po, pl = fp8_random_call(m, t)()
    so, sl = fp8_random_call(sp, t)()
    s = q.shape[2]
    split = sp._tail_split(1, q.shape[1], -(-s // 128), k.shape[2], 132, True)
    rows0 = split[0] * 128 if split else s
    ok = bool(split)
    for hh in (0, q.shape[1] - 1):
        rows = slice(min(rows0, s - 640) - 64, s)
        qd = gpu_fp8.dequantize(q[:, hh:hh + 1, rows], dq).double()[0, 0]
        kd = gpu_fp8.dequantize(k[:, hh:hh + 1], dk).double()[0, 0]
        vd = gpu_fp8.dequantize(v[:, hh:hh + 1], dv).double()[0, 0]
        sc = qd @ kd.T / 128 ** 0.5
        lse = torch.logsumexp(sc, -1)
        ref = torch.softmax(sc, -1) @ vd
        errs = {}
        for name, o, l in (("product", po, pl), ("split", so, sl)):
            errs[name] = ((o[0, hh, rows].double() - ref).pow(2).mean().sqrt().item(),
                          (l[0, hh, rows].double() - lse).abs().max().item())
            s7.log(f"check split: head {hh} rows {rows.start}..{s - 1} {name}: rmse {errs[name][0]:.3e} lse max err "
                   f"{errs[name][1]:.2e}")
        ok = ok and errs["split"][0] <= 1.1 * errs["product"][0] and errs["split"][1] <= 1e-3
    same = torch.equal(so[:, :, :rows0], po[:, :, :rows0]) and torch.equal(sl[:, :, :rows0], pl[:, :, :rows0])
    s7.log(f"check split {split}: rows before it {'==' if same else '!='} product bitwise; after it max |out diff| "
           f"{(so - po).abs().max().item():.3e}, |lse diff| {(sl - pl).abs().max().item():.2e}")
    s7.emit(section="check", variant="tail split", case="random full H16 s16k", value="PASS" if ok and same else "FAIL")
    return ok and same


def phase_time():
    import torch
    import triton
    import fagen
    b, h, s, d = s7.TIME_SHAPE
    OUTX.mkdir(parents=True, exist_ok=True)
    sampler = subprocess.Popen([sys.executable, "-c", SAMPLER, str(SAMPLES), str(PHASE_TIMEOUT["time"] + 2)])
    t_start = time.time()
    s7.log(f"== time: B{b} H{h} S{s}; {torch.cuda.get_device_name()}; torch {torch.__version__}, "
           f"triton {triton.__version__}")
    rows = []  # (label, mask, flops, fn)
    keep = []
    for mask in s7.MASKS:
        flops = 4 * b * h * s * s * d / (2 if mask == "causal" else 1)
        cc, prepared = bench_set(mask)
        keep.append(cc)
        st = cc.sets[0]
        if isinstance(prepared, str):
            s7.emit(section="time", variant="cudnn-fp8", mask=mask, value="ERROR", note=prepared)
        else:
            rows.append(("cudnn-fp8", mask, flops, lambda p=prepared, st=st: p.fn(st)))
        m = s7.module(mask, "product")
        rows.append(("fp8 bench inputs", mask, flops, fp8_bench_call(m, st)))
    g = torch.Generator(device="cuda").manual_seed(1)
    q8 = random_fp8(g, b, h, s, d)
    x = [torch.randn((b, h, s, d), generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    for mask in s7.MASKS:
        flops = 4 * b * h * s * s * d / (2 if mask == "causal" else 1)
        m = s7.module(mask, "product")
        rows.append(("fp8 random inputs", mask, flops, fp8_random_call(m, q8)))
        bf = fagen.load(s7.spec_of(mask, "bf16")).forward
        rows.append(("fagen bf16", mask, flops, lambda bf=bf: bf(*x)))
    m = s7.module("none", "product")
    for hh in (32, 33):  # the full mask's waves: H16 2048 tiles (15.52 waves of 132), H32 4096 (31.03), H33 32
        qh = random_fp8(g, b, hh, s, d)
        keep.append(qh)
        rows.append((f"fp8 random inputs H{hh}", "none", 4 * b * hh * s * s * d, fp8_random_call(m, qh)))
    try:  # the tail split ([Note] fp8 tail split): checked, then timed at C 8 and C 4 (the module's _TAIL_C)
        sp = s7.module("none", "tail split")
        if check_split(m, sp, q8):
            for c in (8, 4):
                def run(call, c=c, sp=sp):
                    sp._TAIL_C = c
                    return call()
                rows.append((f"fp8 random inputs, tail split C{c}", "none", 4 * b * h * s * s * d,
                             lambda run=run, call=fp8_random_call(sp, q8): run(call)))
            st = keep[1].sets[0]
            rows.append(("fp8 bench inputs, tail split C8", "none", 4 * b * h * s * s * d,
                         lambda sp=sp, call=fp8_bench_call(sp, st): (setattr(sp, "_TAIL_C", 8), call())))
    except Exception as e:  # noqa: BLE001
        s7.log(f"split: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        traceback.print_exc(limit=4)
    times, windows = {}, []
    for label, mask, _, fn in rows:
        fn()
    torch.cuda.synchronize()
    s7.log(f"warm ({time.time() - s7.T0:.0f}s)")
    t_passes = time.time()
    for p in range(PASSES):
        left = PHASE_TIMEOUT["time"] - (time.time() - t_start)
        if p and (time.time() - t_passes) / p * 1.2 > left - 3:
            s7.log(f"pass {p} skipped: the phase's time is short")
            break
        k = p * len(rows) // PASSES
        for label, mask, flops, fn in rows[k:] + rows[:k]:
            t0 = time.time()
            ms = triton.testing.do_bench(fn, warmup=5, rep=30, return_mode="median")
            t1 = time.time()
            times.setdefault((label, mask), []).append(ms)
            windows.append({"row": label, "mask": mask, "pass": p, "t0": t0, "t1": t1, "ms": ms,
                            "tf": flops / ms / 1e9})
        s7.log(f"pass {p} done ({time.time() - s7.T0:.0f}s)")
        WINDOWS.write_text("".join(json.dumps(w) + "\n" for w in windows))  # kept if the phase is killed
    # sustained: the full row 1.5 s back to back, fp8 random then cuDNN (the clock's settling under each)
    for label in ("fp8 random inputs", "cudnn-fp8"):
        fn = next((r[3] for r in rows if r[0] == label and r[1] == "none"), None)
        if fn is None or time.time() - t_start > PHASE_TIMEOUT["time"] - 5:
            continue
        t0 = time.time()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        n = 0
        ev[0].record()
        while time.time() - t0 < 1.5:
            fn()
            n += 1
            if n % 50 == 0:
                torch.cuda.synchronize()
        ev[1].record()
        torch.cuda.synchronize()
        ms = ev[0].elapsed_time(ev[1]) / n
        windows.append({"row": f"sustained 1.5 s: {label}", "mask": "none", "pass": 0, "t0": t0, "t1": time.time(),
                        "ms": ms, "tf": 4 * b * h * s * s * d / ms / 1e9})
    WINDOWS.write_text("".join(json.dumps(w) + "\n" for w in windows))
    sampler.terminate()
    sampler.wait()
    report(windows)


def phase_time_bench():
    """Round B: the standard suite's own measure (fagen.bench.timing.measure: the rows' 3 input sets rotated, do_bench's
    L2 flush, 10 / 50 ms), PASSES passes rotated, NVML sampled as in round A: cudnn-fp8, the fp8 product through the
    bench's prepare_fagen and bf16 through the bench's bf16 rows, causal and full; the tail split at TAIL_CS on the
    bench's full row (called as prepare_fagen calls the product) and on random inputs beside the product."""
    import torch
    import triton
    from fagen.bench import impls, peer_cudnn_fp8 as peer
    from fagen.bench.cases import CaseContext
    from fagen.bench.timing import measure
    from fagen.bench.workloads import standard_suite
    b, h, s, d = s7.TIME_SHAPE
    OUTX.mkdir(parents=True, exist_ok=True)
    sampler = subprocess.Popen([sys.executable, "-c", SAMPLER, str(SAMPLES), str(PHASE_TIMEOUT["time"] + 2)])
    t_start = time.time()
    s7.log(f"== time (bench measure): B{b} H{h} S{s}; {torch.cuda.get_device_name()}; torch {torch.__version__}, "
           f"triton {triton.__version__}")
    dev = torch.device("cuda")
    suite = {c.name: c for c in standard_suite()}
    rows, keep = [], []  # (label, mask, flops, call(i), n_sets)
    sp = s7.module("none", "tail split")

    def split_call(c, fn):
        def call(i):
            sp._TAIL_C = c
            return fn(i)
        return call
    for mask in s7.MASKS:
        flops = 4 * b * h * s * s * d / (2 if mask == "causal" else 1)
        word = "causal" if mask == "causal" else "full"
        cc = CaseContext(suite[f"fwd-fp8-d128-{word}-s16k"], dev, 3)
        bcc = CaseContext(suite[f"fwd-d128-{word}-s16k"], dev, 3)
        keep += [cc, bcc]
        try:
            prepared = peer.prepare_cudnn_fp8(cc.case, cc)
            rows.append(("cudnn-fp8", mask, flops, lambda i, p=prepared, cc=cc: p.fn(cc.sets[i]), len(cc.sets)))
        except Exception as e:  # noqa: BLE001
            s7.emit(section="time", variant="cudnn-fp8", mask=mask, value="ERROR", note=str(e).splitlines()[0][:160])
        pf = impls.prepare_fagen(cc.case, cc).fn
        rows.append(("fp8 product (bench's prepare_fagen)", mask, flops, lambda i, pf=pf, cc=cc: pf(cc.sets[i]),
                     len(cc.sets)))
        bf = impls.prepare_fagen(bcc.case, bcc).fn
        rows.append(("fagen bf16 (bench row)", mask, flops, lambda i, bf=bf, bcc=bcc: bf(bcc.sets[i]), len(bcc.sets)))
        if mask == "none":
            for c in TAIL_CS:
                rows.append((f"fp8 tail split C{c} (bench inputs)", mask, flops, split_call(
                    c, lambda i, cc=cc: fp8_bench_call(sp, cc.sets[i])()), len(cc.sets)))
    g = torch.Generator(device="cuda").manual_seed(1)
    q8 = random_fp8(g, b, h, s, d)
    flops = 4 * b * h * s * s * d
    m = s7.module("none", "product")
    rows.append(("fp8 random inputs", "none", flops, lambda i, f=fp8_random_call(m, q8): f(), 1))
    for c in TAIL_CS:
        rows.append((f"fp8 random inputs, tail split C{c}", "none", flops,
                     split_call(c, lambda i, f=fp8_random_call(sp, q8): f()), 1))
    try:
        check_split(m, sp, q8)
    except Exception as e:  # noqa: BLE001
        s7.log(f"split check: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    windows = []
    with torch.no_grad():
        for row in rows:
            row[3](0)
        torch.cuda.synchronize()
        s7.log(f"warm ({time.time() - s7.T0:.0f}s)")
        t_passes = time.time()
        for p in range(PASSES_B):
            left = PHASE_TIMEOUT["time"] - (time.time() - t_start)
            if p and (time.time() - t_passes) / p * 1.15 > left - 9:  # 9 s: the steady-state runs and the report
                s7.log(f"pass {p} skipped: the phase's time is short")
                break
            k = p * len(rows) // PASSES_B
            for label, mask, flops, fn, n in rows[k:] + rows[:k]:
                t0 = time.time()
                ms = measure(fn, n, dev, 10, 50)
                windows.append({"row": label, "mask": mask, "pass": p, "t0": t0, "t1": time.time(), "ms": ms,
                                "tf": flops / ms / 1e9})
            s7.log(f"pass {p} done ({time.time() - s7.T0:.0f}s)")
            WINDOWS.write_text("".join(json.dumps(w) + "\n" for w in windows))
        # steady state at the power cap: the full row 1 s back to back each, in the order A B C C B A
        sus = [r for r in rows if r[1] == "none" and r[0] in ("fp8 product (bench's prepare_fagen)", "cudnn-fp8",
                                                                  f"fp8 tail split C{TAIL_CS[0]} (bench inputs)")]
        for label, mask, flops, fn, n in sus + sus[::-1]:
            if time.time() - t_start > PHASE_TIMEOUT["time"] - 4:
                break
            t0 = time.time()
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            k = 0
            ev[0].record()
            while time.time() - t0 < 1.0:
                fn(k % n)
                k += 1
                if k % 40 == 0:
                    torch.cuda.synchronize()
            ev[1].record()
            torch.cuda.synchronize()
            ms = ev[0].elapsed_time(ev[1]) / k
            windows.append({"row": f"sustained 1 s: {label}", "mask": mask, "pass": len(windows), "t0": t0,
                            "t1": time.time(), "ms": ms, "tf": flops / ms / 1e9})
    sampler.terminate()
    sampler.wait()
    report(windows)


def load_samples():
    out, limit = [], None
    for line in (SAMPLES.read_text() if SAMPLES.exists() else "").splitlines():
        if line.startswith("# power limit"):
            limit = int(line.split()[3]) / 1000
            continue
        f = line.split()
        if len(f) == 7:
            out.append((float(f[0]), int(f[1]), int(f[2]), int(f[3]) / 1000, int(f[4]) / 1000, int(f[5]),
                        int(f[6])))
    return out, limit


def report(windows):
    samples, limit = load_samples()
    s7.log(f"== NVML: {len(samples)} samples, enforced power limit {limit} W")
    per = {}
    for w in windows:
        inside = [x for x in samples if w["t0"] <= x[0] <= w["t1"]]
        w["clk"] = statistics.median(x[1] for x in inside) if inside else None
        w["pw"] = statistics.mean(x[3] for x in inside) if inside else None
        w["pwi"] = max(x[4] for x in inside) if inside else None
        w["reasons"] = 0
        for x in inside:
            w["reasons"] |= x[5]
        w["cap"] = sum(bool(x[5] & 0x4) for x in inside) / len(inside) if inside else None
        w["temp"] = max(x[6] for x in inside) if inside else None
        per.setdefault((w["row"], w["mask"]), []).append(w)
    for (row, mask), ws in per.items():
        tf = statistics.median(w["tf"] for w in ws)
        clk = [w["clk"] for w in ws if w["clk"]]
        pw = [w["pw"] for w in ws if w["pw"]]
        norm = [w["tf"] * 1980 / w["clk"] for w in ws if w["clk"]]
        rs = 0
        for w in ws:
            rs |= w["reasons"]
        passes = " ".join(f"{w['tf']:.0f}@{w['clk']}" for w in ws)
        names = "+".join(n for bit, n in REASONS.items() if rs & bit) or "none"
        s7.emit(section="time", variant=row, mask=mask, value=round(tf, 1),
                note=(f"clk {min(clk) if clk else '-'}-{max(clk) if clk else '-'} MHz (median "
                      f"{statistics.median(clk) if clk else '-'}), power {statistics.mean(pw) if pw else 0:.0f} W "
                      f"(max inst {max((w['pwi'] or 0) for w in ws):.0f}), power-cap share "
                      f"{statistics.mean(w['cap'] for w in ws if w['cap'] is not None) if clk else 0:.2f}, reasons "
                      f"{names}, temp {max((w['temp'] or 0) for w in ws)} C; TF/s at 1980 MHz "
                      f"{statistics.median(norm) if norm else 0:.1f} [passes "
                      f"{passes}]"))
    for mask in s7.MASKS:  # the ratio against cuDNN pass by pass, with both rows' clocks
        cu = {w["pass"]: w for w in per.get(("cudnn-fp8", mask), [])}
        for row in [r for r, mk in per if mk == mask and r.startswith("fp8") and "H3" not in r]:
            pairs = [(w["tf"] / cu[w["pass"]]["tf"], w["clk"], cu[w["pass"]]["clk"]) for w in per.get((row, mask), [])
                     if w["pass"] in cu]
            if pairs:
                s7.log(f"ratio {row} / cudnn-fp8 {mask}: median {statistics.median(p[0] for p in pairs):.3f}; "
                       f"by pass (ratio, fp8 MHz, cudnn MHz): "
                       + " ".join(f"{r:.3f}/{a}/{c}" for r, a, c in pairs))
    for x, y in (("fp8 random inputs, tail split C8", "fp8 random inputs"),
                 ("fp8 random inputs, tail split C4", "fp8 random inputs"),
                 ("fp8 bench inputs, tail split C8", "fp8 bench inputs"),
                 *((f"fp8 tail split C{c} (bench inputs)", "fp8 product (bench's prepare_fagen)") for c in TAIL_CS),
                 *((f"fp8 random inputs, tail split C{c}", "fp8 random inputs") for c in TAIL_CS if c not in (8, 4))):
        base = {w["pass"]: w for w in per.get((y, "none"), [])}
        r = [w["tf"] / base[w["pass"]]["tf"] for w in per.get((x, "none"), []) if w["pass"] in base]
        if r:
            s7.log(f"ratio {x} / {y} (full): median {statistics.median(r):.3f}, by pass "
                   + " ".join(f"{v:.3f}" for v in r))
    ms = {hh: statistics.median(w["ms"] for w in per[key]) for hh, key in
          ((16, ("fp8 random inputs", "none")), (32, ("fp8 random inputs H32", "none")),
           (33, ("fp8 random inputs H33", "none"))) if per.get(key)}
    if len(ms) == 3:  # rounds of 132 tiles: H16 16 (15.52 balanced), H32 32 (31.03), H33 32 (32)
        s7.log(f"full mask waves: time H32 / H16 {ms[32] / ms[16]:.4f}, H33 / H16 {ms[33] / ms[16]:.4f}, H33 / H32 "
               f"{ms[33] / ms[32]:.4f} (the last wave idle: 2.0, 2.0, 1.0; perfectly balanced: 2.0, 2.0625, 1.03125)")


NCU_SCRIPT = r"""
import sys, torch
sys.path.insert(0, "scripts")
import gpu_fp8full_s14 as me, gpu_fp8_fwd_s7 as s7
m = s7.module("none", "product")
g = torch.Generator(device="cuda").manual_seed(1)
q8 = me.random_fp8(g, 1, 16, 16384, 128)
cc, _ = me.bench_set("none", False)
fr, fb = me.fp8_random_call(m, q8), me.fp8_bench_call(m, cc.sets[0])
fr(); fb(); torch.cuda.synchronize()
fr(); fb(); torch.cuda.synchronize()
"""
NCU_METRICS = ("gpu__time_duration.sum,gpc__cycles_elapsed.max,sm__cycles_elapsed.avg.per_second,"
               "dram__bytes_read.sum,lts__t_sector_hit_rate.pct,sm__inst_executed.sum,"
               "sm__throughput.avg.pct_of_peak_sustained_elapsed")


NCU_SCRIPT_B = r"""
import sys, torch
sys.path.insert(0, "scripts")
import gpu_fp8full_s14 as me, gpu_fp8_fwd_s7 as s7
m, sp = s7.module("none", "product"), s7.module("none", "tail split")
cc, prepared = me.bench_set("none")
st = cc.sets[0]
calls = [("product", me.fp8_bench_call(m, st))]
if not isinstance(prepared, str):
    calls.append(("cudnn-fp8", lambda: prepared.fn(st)))
for c in (8, 4):
    calls.append((f"tail split C{c}", lambda c=c, f=me.fp8_bench_call(sp, st): (setattr(sp, "_TAIL_C", c), f())))
for _, f in calls:
    f(); f()
torch.cuda.synchronize()
torch.cuda.profiler.start()
for name, f in calls:
    torch.cuda._sleep(1000)  # a separator kernel
    f()
torch.cuda.synchronize()
torch.cuda.profiler.stop()
print("CALLS " + "|".join(n for n, _ in calls))
"""
NCU_METRICS_B = "gpu__time_duration.sum,gpc__cycles_elapsed.max,sm__cycles_elapsed.avg.per_second,sm__inst_executed.sum"


def phase_ncu():
    """Nsight Compute at its default clock control (clocks locked to base): round A the full kernel on random and on
    the bench's inputs; round B every kernel of one call each of the product, cudnn-fp8 and the tail split (C 8, 4)
    on the bench's full row, summed per call (a spin kernel between calls)."""
    ncu = shutil.which("ncu") or next((str(p) for p in sorted(Path("/usr/local").glob("cuda*/bin/ncu"))), None)
    s7.log(f"== ncu: {ncu}")
    if not ncu:
        return
    if ROUND == "A":
        cmd = [ncu, "-k", "regex:attn_fwd_hopper", "--launch-skip", "2", "--launch-count", "2", "--metrics",
               NCU_METRICS, "--csv", sys.executable, "-c", NCU_SCRIPT]
    else:
        cmd = [ncu, "--profile-from-start", "off", "--metrics", NCU_METRICS_B, "--csv", sys.executable, "-c",
               NCU_SCRIPT_B]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=PHASE_TIMEOUT["ncu"] - 1)
    (OUTX / "ncu.csv").write_text(r.stdout + "\n" + r.stderr)
    if ROUND == "A":
        for line in r.stdout.splitlines():
            if line.startswith('"') and ("attn" in line or "Metric Name" in line):
                f = [c.strip('"') for c in line.split('","')]
                s7.log("ncu " + " | ".join(f[i] for i in (0, 4) if i < len(f)) + " | " + " | ".join(f[-3:]))
    else:
        import csv
        kernels = {}
        names = next((ln[6:].split("|") for ln in r.stdout.splitlines() if ln.startswith("CALLS ")), [])
        for f in csv.reader(ln for ln in r.stdout.splitlines() if ln.startswith('"')):
            if f[0] == "ID":
                continue
            k = kernels.setdefault(int(f[0]), {"name": f[4], "grid": f[8]})
            k[f[12]] = float(f[14].replace(",", ""))
        groups, cur = [], None
        for i in sorted(kernels):
            k = kernels[i]
            if "sleep" in k["name"] or "spin" in k["name"]:
                cur = []
                groups.append(cur)
            elif cur is not None:
                cur.append(k)
        for n, g in zip(names, groups):
            t = sum(k.get("gpu__time_duration.sum", 0) for k in g) / 1e3
            s7.log(f"ncu {n}: {len(g)} kernels, {t:.1f} us at base clock ("
                   + "; ".join(f"{k['name'][:40]} {k['grid']} {k.get('gpu__time_duration.sum', 0) / 1e3:.1f} us "
                               f"{k.get('gpc__cycles_elapsed.max', 0):.0f} cyc "
                               f"{k.get('sm__cycles_elapsed.avg.per_second', 0) / 1e6:.0f} MHz "
                               f"{k.get('sm__inst_executed.sum', 0) / 1e6:.0f} Minst" for k in g) + ")")
            s7.emit(section="ncu", variant=n, mask="none", value=round(t, 1))
    if r.returncode:
        s7.log(f"ncu rc {r.returncode}: {r.stderr[-400:]}")


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--phase":
        {"build": phase_build, "time": phase_time if ROUND == "A" else phase_time_bench,
         "ncu": phase_ncu}[sys.argv[2]]()
        return
    env = child_env("/tmp/fagen-cache-gpu-fp8full-s14")
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
    s7.log(f"total {time.time() - s7.T0:.0f}s")


if __name__ == "__main__":
    try:
        main()
    except Exception:  # noqa: BLE001
        traceback.print_exc()
