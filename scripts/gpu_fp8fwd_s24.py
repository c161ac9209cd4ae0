"""The fp8 (e4m3) Gluon forward against cuDNN's fp8 SDPA, twenty-fourth session (issue 28): the tail split
([Note] fp8 tail split, GluonBackend.variant fp8_tail_split C) on the product's full mask (FP8_FULL_N192: 192-key
steps), whose rule (Sk a multiple of C x BLOCK_N) never held at 192-key steps (s16k is no multiple of 384), now a
multiple of C x 128 keys, its Q copy in 8-byte words; and an Nsight Compute page of the product (causal, full) and
cuDNN's fp8 kernel on the suite's rows at base clock.

Phases, each a child process with a wall-clock limit (a hung kernel costs its own child only), < 50 s in all:
  build  a pool warms every module at the timed shape (B1 H16 s16k, per-KV-head descales) and at a small one;
  check  one child per candidate: the product and the candidate against float64 on the dequantized inputs
         (scripts/gpu_fp8.py's check: RMSE within 1.5x the e4m3 emulation's blocked as the module's steps; lse; the
         fingerprint that fails a bf16 P V; empty rows), full and causal S 4096, full Sq 2200 / Sk 1300 (216 tiles),
         causal Sq 1537 / Sk 1000 (empty rows, per-head descales), and two full rows whose tiles the split cuts (B1:
         H4 Sq 4480 / Sk 4096 per-head, 140 tiles; H2 Sq 8704 / Sk 2048, 136 tiles), two seeds each;
  ncu    (round A, set up during the checks, profiling between them and the timed passes, which wait for its end;
         a kill costs the profile only) one profiling run at base clock: one call each of the
         product's causal and full kernels and of cuDNN's fp8 kernel on the full row (the suite's rows, input set
         0), four sections and a few metrics; the compact table printed;
  time   TF/s of the suite's rows fwd-fp8-d128-{full,causal}-s16k through the suite's own row function
         (fagen.bench.impls.prepare_fagen, the candidate's variant keys set), cudnn-fp8 and fagen bf16 rows, the
         suite's measure (3 input sets rotated, L2 flush); shuffled passes; per-pass time ratios to the product.

    python3 scripts/gpu_fp8fwd_s24.py --round A|B
    python3 scripts/gpu_fp8fwd_s24.py --dry-run      # every module built for sm_90 on the CPU

docs/hopper.md, "fp8 forward (twenty-fourth session)".
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import re
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_fp8_fwd_s7 as s7  # noqa: E402
from _phases import child_env, run_phase as run_child  # noqa: E402

ROUND = (sys.argv[sys.argv.index("--round") + 1] if "--round" in sys.argv
         else os.environ.get("FP8FWD24_ROUND", "B")).upper()
OUTX = Path(os.environ.get("OUTX") or os.environ.get("OUT") or "/tmp/fp8fwd24-out")
# name -> None (the product: fagen.load) or {"variant": GluonBackend.variant keys set for the render and the timed
# row, "base": {mask: the module its out must equal bit for bit, or None}, "block_n": {mask: the emulation's blocking}}
VARIANTS = {"product": None}
for _c in (4, 8, 16):  # [Note] fp8 tail split: the kernel is the product's; the split rows are not bit for bit
    VARIANTS[f"tail C{_c}"] = {"variant": {"fp8_tail_split": _c}, "base": {"causal": "product"},
                               "block_n": {"none": 192, "causal": 128},
                               "timed": ("none", )}  # causal: the product's render byte for byte (not timed)
CANDIDATES = {"A": ("tail C4", "tail C8"), "B": ("tail C4", "tail C8", "tail C16")}[ROUND]
REF = "fp8 product"  # the timed row the per-pass ratios divide by
BREAKDOWN_S = 4.0 if ROUND == "B" else 0.0  # round B: the time phase's last seconds for breakdown()
s7.VARIANTS = VARIANTS
TOTAL = 47.5  # the round's 50 s less the parent's start and end: the time phase takes what the others left
# ncu (round A) starts after the build: its app sets up during the checks, profiles once they are over (a flag file)
# and the time phase's first kernel waits for its end (ncu locks the clocks while it profiles); a kill costs the profile
PHASE_TIMEOUT = {"build": 16, "check": 13, "ncu": 26 if ROUND == "A" else 0}
HANG_S = float(os.environ.get("FP8FWD24_HANG_S", 10))  # a check child this long without a finished row is killed
PASSES = 30  # the time phase stops early when its time runs short
BENCH_MS = (10, 40)  # the bench's measure's warm-up and rep ms (the bench's own: 25, 100)
S4K = (("none", 1, 1, 2, 4096, 4096, False), ("causal", 1, 1, 2, 4096, 4096, True))
BIG_FULL = ("none", 1, 2, 6, 2200, 1300, True)  # 2 x 6 heads x 18 query blocks = 216 tiles
# rows the tail split cuts on 132 SMs (B1, tiles just over a round, Sk a multiple of C x 128 for C 4, 8, 16)
SPLIT = (("none", 1, 1, 4, 4480, 4096, True), ("none", 1, 1, 2, 8704, 2048, False))
CHECK_ROWS = S4K + (BIG_FULL, s7.CHECKS[1]) + SPLIT  # CHECKS[1]: causal Sq 1537 / Sk 1000 (empty rows)
if s7.MOCK:  # GPU_FP8_FWD_MOCK=1: the plumbing on the CPU (the emulation stands in for every module); small rows
    CHECK_ROWS = (("causal", 1, 1, 2, 300, 200, True), ("none", 1, 1, 2, 200, 333, False))


def names_for(mask, cands=None):
    """The modules a check row of `mask` runs in the child of candidate(s) `cands` (default: all): the product, the
    candidates' bases there and the candidates."""
    cands = CANDIDATES if cands is None else cands
    bases = [(VARIANTS[n] or {}).get("base", {}).get(mask) for n in cands]
    return list(dict.fromkeys(["product"] + [b for b in bases if b] + list(cands)))


def jobs():
    """Every module the round builds: the checks' and, in round B, main's product (the timed reference)."""
    return [(mask, n) for mask in s7.MASKS for n in names_for(mask)]


def module(mask, name):
    """The fp8 module of `name` for `mask`: the product's (fagen.load), or the render with the variant's keys set
    (s7.module: GluonBackend.variant changed for that render only)."""
    v = VARIANTS[name]
    if s7.MOCK or (v is not None and not v.get("main")):
        with main_set():  # the variant's keys alone decide (FP8_N256 would take precedence)
            return s7.module(mask, name)
    import fagen
    with main_set(bool(v)):
        return fagen.load(s7.spec_of(mask))


class main_set:
    """fagen.backends.gluon.FP8_N256 emptied inside the block where `on` (main's product: the loader keys its modules
    on the render's variant, render_state)."""

    def __init__(self, on=True):
        self.on = on

    def __enter__(self):
        from fagen.backends import gluon
        from fagen.codegen import render
        self.saved = dict(gluon.FP8_N256)
        if self.on:
            gluon.FP8_N256.clear()
        render.render.cache_clear()

    def __exit__(self, *exc):
        from fagen.backends import gluon
        from fagen.codegen import render
        gluon.FP8_N256.clear()
        gluon.FP8_N256.update(self.saved)
        render.render.cache_clear()


class keys_set:
    """GluonBackend.variant with `keys` inside the block, and where there are keys FP8_N256 emptied so that they alone
    decide (the loader keys its modules on the render's variant: render_state), so the suite's own row function
    builds the candidate."""

    def __init__(self, keys):
        self.keys = keys

    def __enter__(self):
        from fagen import backends
        self.saved = dict(backends.GLUON.variant)
        self.main = main_set(bool(self.keys))
        self.main.__enter__()
        backends.GLUON.variant.update(self.keys)

    def __exit__(self, *exc):
        from fagen import backends
        backends.GLUON.variant.clear()
        backends.GLUON.variant.update(self.saved)
        self.main.__exit__(*exc)


def block_n(name, mask):
    v = VARIANTS[name]
    if v is None or v.get("main"):  # the product's steps: 256 (FP8_N256), 192 (FP8_FULL_N192) or 128
        from fagen.backends import GLUON
        with main_set(bool(v)):
            sp = s7.spec_of(mask)
            return (256 if GLUON.variant_for(sp)["fp8_n256"] else 192) if GLUON.fp8_n192(sp) else 128
    return v["block_n"][mask]


def _warm(job):
    """Build a module: a small call (the checks' specialisation) and one at the timed shape with the bench rows'
    per-KV-head k / v descales (a head stride of 1 specialises too)."""
    t = time.time()
    try:
        import torch
        import fagen
        if job[0] == "bf16":
            m = fagen.load(s7.spec_of(job[1], "bf16"))
            m.forward(*[torch.randn(s7.TIME_SHAPE, device="cuda", dtype=torch.bfloat16) for _ in range(3)])
            torch.cuda.synchronize()
            return f"built bf16 {job[1]} in {time.time() - t:.1f}s"
        mask, name = job
        m = module(mask, name)
        q, k, v = (torch.randn(1, 1, 200, 128, device="cuda").to(torch.float8_e4m3fn) for _ in range(3))
        m.forward(q, k, v)
        b, h, s, d = s7.TIME_SHAPE
        x = [torch.randn((b, h, s, d), device="cuda").to(torch.float8_e4m3fn) for _ in range(3)]
        m.forward(*x, k_descale=torch.ones(h, device="cuda"), v_descale=torch.ones(h, device="cuda"))
        torch.cuda.synchronize()
        return f"built {name} {mask} in {time.time() - t:.1f}s"
    except Exception as e:  # noqa: BLE001
        return f"build ERROR {job}: {type(e).__name__}: {str(e).splitlines()[0][:200]}"


def phase_build():
    work = [j for j in jobs() if not (VARIANTS[j[1]] or {}).get("diag")] + [("bf16", m) for m in s7.MASKS]
    s7.log(f"== build: {len(work)} modules")
    with mp.get_context("spawn").Pool(min(len(work), 16)) as pool:
        for msg in pool.imap_unordered(_warm, work):
            s7.log(msg)


def phase_check_one(name):
    """Candidate `name`, the product and its base on CHECK_ROWS, two seeds each against float64; the candidate's out
    and lse bit for bit its base's of the mask. Prints READY before the first kernel call."""
    import torch
    import gpu_fp8
    v = VARIANTS[name]
    mods = {(n, mask): module(mask, n) for mask in s7.MASKS for n in names_for(mask, (name, ))}
    emulate = gpu_fp8.emulate
    s7.log("READY")
    if os.environ.get("FP8FWD24_MOCK_HANG") == name:  # a test of the hang guard: this child never finishes
        time.sleep(3600)
    for mask, gqa, b, hkv, sq, sk, per_head in CHECK_ROWS:
        label = f"{mask} b{b} h{hkv} sq{sq} sk{sk}{' per-head' if per_head else ''}"
        got = {}
        base = (v or {}).get("base", {}).get(mask)
        try:
            for n in names_for(mask, (name, )):
                m = mods[(n, mask)]
                bn = block_n(n, mask)  # the emulation blocked as the module's steps
                gpu_fp8.emulate = lambda *a, _e=emulate, _n=bn, **kw: _e(*a, **{**kw, "block_n": _n})
                outs, ins = [], []

                def fwd(*a, m=m, outs=outs, ins=ins, **kw):
                    r = m.forward(*a, **kw)
                    outs.append(tuple(t.clone() for t in r))
                    ins.append((a, kw))
                    return r
                rows = [gpu_fp8.check(128, mask, gqa, b, hkv, sq, sk, False, per_head, seed=seed, device=s7.DEV,
                                      forward=fwd) for seed in range(2)]
                got[n] = outs
                ok = all(r["pass"] for r in rows)
                r = max(rows, key=lambda r: r["rmse"] / r["emu_rmse"])
                note = (f"rmse {r['rmse']:.2e} (emu {r['emu_rmse']:.2e}) lse {r['lse_err']:.1e} "
                        f"finger {r['fingerprint']:.3f} empty {r['empty_rows']}")
                if not ok and outs:
                    note += "; " + worst_tiles(mask, ins[0], outs[0])
                if n == name and base:
                    same = all(torch.equal(x, y) for a, b_ in zip(outs, got[base]) for x, y in zip(a, b_))
                    ok = ok and same
                    note += f"; {'==' if same else '!='} {base} bitwise"
                s7.emit(section="check", variant=n, case=label, note=note, value="PASS" if ok else "FAIL",
                        owner=name)
        except Exception as e:  # noqa: BLE001
            s7.emit(section="check", variant=name, case=label, value="FAIL", owner=name,
                    note=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
            traceback.print_exc(limit=3)
    s7.log("DONE")


def worst_tiles(mask, args, got):
    """Where a failing row goes wrong: the 128-row tiles (m0) whose largest out or lse error against float64 is
    worst, with the tile's key range (hi, split of 256-key steps) and the error."""
    import torch
    import gpu_fp8
    from fagen.verify import reference
    (q8, k8, v8), kw = args[0][:3], args[1]
    ref_out, ref_lse = reference.attention(gpu_fp8.dequantize(q8, kw["q_descale"]),
                                           gpu_fp8.dequantize(k8, kw["k_descale"]),
                                           gpu_fp8.dequantize(v8, kw["v_descale"]), mask=mask)
    out, lse = got
    sq, sk = q8.shape[2], k8.shape[2]
    e_out = (out.double() - ref_out).abs().amax(dim=(0, 1, 3))
    seen = ref_lse > float("-inf")
    e_lse = (lse.double() - ref_lse).where(seen, 0.0).abs().amax(dim=(0, 1))
    tiles = []
    for m0 in range(0, sq, 128):
        e = max(e_out[m0:m0 + 128].max().item(), e_lse[m0:m0 + 128].max().item())
        if mask == "causal":
            hi = max(min(sk, m0 + 128 + sk - sq), 0)
            split = min(max(m0 + sk - sq + 1, 0) // 256 * 256, sk // 256 * 256)
        else:
            hi, split = sk, sk // 256 * 256
        tiles.append((e, m0, hi, split))
    tiles.sort(reverse=True)
    return "worst tiles (err m0 hi split) " + " ".join(f"{e:.2g}@{m0}/{hi}/{split}" for e, m0, hi, split in tiles[:4])


def run_checks(env, rows):
    """One child per candidate, all at once; a child is killed HANG_S after its READY line (or at the phase's
    limit). Returns the candidates that passed every check."""
    t0 = time.time()
    procs = {}
    for name in CANDIDATES:
        p = subprocess.Popen([sys.executable, __file__, "--phase", "check1", name], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, bufsize=1)
        st = {"ready": None, "last": None, "done": False, "lines": []}

        def pump(p=p, st=st):
            for line in p.stdout:
                if line.startswith("READY"):
                    st["ready"] = st["last"] = time.time()
                elif line.startswith("DONE"):
                    st["done"] = True
                elif line.startswith("ROW "):
                    rows.append(json.loads(line[4:]))
                    st["last"] = time.time()
                else:
                    st["lines"].append(line)
        th = threading.Thread(target=pump, daemon=True)
        th.start()
        procs[name] = (p, st, th)
    killed = {}
    while any(p.poll() is None for p, _, _ in procs.values()):
        now = time.time()
        for name, (p, st, _) in procs.items():
            if p.poll() is None and ((st["last"] and now - st["last"] > HANG_S) or now - t0 > PHASE_TIMEOUT["check"]):
                p.kill()
                killed[name] = (f"killed: {now - st['last']:.0f}s without a finished row, {now - st['ready']:.0f}s "
                                f"after its first call (a hang?)" if st["last"] and now - st["last"] > HANG_S
                                else f"killed at the phase's {PHASE_TIMEOUT['check']}s")
        time.sleep(0.1)
    good = []
    for name, (p, st, th) in procs.items():
        th.join(timeout=2)
        mine = [r for r in rows if r.get("section") == "check" and r.get("owner") == name]
        want = sum(len(names_for(row[0], (name, ))) for row in CHECK_ROWS)
        if name in killed or not st["done"]:
            rows.append(dict(section="check", variant=name, case="(child)", value="HUNG" if name in killed else "FAIL",
                             note=killed.get(name, f"rc {p.returncode}: " + "".join(st["lines"][-3:])[-300:]),
                             owner=name))
            s7.emit(**rows[-1])
            s7.log("".join(st["lines"][-20:]))
        elif len(mine) == want and all(r["value"] == "PASS" for r in mine) and not (VARIANTS[name] or {}).get("diag"):
            good.append(name)
    s7.log(f"checks: {time.time() - t0:.1f}s; passed: {good}")
    return good


T_PHASE = time.time()


def phase_time():
    import torch
    import triton
    from fagen import backends
    from fagen.bench import impls, peer_cudnn_fp8 as peer
    from fagen.bench.cases import CaseContext
    from fagen.bench.timing import measure
    from fagen.bench.workloads import standard_suite
    b, h, s, d = s7.TIME_SHAPE
    s7.log(f"== time (bench measure): B{b} H{h} S{s}; {torch.cuda.get_device_name()}; torch {torch.__version__}, "
           f"triton {triton.__version__}")
    dev = torch.device("cuda")
    suite = {c.name: c for c in standard_suite()}
    timed = [n for n in os.environ.get("FP8FWD24_TIMED", "").split("|") if n]
    rows, keep = [], []

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

        def row(cc=cc, keys=None):  # the suite's row function (the product path), the variant's keys set
            with keys_set(keys or {}):
                return impls.prepare_fagen(cc.case, cc).fn
        def main_row(cc=cc):  # main's product: FP8_N256 emptied
            with main_set():
                return impls.prepare_fagen(cc.case, cc).fn
        makers = [("cudnn-fp8", lambda cc=cc: peer.prepare_cudnn_fp8(cc.case, cc).fn, cc),
                  ("fagen bf16 (bench row)", lambda bcc=bcc: impls.prepare_fagen(bcc.case, bcc).fn, bcc),
                  (REF, row, cc)]
        makers += [(f"fp8 {n}", lambda row=row, n=n: row(keys=(VARIANTS[n] or {}).get("variant")), cc)
                   for n in timed if f"fp8 {n}" != REF and mask in (VARIANTS[n] or {}).get("timed", s7.MASKS)]
        spec = cc.case.spec(dev)[0]
        import fagen
        for n in [n for n in timed if mask in (VARIANTS[n] or {}).get("timed", s7.MASKS)]:
            keys = (VARIANTS[n] or {}).get("variant") or {}
            with keys_set(keys):
                src = fagen.generate(spec)
                try:  # the split the module takes at the timed shape on this card
                    sms = torch.cuda.get_device_properties(0).multi_processor_count
                    split = fagen.load(spec)._tail_split(b, h, s // 128, s, sms, True)
                except Exception as e:  # noqa: BLE001
                    split = f"{type(e).__name__}: {e}"[:120]
            steps = re.search(r"\nBLOCK_N = (\d+)", src)
            s7.log(f"{spec.name}: 'fp8 {n}' = the suite's row with {keys} (BLOCK_N {steps and steps.group(1)}, "
                   f"tail split rendered: {'_TAIL_C =' in src}; at B{b} H{h} S{s}: (query blocks, chunks) {split})")
        if mask == "none":  # diag: the host's V pass alone (the suite's V; both rows run it), its us in the table
            def vpass(cc=cc, spec=spec):
                m = fagen.load(spec)
                return lambda st: m.transpose_v(st.v)
            makers.append(("diag: transpose_v alone (us)", vpass, cc))
        for label, make, c in makers:
            try:
                fn = make()
                rows.append((label, mask, flops, lambda i, fn=fn, c=c: fn(c.sets[i]), len(c.sets)))
            except Exception as e:  # noqa: BLE001
                s7.emit(section="time", variant=label, mask=mask, value="ERROR",
                        note=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
    done = os.environ.get("FP8FWD24_NCU_DONE")  # ncu locks the clocks while it profiles: no kernel of ours then
    t_wait = time.time()
    while done and not os.path.exists(done) and time.time() - t_wait < 20:
        time.sleep(0.05)
    if done:
        s7.log(f"waited {time.time() - t_wait:.1f}s for the ncu phase ({'done' if os.path.exists(done) else 'NOT done'})")
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
            left = float(os.environ.get("FP8FWD24_TIME_LIMIT", 15)) - (time.time() - T_PHASE)
            if p and (time.time() - t_passes) / p * 1.15 > left - 1.0 - BREAKDOWN_S:
                s7.log(f"pass {p} skipped: the phase's time is short")
                break
            for label, mask, flops, fn, n in random.Random(2000 + p).sample(rows, len(rows)):
                if isinstance(times.get((label, mask)), str):
                    continue
                try:
                    times.setdefault((label, mask), []).append(measure(fn, n, dev, *BENCH_MS))
                except Exception as e:  # noqa: BLE001
                    times[(label, mask)] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            s7.log(f"pass {p} done ({time.time() - s7.T0:.0f}s)")
        if BREAKDOWN_S:  # after the passes: one call of each fp8 full row under torch.profiler (its kernels)
            breakdown([r for r in rows if r[1] == "none" and r[0].startswith("fp8 ")])
    tf = {(label, mask): flops / statistics.median(times[(label, mask)]) / 1e9 for label, mask, flops, _, _ in rows
          if isinstance(times.get((label, mask)), list) and times[(label, mask)]}
    for label, mask, flops, _, _ in rows:
        t = times.get((label, mask))
        if isinstance(t, str) or not t:
            s7.emit(section="time", variant=label, mask=mask, value="ERROR", note=str(t)[:160])
            continue
        notes = []
        if label.startswith("diag: transpose_v"):
            s7.emit(section="time", variant=label, mask=mask, value=round(statistics.median(t) * 1e3, 1),
                    note=f"us; quartiles {sorted(t)[len(t) // 4] * 1e3:.1f}-{sorted(t)[-1 - len(t) // 4] * 1e3:.1f}")
            continue
        if label.startswith("fp8 "):
            for ref, word in (("fagen bf16 (bench row)", "bf16"), ("cudnn-fp8", "cudnn")):
                if tf.get((ref, mask)):
                    notes.append(f"{tf[(label, mask)] / tf[(ref, mask)]:.3f}x {word}")
            pp = times.get((REF, mask)) if label != REF else times.get(("cudnn-fp8", mask))
            if isinstance(pp, list) and len(pp) == len(t):  # per pass: the product's (or cudnn's) time / the row's
                rr = sorted(y / x for x, y in zip(t, pp))
                q = len(rr) // 4
                notes.append(f"(per pass vs {REF[4:] if label != REF else 'cudnn'}: median "
                             f"{statistics.median(rr):.3f}, quartiles {rr[q]:.3f}-{rr[-1 - q]:.3f}, range "
                             f"{rr[0]:.3f}-{rr[-1]:.3f}, {sum(x > 1 for x in rr)}/{len(rr)} above)")
        s7.emit(section="time", variant=label, mask=mask, value=round(tf[(label, mask)], 1),
                ms=round(statistics.median(t), 4),
                note=(" ".join(notes) + f" [passes {' '.join(f'{flops / x / 1e9:.0f}' for x in t)}]").strip())



NCU_SCRIPT = r"""
import os, sys, time, torch
sys.path.insert(0, "scripts")
import gpu_fp8_fwd_s7 as s7
import fagen
from fagen.bench import peer_cudnn_fp8 as peer
from fagen.bench.cases import CaseContext
from fagen.bench.workloads import standard_suite
suite = {c.name: c for c in standard_suite()}
calls, keep = [], []
for mask, word in (("causal", "causal"), ("none", "full")):
    cc = CaseContext(suite[f"fwd-fp8-d128-{word}-s16k"], torch.device("cuda"), 1)
    keep.append(cc)
    st = cc.sets[0]
    m = fagen.load(s7.spec_of(mask))
    sc = {n: t for n, t in st.scores.items() if n not in ("k_scale", "v_scale")}
    calls.append((f"product {word}", lambda m=m, st=st, sc=sc: m.forward(
        st.q, st.k, st.v, k_descale=st.scores["k_scale"], v_descale=st.scores["v_scale"], **st.kwargs, **sc)))
    if word == "full":  # cuDNN's fp8 kernel once (the full mask: the larger gap; causal in the time phase)
        try:
            prepared = peer.prepare_cudnn_fp8(cc.case, cc)
            calls.append((f"cudnn-fp8 {word}", lambda p=prepared, st=st: p.fn(st)))
        except Exception as e:
            print("cudnn-fp8 ERROR", type(e).__name__, str(e)[:200])
t0 = time.time()
for _, f in calls:
    f()
torch.cuda.synchronize()
print(f"APP warm done {time.time() - t0:.1f}s", file=sys.stderr, flush=True)
go = os.environ.get("FP8FWD24_NCU_GO")  # the parent's word that the checks (GPU work) are over
while go and not os.path.exists(go) and time.time() - t0 < 30:
    time.sleep(0.05)
print(f"APP profiling from {time.time() - t0:.1f}s", file=sys.stderr, flush=True)
torch.cuda.profiler.start()
for name, f in calls:
    f()
    torch.cuda.synchronize()
torch.cuda.profiler.stop()
print("CALLS " + "|".join(n for n, _ in calls), flush=True)
"""
NCU_SECTIONS = ("SpeedOfLight", "LaunchStats", "WarpStateStats", "SchedulerStats")
# (label, raw-page metric): names read on the H200's ncu by scripts/gpu_bwdfull_s22.py or on the H100's by
# scripts/gpu_fp8fwd_s15.py (wgmma counts under the hmma pipe there; the gmma name read nan on the H200)
NCU_ROWS = (
    ("duration (ns)", "gpu__time_duration.sum"), ("cycles (gpc max)", "gpc__cycles_elapsed.max"),
    ("grid x threads", None), ("registers a thread", "launch__registers_per_thread"),
    ("smem a CTA, dynamic B", "launch__shared_mem_per_block_dynamic"),
    ("instructions (warp)", "smsp__inst_executed.sum"),
    ("issue active % (SMSP)", "smsp__issue_active.avg.pct_of_peak_sustained_active"),
    ("tensor pipe % (hmma cycles, active)", "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"),
    ("XU (MUFU) pipe % inst", "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active"),
    ("FMA / ALU pipe % inst", ("sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active",
                               "sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active")),
    ("warp cycles per issue", "smsp__average_warp_latency_per_inst_issued.ratio"),
    ("eligible warps / cycle", "smsp__warps_eligible.avg.per_cycle_active"),
    ("shared ld / st (warp inst)", ("smsp__sass_inst_executed_op_shared_ld.sum",
                                    "smsp__sass_inst_executed_op_shared_st.sum")),
    ("shared bank conflicts ld / st", ("l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum",
                                       "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum")),
    ("local ld (warp inst)", "smsp__sass_inst_executed_op_local_ld.sum"),
    ("DRAM bytes read / L2 hit %", ("dram__bytes_read.sum", "lts__t_sector_hit_rate.pct")),
)
NCU_METRICS = ",".join(dict.fromkeys(
    m for _, ms in NCU_ROWS if ms for m in ((ms, ) if isinstance(ms, str) else ms)
    if not m.startswith(("gpu__time", "launch__registers", "smsp__average_warp", "smsp__warps_eligible"))))
STALL = "smsp__average_warps_issue_stalled_"
NCU_KERNELS = "regex:attn_fwd_hopper|sdpa"


def phase_ncu():
    """One profiling run at base clock (the product's causal and full kernels, cuDNN's), the raw page read back and
    the compact table printed (scripts/gpu_fp8fwd_s17.py's report_raw)."""
    import gpu_fp8fwd_s17 as s17
    s7.VARIANTS = VARIANTS
    ncu = s17._ncu_bin()
    s7.log(f"== ncu: {ncu}")
    if not ncu:
        return
    OUTX.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    cmd = [ncu, "--profile-from-start", "off", "--clock-control", "base", "-k", NCU_KERNELS, "--page", "raw",
           "--csv"]
    for sec in NCU_SECTIONS:
        cmd += ["--section", sec]
    app = [sys.executable, "-c", NCU_SCRIPT]
    r = s17._run_group(cmd + ["--metrics", NCU_METRICS] + app, PHASE_TIMEOUT["ncu"] - 1.5)
    if r.returncode and "CALLS" not in r.stdout and time.time() - t0 < 5:  # an unknown metric: the sections alone
        s7.log(f"ncu rc {r.returncode} with the metrics ({r.stderr.strip()[-300:]}); again without them")
        r = s17._run_group(cmd + app, PHASE_TIMEOUT["ncu"] - 1.5 - (time.time() - t0))
    (OUTX / "ncu_raw.csv").write_text(r.stdout + "\n---- stderr\n" + r.stderr)
    s7.log(f"ncu rc {r.returncode} in {time.time() - t0:.1f}s; " + " / ".join(
        ln for ln in (r.stdout + r.stderr).splitlines() if ln.startswith(("CALLS", "cudnn-fp8 ERROR", "APP "))))
    if r.returncode:
        s7.log(r.stderr[-600:])
    names = next((ln[6:].split("|") for ln in r.stdout.splitlines() if ln.startswith("CALLS ")),
                 ["product causal", "product full", "cudnn-fp8 full"])
    text = report_raw(r.stdout, names)
    s7.log(text)
    (OUTX / "ncu_table.md").write_text(text + "\n")



def report_raw(text, names):
    """The compact table from the raw page's CSV: one column a profiled kernel (the calls' order), the top stalls."""
    import csv
    import io
    rows = list(csv.reader(io.StringIO("\n".join(ln for ln in text.splitlines() if ln.startswith('"')))))
    if len(rows) < 3:
        return "ncu raw: no rows"
    head = rows[0]
    col = {h: i for i, h in enumerate(head)}
    kern = [r for r in rows[1:] if "ID" not in col or r[col["ID"]].strip().isdigit()]  # not the units row

    def val(k, m):
        i = col.get(m)
        return k[i] if i is not None and i < len(k) else "-"

    def num(x):
        try:
            return float(str(x).replace(",", ""))
        except ValueError:
            return 0.0
    out = ["| ncu, base clock | " + " | ".join(names[j] if j < len(names) else "?" for j in range(len(kern))) + " |",
           "|---|" + "---:|" * len(kern)]
    for label, ms in NCU_ROWS:
        if ms is None:
            cells = [f"{val(k, 'launch__grid_size')} x {val(k, 'launch__block_size')}" for k in kern]
        else:
            cells = [" / ".join(val(k, m) for m in ((ms, ) if isinstance(ms, str) else ms)) for k in kern]
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    stalls = [h for h in head if h.startswith(STALL) and h.endswith("_per_issue_active.ratio")]
    score = {h: max((num(val(k, h)) for k in kern), default=0) for h in stalls}
    for h in sorted(stalls, key=lambda h: -score[h])[:8]:
        out.append(f"| stall {h[len(STALL):-len('_per_issue_active.ratio')]} (warps / issue) | "
                   + " | ".join(val(k, h) for k in kern) + " |")
    out += [f"kernel {j}: {val(k, 'Kernel Name')[:160]}" for j, k in enumerate(kern)]
    return "\n".join(out)

def breakdown(rows):
    """One call of each row (input set 1, after a warm call) under torch.profiler: its GPU kernels in order with
    their durations (us) and the span from the first kernel's start to the last one's end."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    for label, mask, _, fn, n in rows:
        try:
            fn(0)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                fn(1 % n)
                torch.cuda.synchronize()
            ev = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                        key=lambda e: e.time_range.start)
            span = ev[-1].time_range.end - ev[0].time_range.start if ev else 0
            parts = " + ".join(f"{re.sub(r'^_+', '', e.name)[:22]} {e.time_range.elapsed_us():.1f}" for e in ev[:12])
            s7.log(f"breakdown {label} {mask}: span {span:.1f} us = {parts}")
        except Exception as e:  # noqa: BLE001
            s7.log(f"breakdown {label}: {type(e).__name__}: {str(e)[:160]}")


def checks_table(rows):
    out = ["", "| check | pass | worst rmse (emu) |", "|---|---:|---:|"]
    checks = [r for r in rows if r.get("section") == "check"]
    for name in dict.fromkeys(r["variant"] for r in checks):
        mine = [r for r in checks if r["variant"] == name]
        rm = [(float(m.group(1)), float(m.group(2))) for r in mine
              if (m := re.search(r"rmse ([0-9.e+-]+) \(emu ([0-9.e+-]+)\)", r.get("note", "")))]
        worst = max(rm, key=lambda x: x[0] / x[1], default=None)
        out.append(f"| {name} | {sum(r['value'] == 'PASS' for r in mine)}/{len(mine)} | "
                   + (f"{worst[0]:.2e} ({worst[1]:.2e})" if worst else "") + " |")
        out += [f"  {r['value']} {name} {r.get('case', '')}: {r.get('note', '')[:300]}" for r in mine
                if r["value"] != "PASS"]
    return "\n".join(out)


def dry_run():
    """Every module built for sm_90 on the CPU (no GPU): ptxas's registers and spills; in each step loop of the
    SASS (innermost loops with 8, 14 or 16 QGMMA: 128-, 192-, 256-key steps; triton's partition barrier 0x0 marks warpgroup 0's, 0x2 warpgroup 1's) the
    instruction count, the named barriers of 256 threads and where they sit against the QGMMA, the wgmma waits and
    the MUFU.EX2, and the mbarrier phase checks."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from sm90 import ptxas, sass_step_loops, stale_descriptors, step_barriers
    failed = 0
    for mask, name in jobs():
        t = time.time()
        try:
            m = module(mask, name)
            res, log, dump = ptxas(m.compile_for().asm["ptx"], sass=True)
            r = next(iter(res.values()))
            q = {192: 14, 256: 16}.get(block_n(name, mask), 8)  # QGMMA a step: S and P V
            bodies = sass_step_loops(dump, q)
            loops = [step_barriers(b) for b in bodies]
            local = sum(bool(re.search(r"\b(LDL|STL)\b", x)) for b in bodies for x in b)
            stale = stale_descriptors(dump)  # [Note] fp8 256-key steps: QGMMA descriptors a tile may read stale
            print(f"{name:>28} {mask:>6}: {r.registers} regs, spills {r.spill_stores}/{r.spill_loads}, serialized "
                  f"{'serialized' in log}, local memory ops in the step loops {local}, stale descriptors "
                  f"{[s[0] for s in stale]} ({time.time() - t:.0f}s)",
                  flush=True)
            for d in loops:
                print(f"    WG{d['wg']} {d['n']} SASS: QGMMA {d['qgmma'][0]}-{d['qgmma'][-1]}, waits {d['waits']}, "
                      f"MUFU.EX2 {len(d['mufu'])} at {d['mufu'][:1]}-{d['mufu'][-1:]}, BAR.SYNC {d['sync']}, "
                      f"BAR.ARV {d['arrive']}, BAR.RED {d['red']}, phase checks {d['phasechk']}", flush=True)
            diag = (VARIANTS[name] or {}).get("diag")  # the old loops: stale descriptors expected
            failed += bool(stale or "serialized" in log or len(loops) < 4) and not diag  # ptxas may copy a loop
        except Exception as e:  # noqa: BLE001
            failed += 1
            print(f"{name} {mask}: BUILD ERROR {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
    sys.exit(1 if failed else 0)


def main():
    if "--dry-run" in sys.argv:
        dry_run()
    if len(sys.argv) > 2 and sys.argv[1] == "--phase":
        if sys.argv[2] == "check1":
            phase_check_one(sys.argv[3])
        else:
            {"build": phase_build, "time": phase_time, "ncu": phase_ncu}[sys.argv[2]]()
        return
    env = child_env("/tmp/fagen-cache-gpu-fp8fwd-s24")
    env["FP8FWD24_ROUND"] = ROUND
    env["OUTX"] = str(OUTX)
    rows = []

    def on_line(line):
        if line.startswith("ROW "):
            rows.append(json.loads(line[4:]))
        elif line.startswith("built "):
            rows.append({"section": "built", "line": line})
        else:
            print(line, end="", flush=True)
    s7.log(f"#### phase build (timeout {PHASE_TIMEOUT['build']}s)")
    rc, _ = run_child(__file__, "build", PHASE_TIMEOUT["build"], env, on_line)
    s7.log(f"#### phase build: rc={rc}, {time.time() - s7.T0:.0f}s")
    ncu = None
    if PHASE_TIMEOUT["ncu"]:  # set up during the checks, profiles between them and the timed passes
        flags = Path(f"/tmp/fp8fwd24-flags-{os.getpid()}")  # not under $OUT
        flags.mkdir(parents=True, exist_ok=True)
        go, done = flags / "ncu_go", flags / "ncu_done"
        for f in (go, done):
            f.unlink(missing_ok=True)
        env["FP8FWD24_NCU_GO"], env["FP8FWD24_NCU_DONE"] = str(go), str(done)
        ncu_lines = []
        s7.log(f"#### phase ncu (timeout {PHASE_TIMEOUT['ncu']}s, {time.time() - s7.T0:.0f}s so far)")

        def ncu_run():
            rc, _ = run_child(__file__, "ncu", PHASE_TIMEOUT["ncu"], env, ncu_lines.append)
            ncu_lines.append(f"#### phase ncu: rc={rc}, ended at {time.time() - s7.T0:.0f}s\n")
            done.touch()
        ncu = threading.Thread(target=ncu_run, daemon=True)
        ncu.start()
    good = run_checks(env, rows)
    if ncu is not None:
        go.touch()
    built = " ".join(r["line"] for r in rows if r.get("section") == "built")
    unbuilt = [n for n in good if any(f"built {n} {mask} in" not in built for mask in s7.MASKS)]
    if unbuilt:  # its timed-shape warm-up did not finish (a hang there would take the time phase with it)
        s7.log(f"not timed (no finished build at the timed shape): {unbuilt}")
        good = [n for n in good if n not in unbuilt]
    limit = max(6.0, TOTAL - (time.time() - s7.T0))
    env["FP8FWD24_TIME_LIMIT"] = f"{limit - 1:.1f}"
    env["FP8FWD24_TIMED"] = "|".join(good)
    s7.log(f"#### phase time (timeout {limit:.0f}s, {time.time() - s7.T0:.0f}s so far); timed: {good}")
    rc, _ = run_child(__file__, "time", limit, env, on_line)
    s7.log(f"#### phase time: rc={rc}")
    if ncu is not None:
        ncu.join(timeout=1)
        for line in ncu_lines:
            on_line(line)
    text = f"modules built: {sum(r.get('section') == 'built' for r in rows)}\n" + s7.table(rows) + checks_table(rows)
    s7.log(text)
    s7.log(f"total {time.time() - s7.T0:.0f}s")
    OUTX.mkdir(parents=True, exist_ok=True)
    (OUTX / "table.txt").write_text(text + "\n")
    bad = [r for r in rows if r.get("section") == "check" and r["value"] != "PASS"
           and not (VARIANTS.get(r.get("owner")) or {}).get("diag")]  # a diagnostic's failures are expected
    if bad or not any(r.get("section") == "check" for r in rows):
        s7.log(f"CHECKS FAILED: {len(bad)} rows")
        sys.exit(1)


if __name__ == "__main__":
    try:
        main()
    except SystemExit:
        raise
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        sys.exit(1)
