"""The d64 forward against cuDNN (twenty-third session): the standard suite's row fwd-d64-causal-s16k (B1 H32 s16k
d64 bf16 causal; Triton m128n128w4s3 433 TF/s against cuDNN 449 on the H200, target >= 440) and d64 full s16k.

Candidates: the Triton forward's own tiles; the Gluon forward (m128n128w8s3, main's render) and its levers
([Note] The d64 forward's levers in fagen/templates/gluon/attention.py.j2: GluonBackend.variant fwd_exp_poly K (the
exp2 polynomial share on the FMA pipe), fwd_turns M (the fp8 loop's warpgroup turns), fwd_s_ahead 1 (S a step
ahead), pv_overlap 1; the spec's block_n / num_stages).

    PYTHONPATH=$PWD python3 scripts/gpu_d64fwd_s23.py --dry-run   # the CPU: sm_90 builds, regs, spills, SASS counts
    python3 scripts/gpu_d64fwd_s23.py --round A                    # the GPU: build, check, time (< 50 s)

Phases, each a child process with a wall-clock limit (scripts/_phases.py): build (every module in parallel children
into one kernel cache, at the checks' odd shape and at the timed s16k shape: Triton and Gluon specialize integer
arguments divisible by 16), run (one process, so each module loads once): the checks (float64, fagen.verify.reference:
causal and full, Sq != Sk both ways, odd lengths, rows that see no key (out 0, lse -inf); the warpgroup turns, S-ahead
and pv_overlap bit for bit the Gluon base render; the mutant must fail), then the timing (the suite's row function
(fagen.bench.impls.prepare_fagen) and cuDNN (sdpa-cudnn, the bench's peer), every candidate on the row's input sets;
shuffled passes, per-pass time ratios against the Triton row). Exit 1 if a check fails.
"""

from __future__ import annotations

import collections
import json
import multiprocessing as mp
import os
import random
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _phases import child_env, run_phase  # noqa: E402

ROUND = (sys.argv[sys.argv.index("--round") + 1] if "--round" in sys.argv
         else os.environ.get("D64FWD_ROUND", "A")).upper()
os.environ["D64FWD_ROUND"] = ROUND  # the children read the parent's round
T0 = T_RUN = time.time()  # T_RUN: the run phase's start (its child's)
ROW, FULL = "fwd-d64-causal-s16k", "fwd-d64-full-s16k"
# name -> (backend, tiles, GluonBackend.variant changes): "tri" Triton with tiles (block_m, block_n, warps, stages);
# "gl" Gluon with (block_n, stages) and the variant's keys (a "patch": a mutant, check only)
CANDS = {
    "tri m128n128w8s3": ("triton", (128, 128, 8, 3), {}),
    "tri m128n64w4s3": ("triton", (128, 64, 4, 3), {}),
    "tri m128n128w4s4": ("triton", (128, 128, 4, 4), {}),
    "tri m128n64w4s4": ("triton", (128, 64, 4, 4), {}),
    "gl base": ("gluon", (128, 3), {}),
    "gl n128s2": ("gluon", (128, 2), {}),
    "gl n64s4": ("gluon", (64, 4), {}),
    "gl turns1": ("gluon", (128, 3), {"fwd_turns": 1}),
    "gl turns2": ("gluon", (128, 3), {"fwd_turns": 2}),
    "gl turns4": ("gluon", (128, 3), {"fwd_turns": 4}),
    "gl ahead": ("gluon", (128, 3), {"fwd_s_ahead": 1}),
    "gl pvov": ("gluon", (128, 3), {"pv_overlap": 1}),
    "gl poly2": ("gluon", (128, 3), {"fwd_exp_poly": 2}),
    "gl poly4": ("gluon", (128, 3), {"fwd_exp_poly": 4}),
    "gl wg3": ("gluon", (128, 3), {"fwd_wgs": 3}),
    "gl wg3 n64s4": ("gluon", (64, 4), {"fwd_wgs": 3}),
    "gl wg3 n128s2": ("gluon", (128, 2), {"fwd_wgs": 3}),
    "gl wg3 n64s3": ("gluon", (64, 3), {"fwd_wgs": 3}),
    "gl wg3 n64s4 ahead": ("gluon", (64, 4), {"fwd_wgs": 3, "fwd_s_ahead": 1}),
    "gl wg3 n64s4 poly2": ("gluon", (64, 4), {"fwd_wgs": 3, "fwd_exp_poly": 2}),
    "gl wg3 poly2": ("gluon", (128, 3), {"fwd_wgs": 3, "fwd_exp_poly": 2}),
    "gl ahead poly2": ("gluon", (128, 3), {"fwd_s_ahead": 1, "fwd_exp_poly": 2}),
    "mutant poly4 shift22": ("gluon", (128, 3), {"fwd_exp_poly": 4, "patch": (r"<< 23\)", "<< 22)")}),
}
# each round's candidates in groups: a group's checks and timing run in a process of their own after the build, the
# first group first (round A: the three-warpgroup builds faulted in the build phase (the bf16 O buffers were two, now
# one a warpgroup) and the fault took the GPU context of every later phase: their kernels are now compiled without a
# launch in the build (JITFunction.warmup) and first launched in the last group). Each group: (candidates, full rows).
ROUNDS = {"A": [(["tri m128n128w8s3", "tri m128n64w4s3", "tri m128n128w4s4", "tri m128n64w4s4", "gl base", "gl n128s2",
                  "gl n64s4", "gl turns1", "gl turns2", "gl turns4", "gl ahead", "gl pvov", "gl poly2", "gl poly4",
                  "gl wg3", "gl wg3 n64s4", "mutant poly4 shift22"], ["gl base", "gl ahead", "gl turns2"])],
          "B": [(["tri m128n128w8s3", "tri m128n64w4s3", "gl base", "gl n64s4", "gl turns2", "gl turns4", "gl ahead",
                  "gl poly2", "mutant poly4 shift22"], ["gl base", "gl ahead"]),
                (["gl base", "gl wg3", "gl wg3 n128s2", "gl wg3 n64s4", "gl wg3 n64s4 ahead", "gl wg3 n64s4 poly2"],
                 ["gl base", "gl wg3", "gl wg3 n64s4"])],
          # C (for a confirmation run, after round B: group 0 had one pass): round B's leaders, one group, longer
          "C": [(["gl base", "gl ahead", "gl poly2", "gl ahead poly2", "gl turns4", "gl wg3"], ["gl base", "gl ahead"])]}
GROUP = int(sys.argv[sys.argv.index("--group") + 1]) if "--group" in sys.argv else None
ALL = CANDS
_names = [n for g in ROUNDS[ROUND] for n in g[0]]
CANDS = {n: ALL[n] for n in _names}  # every candidate of the round (the build and the dry run)
if GROUP is not None:  # a run phase: its group's
    CANDS = {n: ALL[n] for n in ROUNDS[ROUND][GROUP][0]}
NOLAUNCH = [n for n in CANDS if "wg3" in n] if ROUND == "B" else []  # built without a launch (JITFunction.warmup)
# spills at 160 registers (45 words; 13 loads, 12 stores in the causal masked step only: --dry-run); timed
SPILLS = ("gl wg3", "gl wg3 n128s2", "gl wg3 poly2")
# the same out and lse as another render (only the order of issue differs)
BITWISE = {"gl turns1": "gl base", "gl turns2": "gl base", "gl turns4": "gl base", "gl ahead": "gl base",
           "gl pvov": "gl base", "gl wg3 n64s4 ahead": "gl wg3 n64s4", "gl ahead poly2": "gl poly2"}
TIMED = [n for n in CANDS if not n.startswith("mutant")]
TIMED_FULL = ROUNDS[ROUND][GROUP][1] if GROUP is not None else sorted({n for g in ROUNDS[ROUND] for n in g[1]})
# (mask, B, Hq, Sq, Sk): odd lengths, Sq != Sk both ways (causal 1300 x 777: 523 rows a head see no key); the last at
# the timed shape's specialization (B1, lengths divisible by 16: the timed build)
CHECKS = (("causal", 2, 4, 1000, 1000), ("causal", 2, 4, 1300, 777), ("none", 2, 4, 777, 1300),
          ("causal", 2, 4, 777, 1300), ("causal", 1, 4, 2048, 2048), ("none", 1, 4, 2048, 2048))
# run: a group's checks (cut at CHECK_S) then its timing, one process (modules loaded once)
PHASE_LIMIT = {"build": 21, "run": {"A": (24, ), "B": (14, 13), "C": (27, )}[ROUND]}
CHECK_S = 6


def log(msg):
    print(f"[{time.time() - T0:5.1f}s] {msg}", flush=True)


def spec_of(name, mask):
    import fagen
    backend, tiles, _ = CANDS[name]
    if backend == "triton":
        bm, bn, w, st = tiles
        return fagen.KernelSpec(head_dim=64, mask=mask, dtype="bf16", backend="triton", block_m=bm, block_n=bn,
                                num_warps=w, num_stages=st)
    bn, st = tiles
    return fagen.KernelSpec(head_dim=64, mask=mask, dtype="bf16", backend="gluon", block_n=bn, num_stages=st)


_MODS: dict = {}


def module(name, mask):
    """Candidate `name`'s module for `mask`: a Triton spec through fagen.load, a Gluon render with the variant's keys
    for this render only (and its patch: the mutant)."""
    key = (name, mask)
    if key in _MODS:
        return _MODS[key]
    import fagen
    from fagen import backends
    from fagen.codegen import render
    from fagen.runtime.loader import load_source
    sp = spec_of(name, mask)
    changes = dict(CANDS[name][2])
    patch = changes.pop("patch", None)
    if CANDS[name][0] == "triton" or (not changes and not patch):
        _MODS[key] = fagen.load(sp)
        return _MODS[key]
    saved = dict(backends.GLUON.variant)
    backends.GLUON.variant.update(changes)
    render.render.cache_clear()
    try:
        source = fagen.generate(sp)
    finally:
        backends.GLUON.variant.clear()
        backends.GLUON.variant.update(saved)
        render.render.cache_clear()
    if patch:
        source, hits = re.subn(patch[0], patch[1], source)
        assert hits, f"{name}: no {patch[0]!r} in the render"
    _MODS[key] = load_source(source, f"{sp.name}_{re.sub(r'[^0-9a-z]+', '_', name)}")
    return _MODS[key]


def case_of(row):
    from fagen.bench.workloads import make_case, standard_suite
    if row == FULL:
        return make_case(FULL, head_dim=64, mask="none", batch=1, heads_q=32, heads_kv=32, seq_q=16384, seq_k=16384)
    return {c.name: c for c in standard_suite()}[row]


def jobs():
    out = [("row", ROW), ("row", FULL), ("cudnn", ROW), ("cudnn", FULL)]
    for n in CANDS:
        out.append((n, "causal"))
        if n in TIMED_FULL or n.startswith("mutant"):
            out.append((n, "none"))
    return out


def _warm(job):
    t = time.time()
    try:
        import torch
        name, mask = job
        if name in ("row", "cudnn"):  # the suite's row function (and the peer), inputs made once, one call each
            from fagen.bench import impls
            from fagen.bench.cases import CaseContext
            from fagen.bench.peers import prepare_sdpa
            cc = CaseContext(case_of(mask), torch.device("cuda"), 1)
            p = impls.prepare_fagen(cc.case, cc) if name == "row" else prepare_sdpa("sdpa-cudnn", cc.case, cc)
            with torch.no_grad():
                p.fn(cc.sets[0])
            torch.cuda.synchronize()
            if name == "row":  # the product at the checks' shapes too
                q = torch.randn(2, 4, 1000, 64, device="cuda", dtype=torch.bfloat16)
                cc_mod = __import__("fagen").load(cc.case.spec(torch.device("cuda"))[0])
                cc_mod.forward(q, q, q)
            return f"built {name} {mask} ({p.spec or p.note}) in {time.time() - t:.1f}s"
        m = module(name, mask)
        if name in NOLAUNCH:  # compiled for its first call's specialisation, not launched (JITFunction.warmup)
            fn = m._attn_fwd_hopper
            m._fast_attn_fwd_hopper = type("W", (), {"__getitem__": lambda self, grid: lambda *a, **c: fn.warmup(
                *m._plain_args(a), grid=grid, **c)})()
            q = torch.randn(2, 4, 1000, 64, device="cuda", dtype=torch.bfloat16)
            m.forward(q, q, q)
            torch.cuda.synchronize()
            return f"compiled {name} {mask} (no launch) in {time.time() - t:.1f}s"
        q = torch.randn(2, 4, 1000, 64, device="cuda", dtype=torch.bfloat16)
        m.forward(q, q, q)
        if not name.startswith("mutant"):  # the timed shape's build (B1, lengths divisible by 16)
            q = torch.randn(1, 32, 16384, 64, device="cuda", dtype=torch.bfloat16)
            m.forward(q, q, q)
        torch.cuda.synchronize()
        return f"built {name} {mask} in {time.time() - t:.1f}s"
    except Exception as e:  # noqa: BLE001
        return f"build ERROR {job}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def phase_build():
    work, done = jobs(), []
    with mp.get_context("spawn").Pool(min(len(work), 15)) as pool:
        for msg in pool.imap_unordered(_warm, work):
            if "ERROR" in msg or msg.startswith("built row") or msg.startswith("built cudnn"):
                log(msg)
            done.append(msg)
    log(f"build: {len(done)} jobs, {sum('ERROR' in m for m in done)} errors")


def phase_check():
    """Every module at every shape of CHECKS; one line per module: the worst out error (over the largest output), lse
    error, the empty rows, bit for bit against another render where it must be (BITWISE)."""
    import torch
    import fagen
    from fagen.verify import reference
    t_phase = time.time()
    worst = {}  # name -> [out err, lse err, empty ok, bitwise ok (None: not asked), shapes, error text]
    for ci, (mask, b, hq, sq, sk) in enumerate(CHECKS):
        g = torch.Generator(device="cuda").manual_seed(100 + ci)
        q = torch.randn(b, hq, sq, 64, device="cuda", generator=g).mul(2.0).to(torch.bfloat16)
        k, v = (torch.randn(b, hq, sk, 64, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
        ro, rl = reference.attention(q.double(), k.double(), v.double(), mask=mask)
        fin = torch.isfinite(rl)
        outs = {}
        for name in ["product"] + [n for n in CANDS if (n, mask) in jobs()]:
            if name.startswith("mutant") and (b, sq) == (1, 2048):
                continue
            w = worst.setdefault(f"{mask[:4]} {name}", [0.0, 0.0, True, None, 0, ""])
            try:
                if name == "product":
                    m = fagen.load(case_of(ROW if mask == "causal" else FULL).spec(torch.device("cuda"))[0])
                else:
                    m = module(name, mask)
                o, lse = m.forward(q, k, v)
                torch.cuda.synchronize()
                outs[name] = (o, lse)
                w[0] = max(w[0], ((o.double() - ro).abs().max() / ro.abs().max()).item())  # over the largest output
                w[1] = max(w[1], (lse.double()[fin] - rl[fin]).abs().max().item() if fin.any() else 0.0)
                w[2] &= bool((o[~fin.unsqueeze(-1).expand_as(o)] == 0).all() and (lse[~fin] == float("-inf")).all())
                if BITWISE.get(name) in outs:
                    ref = outs[BITWISE[name]]
                    same = torch.equal(o, ref[0]) and torch.equal(lse, ref[1])
                    w[3] = same if w[3] is None else (w[3] and same)
                w[4] += 1
            except Exception as e:  # noqa: BLE001
                w[5] = f"{sq}x{sk}: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        if time.time() - t_phase > CHECK_S - 1.5:
            log(f"checks cut after {ci + 1} of {len(CHECKS)} shapes (the phase's time)")
            break
    bad = 0
    for key, (eo, el, empty, same, n, err) in worst.items():
        ok = not err and eo <= 1e-2 and el <= 5e-3 and empty and same is not False
        mut = "mutant" in key
        verdict = ("caught" if not ok else "NOT CAUGHT") if mut else ("ok" if ok else "FAIL")
        bad += ok if mut else not ok
        log(f"CHECK {key:26} {n} shapes: out {eo:.2e} lse {el:.2e} empty {'ok' if empty else 'BAD'}"
            f"{'' if same is None else ' bitwise ' + ('=' if same else 'DIFFERS')}{' ' + err if err else ''}: {verdict}")
    log(f"checks: {bad} bad")
    return bad


def phase_run():
    log(f"== group {GROUP}: {', '.join(CANDS)}")
    bad = phase_check()
    phase_time()
    sys.exit(1 if bad else 0)


def phase_time():
    import torch
    from fagen.bench import impls
    from fagen.bench.cases import CaseContext
    from fagen.bench.peers import prepare_sdpa
    from fagen.bench.timing import measure
    dev = torch.device("cuda")
    rows = []  # (label, fn, case context, the reference label)
    for row, mask, names in ((ROW, "causal", TIMED), (FULL, "none", TIMED_FULL)):
        cc = CaseContext(case_of(row), dev, 3)
        tag = "" if mask == "causal" else "full "
        p = impls.prepare_fagen(cc.case, cc)
        ref = f"{tag}triton (row)"
        log(f"{row}: the row's spec {p.spec}")
        rows.append((ref, p.fn, cc, ref))
        rows.append((f"{tag}cudnn", prepare_sdpa("sdpa-cudnn", cc.case, cc).fn, cc, ref))
        for n in names:
            m = module(n, mask)
            rows.append((f"{tag}{n}", lambda st, m=m: m.forward(st.q, st.k, st.v), cc, ref))
    times, lines = collections.defaultdict(list), ["== time: no pass"]
    with torch.no_grad():
        for label, fn, c, _ in rows:
            fn(c.sets[0])
        torch.cuda.synchronize()
        log(f"first calls done ({len(rows)} rows)")
        t0 = time.time()
        for p in range(40):
            if p and (time.time() - t0) / p * 1.2 > PHASE_LIMIT["run"][GROUP] - 2.5 - (time.time() - T_RUN):
                break
            for label, fn, c, _ in random.Random(p).sample(rows, len(rows)):
                times[label].append(measure(lambda i, fn=fn, c=c: fn(c.sets[i]), len(c.sets), dev, 3, 15))
            log(f"pass {p}: triton row {times['triton (row)'][-1]:.3f} ms, cudnn {times['cudnn'][-1]:.3f} ms")
            lines = summary(rows, times)
            if os.environ.get("OUT"):  # every pass's ms and the summary so far (a killed phase leaves them)
                out = Path(os.environ["OUT"])
                (out / f"d64fwd-{ROUND}{GROUP}-times.json").write_text(json.dumps(times, indent=0))
                (out / f"d64fwd-{ROUND}{GROUP}-summary.txt").write_text("\n".join(lines) + "\n")
    for line in lines:
        log(line)


def summary(rows, times):
    """The timing's lines: TF/s of the median and per pass the Triton row's time over the row's (median,
    quartiles, passes above 1), over the passes every row has."""
    n = min(len(t) for t in times.values())
    lines = [f"== time: {n} shuffled passes; TF/s of the median; per pass the Triton row's time / the row's: median "
             f"[quartiles], passes above 1"]
    for label, _, c, ref in rows:
        b, h, s, d = c.sets[0].q.shape
        flops = 4 * b * h * s * s * d / (2 if c.case.mask.value == "causal" else 1)
        tf = flops / statistics.median(times[label][:n]) / 1e9
        r = sorted(a / x for a, x in zip(times[ref][:n], times[label][:n]))
        qt = len(r) // 4
        lines.append(f"TIME {label:24} {tf:6.1f} TF/s  {statistics.median(r):.3f} [{r[qt]:.3f}-{r[-1 - qt]:.3f}] "
                     f"{sum(x > 1 for x in r)}/{n}")
    return lines


def dry_run():
    """Every module built for sm_90 on the CPU: Gluon through compile_for (regs, spills, the step loops' SASS),
    Triton through fagen.aot (regs, spills, shared)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from sm90 import ptxas
    failed = 0
    for name, mask in jobs():
        if name in ("row", "cudnn"):
            continue
        t = time.time()
        try:
            if CANDS[name][0] == "triton":
                from fagen.aot.artifacts import compile_arch
                ks = compile_arch(spec_of(name, mask), "sm_90").kernels
                desc = "; ".join(f"{k.name} {k.registers} regs, spills {k.spills}, {k.shared} B" for k in ks)
                failed += any(k.spills for k in ks)
            else:
                res, _, dump = ptxas(module(name, mask).compile_for().asm["ptx"], sass=True)
                r = next(iter(res.values()))
                loops = step_loops(dump)[:2]  # warpgroup 0's unmasked and masked steps (a warp's SASS a step)
                desc = f"{r.registers} regs, spills {r.spill_stores}/{r.spill_loads}: " + "; ".join(
                    " ".join(f"{k}={v}" for k, v in c.items()) for c in loops)
                failed += bool(not loops or ((r.spill_stores or any(c["LDL"] + c["STL"] for c in loops))
                                             and name not in SPILLS))
            print(f"{name:20} {mask:6}: {desc} ({time.time() - t:.0f}s)", flush=True)
        except Exception as e:  # noqa: BLE001
            failed += 1
            print(f"{name:20} {mask:6}: ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)
    sys.exit(1 if failed else 0)


def step_loops(dump):
    """Per innermost SASS loop with HGMMA (a consumer step: S and P V): its length and opcode counts."""
    ins = [(int(m.group(1), 16), m.group(2).strip()) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", dump)]
    at = {a: i for i, (a, _) in enumerate(ins)}
    regions = []
    for j, (_, x) in enumerate(ins):
        m = re.search(r"\bBRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", x)
        if m and int(m.group(1), 16) in at and at[int(m.group(1), 16)] < j:
            regions.append((at[int(m.group(1), 16)], j))
    hg = lambda r: sum("HGMMA" in y for _, y in ins[r[0]:r[1] + 1])  # noqa: E731
    inner = [r for r in regions if hg(r) and not any(o != r and r[0] <= o[0] and o[1] <= r[1] and hg(o)
                                                      for o in regions)]
    out = []
    for r in inner:
        ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", y).split(" ")[0].split(".")[0]
                                  for _, y in ins[r[0]:r[1] + 1])
        out.append({"n": r[1] - r[0] + 1, "HGMMA": ops["HGMMA"], "MUFU": ops["MUFU"], "FFMA": ops["FFMA"],
                    "FADD": ops["FADD"], "FMUL": ops["FMUL"], "FMNMX": ops["FMNMX"], "BAR": ops["BAR"],
                    "SYNCS": ops["SYNCS"], "LDL": ops["LDL"], "STL": ops["STL"]})
    return out


def main():
    if "--dry-run" in sys.argv:
        dry_run()
    if "--phase" in sys.argv:
        {"build": phase_build, "run": phase_run}[sys.argv[sys.argv.index("--phase") + 1]]()
        return
    out = os.environ.get("OUT")
    env = child_env(os.path.join(out, "cache") if out else "/tmp/d64fwd-cache", ROOT)
    if out:  # the kernel cache under $OUT would come back: keep it out
        env["FAGEN_CACHE_DIR"] = "/tmp/d64fwd-cache"
    env.setdefault("TRITON_CACHE_DIR", "/tmp/d64fwd-triton")
    log(f"round {ROUND}: {len(jobs())} builds")
    rc = [run_phase(__file__, "build", PHASE_LIMIT["build"], env, extra=("--round", ROUND))[0]]
    log(f"phase build: {rc[0]}")
    for g in range(len(ROUNDS[ROUND])):
        rc.append(run_phase(__file__, "run", PHASE_LIMIT["run"][g], env, extra=("--round", ROUND, "--group", str(g)))[0])
        log(f"phase run, group {g}: {rc[-1]}")
    sys.exit(0 if all(r == 0 for r in rc[1:]) else 1)


if __name__ == "__main__":
    main()
