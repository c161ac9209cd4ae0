"""The fp8 (e4m3) Gluon forward's exponentials on the FMA pipe, eighteenth session (issue 28): GluonBackend.variant
fp8_exp_poly K (K eighths of each thread's exponentials in the unmasked steps as a polynomial, degree
fp8_exp_poly_deg 2 or 3; [Note] fp8 exp2 on the FMA pipe) against the product and cuDNN's fp8 SDPA.

Phases (each a child process with a timeout; scripts/_phases.py), < 60 s in all:
  build  a pool warms every module at the timed shape (B1 H16 s16k, the bench rows' per-KV-head descales) and at a
         small one;
  check  every candidate against float64 on the dequantized inputs (scripts/gpu_fp8.py's check: RMSE within 1.5x
         the e4m3 emulation's and, at S 4096, the README's bound; lse; the fingerprint; empty rows; a full row of 216
         tiles, more than the 132 programs), and each candidate's RMSE over the product's on the same inputs;
  time   TF/s in the standard suite's measure (fagen.bench.timing.measure: the rows' 3 input sets rotated,
         do_bench's L2 flush), cudnn-fp8 and fagen bf16 through the bench's preparers; every pass a fresh seeded
         permutation of the rows, each candidate's per-pass time ratio to the product (median, quartiles, range).

    python3 scripts/gpu_fp8fwd_s18.py --round A     # round A (B: the default)
    python3 scripts/gpu_fp8fwd_s18.py --dry-run     # every kernel built for sm_90 on the CPU: registers, spills,
                                                    # the step loops' MUFU / FFMA / FADD / IMAD+LEA / STS / LDS

docs/hopper.md, "fp8 forward (eighteenth session)".
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

ROUND = (sys.argv[sys.argv.index("--round") + 1] if "--round" in sys.argv else os.environ.get("FP8FWD18_ROUND", "B")).upper()
OUTX = Path(os.environ.get("OUTX") or os.environ.get("OUT") or "/tmp/fp8fwd18-out")
# name -> None (the product) or {"variant": GluonBackend.variant keys, "fields": spec fields, "patch": ((regex, repl),
# ...) on the render, "equal": bit for bit the product's (True: required, "note": reported), "masks": the masks it
# is built, checked and timed at}
def _poly(k, deg):
    return {"variant": {"fp8_exp_poly": k, "fp8_exp_poly_deg": deg}}


VARIANTS = {
    "product": None,
    # [Note] fp8 exp2 on the FMA pipe: "poly K/8 dD" takes K eighths of each thread's exponentials of an unmasked step
    "poly 0.5/8 d2": _poly(0.5, 2),  # a sixteenth
    "poly 0.5/8 d3": _poly(0.5, 3),
    "poly 1/8 d2": _poly(1, 2),
    "poly 1/8 d3": _poly(1, 3),
    "poly 2/8 d2": _poly(2, 2),
    "poly 2/8 d3": _poly(2, 3),
    "poly 4/8 d2": _poly(4, 2),
    "poly 4/8 d3": _poly(4, 3),
    "poly 3/8 d2": _poly(3, 2),
    # a mutant (must fail the checks): the polynomial's exponent bits shifted by 22, not 23
    "mutant: shift 22": {"variant": {"fp8_exp_poly": 4, "fp8_exp_poly_deg": 3},
                         "patch": ((r"<< 23\)", "<< 22)"), ), "mutant": True, "masks": ("none", )},
    # the seventeenth session's diagnostic: P without its exponentials (wrong numerics: built and timed, not checked)
    "diag: no exp2": {"patch": ((r"p = gl\.exp2\((s_acc \* qk_scale - \(m_use - 8\.0\)\[:, None\])\)", r"p = \1"), ),
                      "diag": True},
}
CANDIDATES = ("poly 1/8 d2", "poly 1/8 d3", "poly 2/8 d2", "poly 2/8 d3", "poly 4/8 d2", "poly 4/8 d3") if ROUND == "A" else \
    ("poly 0.5/8 d2", "poly 0.5/8 d3", "poly 1/8 d3", "poly 2/8 d2")  # round A: every share lost, the least 1/8 d3
TIMED = CANDIDATES + ("diag: no exp2", )
s7.VARIANTS = VARIANTS
PHASE_TIMEOUT = {"build": 18, "check": 15, "time": 22}
TOTAL = 57.5  # the round's 60 s less the parent's start and end: the time phase takes what the others left
RISKY = ()  # checked last (a hang costs only its own rows)
PASSES = 30  # the time phase stops early when its time runs short
BENCH_MS = (10, 50)  # the bench's measure's warm-up and rep ms (the bench's own: 25, 100)
# a full-mask row of 2 x 6 heads x 18 query blocks = 216 tiles: more than the 132 programs (a program takes two)
BIG_FULL = ("none", 1, 2, 6, 2200, 1300, True)
UNIT = 16 * 16384 // 16 * (16384 // 128)  # 16 rows x 128 keys of the timed call: 2,097,152


def masks_of(name):
    return (VARIANTS[name] or {}).get("masks", s7.MASKS)


# the README's bound applies at S >= 4096 (gpu_fp8.RMSE_BOUND): one full and one causal row there
S4K = (("none", 1, 1, 2, 4096, 4096, False), ("causal", 1, 1, 2, 4096, 4096, True))
MUTANTS = ("mutant: shift 22", )


def check_cases():
    """(variant, head_dim, s7.CHECKS-style row, window): the product and each candidate on the S 4096 rows, BIG_FULL
    and s7's rows (ragged lengths, empty rows, per-head descales); the mutant on one full row."""
    rows = S4K + (BIG_FULL, s7.CHECKS[1])  # s7.CHECKS[1]: 537 rows a head see no key, ragged, per-head descales
    cases = [(n, 128, c, None) for c in rows for n in ("product", ) + CANDIDATES if c[0] in masks_of(n)]
    return cases[:len(CANDIDATES) + 1] + [(n, 128, S4K[0], None) for n in MUTANTS] + cases[len(CANDIDATES) + 1:]


def jobs():
    used = ("product", ) + TIMED + tuple(c[0] for c in check_cases())
    return list(dict.fromkeys((mask, n, 128, False, 1) for n in VARIANTS if n in used for mask in masks_of(n)))


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
    with mp.get_context("spawn").Pool(min(len(work), 16)) as pool:
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
            rm = tuple(x["rmse"] for x in rows)
            if name == "product":
                outs[key] = got
                outs[("rmse", key)] = rm
            elif ("rmse", key) in outs:  # the lever's RMSE over the product's, the same inputs (both seeds)
                note += " rmse/product " + " ".join(f"{x / y:.3f}" for x, y in zip(rm, outs[("rmse", key)]))
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
            left = float(os.environ.get("FP8FWD18_TIME_LIMIT", PHASE_TIMEOUT["time"])) - (time.time() - T_PHASE)
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




def checks_table(rows):
    """Per variant: the checks passed, the worst RMSE over the emulation's, the RMSE over the product's (median and
    range over the cases and seeds), and any failing case."""
    out = ["", "| check | pass | worst rmse (emu) | rmse / product's: median, range |", "|---|---:|---:|---:|"]
    checks = [r for r in rows if r.get("section") == "check"]
    for name in dict.fromkeys(r["variant"] for r in checks):
        mine = [r for r in checks if r["variant"] == name]
        rm = [(float(m.group(1)), float(m.group(2))) for r in mine
              if (m := re.search(r"rmse ([0-9.e+-]+) \(emu ([0-9.e+-]+)\)", r.get("note", "")))]
        worst = max(rm, key=lambda x: x[0] / x[1], default=None)
        ratios = sorted(float(x) for r in mine for x in re.findall(r"(?<= )([0-9]+\.[0-9]{3})(?= |$)",
                                                                    r.get("note", "").partition("rmse/product")[2]))
        ok = sum(r["value"] in ("PASS", "RED (as it must)") for r in mine)
        out.append(f"| {name} | {ok}/{len(mine)} | " + (f"{worst[0]:.2e} ({worst[1]:.2e})" if worst else "") + " | "
                   + (f"{statistics.median(ratios):.3f}, {ratios[0]:.3f}-{ratios[-1]:.3f}" if ratios else "") + " |")
        out += [f"  {r['value']} {name} {r.get('case', '')}: {r.get('note', '')[:150]}" for r in mine
                if r["value"] not in ("PASS", )]
    return "\n".join(out)


def dry_run():
    """Every module of the round built for sm_90 on the CPU (no GPU): ptxas's registers and spills, the step loops'
    SASS counts (the unmasked loops first)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from sm90 import ptxas
    failed = 0
    for mask, name, *_ in jobs():
        t = time.time()
        try:
            m = s7.module(mask, name)
            res, log, dump = ptxas(m.compile_for().asm["ptx"], sass=True)
            r = next(iter(res.values()))
            counts = [step_counts(b) for b in sass_steps(dump)]
            print(f"{name:>18} {mask:>6}: {r.registers} regs, spills {r.spill_stores}/{r.spill_loads}, serialized "
                  f"{'serialized' in log}, step loops (SASS MUFU FFMA FADD IMAD+LEA STS+LDS): "
                  + "; ".join(" ".join(str(c) for c in x) for x in counts) + f" ({time.time() - t:.0f}s)", flush=True)
            failed += bool(r.spill_stores or r.spill_loads or "serialized" in log or not counts)
        except Exception as e:  # noqa: BLE001
            failed += 1
            print(f"{name} {mask}: BUILD ERROR {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
    sys.exit(1 if failed else 0)


def sass_steps(dump):
    """The SASS step loops (innermost loops with 8 QGMMA) of a cuobjdump listing."""
    ins = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", dump)]
    at = {a: i for i, (a, _) in enumerate(ins)}
    regions = []
    for j, (a, x) in enumerate(ins):
        m = re.search(r"\bBRA\s+0x([0-9a-f]+)", x)
        if m and int(m.group(1), 16) in at and at[int(m.group(1), 16)] < j:
            regions.append((at[int(m.group(1), 16)], j))
    qg = lambda r: sum("QGMMA" in y for _, y in ins[r[0]:r[1] + 1])  # noqa: E731
    inner = [r for r in regions if qg(r) and not any(o != r and r[0] <= o[0] and o[1] <= r[1] and qg(o)
                                                      for o in regions)]
    return [[y for _, y in ins[r[0]:r[1] + 1]] for r in inner if qg(r) == 8]


def step_counts(body):
    op = [re.sub(r"^@!?U?P\w+\s+", "", y.strip()).split(" ")[0].split(".")[0] for y in body]
    c = collections.Counter(op)
    return len(body), c["MUFU"], c["FFMA"], c["FADD"], c["IMAD"] + c["LEA"], c["STS"] + c["LDS"]


def main():
    if "--dry-run" in sys.argv:
        dry_run()
    if len(sys.argv) > 2 and sys.argv[1] == "--phase":
        {"build": phase_build, "check": phase_check, "time": phase_time}[sys.argv[2]]()
        return
    env = child_env("/tmp/fagen-cache-gpu-fp8fwd-s18")
    env["FP8FWD18_ROUND"] = ROUND
    env["OUTX"] = str(OUTX)
    rows = []
    for name in PHASE_TIMEOUT:
        limit = PHASE_TIMEOUT[name]
        if name == "time":  # what the earlier phases left
            limit = max(6.0, TOTAL - (time.time() - s7.T0))
            env["FP8FWD18_TIME_LIMIT"] = f"{limit:.1f}"
        s7.log(f"#### phase {name} (timeout {limit:.0f}s, {time.time() - s7.T0:.0f}s so far)")

        def on_line(line):
            if not line.startswith(("ROW ", "built ")):  # the rows come back in the table; builds as a count
                print(line, end="", flush=True)
            elif line.startswith("built "):
                rows.append({"section": "built"})
            if line.startswith("ROW "):
                rows.append(json.loads(line[4:]))
        rc, _ = run_child(__file__, name, limit, env, on_line)
        s7.log(f"#### phase {name}: rc={rc}")
        if name == "check":  # a candidate whose checks failed or did not all run is not timed
            done = [r for r in rows if r.get("section") == "check"]
            want = {}
            for n, *_ in check_cases():
                want[n] = want.get(n, 0) + 1
            bad = [n for n in CANDIDATES if any(r["variant"] == n and r["value"] != "PASS" for r in done)]
            short = [n for n in CANDIDATES if sum(r["variant"] == n for r in done) < want.get(n, 0)]
            if short:  # timed all the same (the lever cannot hang a kernel): said in the table
                s7.log(f"checks unfinished (timed): {short}")
            env["FP8FWD_SKIP"] = "|".join(bad)
            if bad:
                s7.log(f"not timed (checks failed or unfinished): {bad}")
    text = f"modules built: {sum(r.get('section') == 'built' for r in rows)}\n" + s7.table(rows) + checks_table(rows)
    s7.log(text)
    s7.log(f"total {time.time() - s7.T0:.0f}s")
    OUTX.mkdir(parents=True, exist_ok=True)
    (OUTX / "table.txt").write_text(text + "\n")
    bad = [r for r in rows if r.get("section") == "check" and r["value"] not in ("PASS", "RED (as it must)")]
    if bad or not any(r.get("section") == "check" for r in rows):
        s7.log(f"CHECKS FAILED: {len(bad)} rows")
        sys.exit(1)


if __name__ == "__main__":
    try:
        main()
    except Exception:  # noqa: BLE001
        traceback.print_exc()
