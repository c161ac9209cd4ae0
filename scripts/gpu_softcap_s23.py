"""The softcap forward's schedule (twenty-third session): the standard suite's fwd-d128-softcap-causal-s16k (B1 H16 s16k
d128 bf16, cap 50; the Gluon forward since the twenty-second session, 0.81x the plain causal row against a 0.9x target)
against the levers of [Note] Softcap forward levers in fagen/templates/gluon/attention.py.j2 (GluonBackend.variant
pv_overlap, cap_turns, cap_max_first, cap_fixed_max, and the twenty-second session's cap_exp_poly; all default
off). Round A: the schedule levers; round B (the default): max first again, the fixed shift alone and with the others;
round C (not run in the session): the fixed shift with l summed from the rounded P, against the product (max first).

    PYTHONPATH=$PWD python3 scripts/gpu_softcap_s23.py --dry-run     # the CPU: sm_90 builds, step-loop SASS counts
    python3 scripts/gpu_softcap_s23.py --round A                      # the GPU: build, check, time (< 50 s)

Phases, each a child process with a wall-clock limit (scripts/_phases.py): build (every module in parallel children
into one kernel cache, the timed ones at the suite's s16k shape too: Triton specializes arguments divisible by 16),
check (float64, fagen.verify.reference: causal and full, odd lengths, Sq != Sk both ways, rows that see no key, cap 50
and 20; the mutant must fail), time (the suite's own row functions and measure for the product softcap row and the
plain causal row, the variants' modules on the softcap row's inputs; shuffled passes, per-pass time ratios against
the product softcap row).
"""

from __future__ import annotations

import collections
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

ROUND = (sys.argv[sys.argv.index("--round") + 1] if "--round" in sys.argv else "B").upper()
T0 = time.time()
# name -> GluonBackend.variant changes for the softcap render (None: the product, fagen.load of the spec)
VARIANTS = {
    "product": None,
    "maxfirst": {"cap_max_first": 1},
    "fix": {"cap_fixed_max": 1},
    "fix+pv": {"cap_fixed_max": 1, "pv_overlap": 1},
    "fix+exp2": {"cap_fixed_max": 1, "cap_exp_poly": 2},
    "fix+exp3": {"cap_fixed_max": 1, "cap_exp_poly": 3},
    "mutant: no tanh": {"cap_max_first": 1, "patch": (r"s_acc = _tanh\(s_x\)", "s_acc = s_x * 1.0")},
    "mutant: no clamp": {"cap_fixed_max": 1, "patch": (r"2\.0 \* qk_scale - 96\.0", "2.0 * qk_scale - 960.0")},
}
ROUND_A = {  # round A's (all passed the checks; none but maxfirst won): kept for --round A
    "pv": {"pv_overlap": 1}, "turns2": {"cap_turns": 2}, "turns4": {"cap_turns": 4},
    "pv+maxfirst": {"pv_overlap": 1, "cap_max_first": 1}, "pv+exp2": {"pv_overlap": 1, "cap_exp_poly": 2},
    "mutant: no tanh": {"pv_overlap": 1, "cap_max_first": 1, "patch": (r"s_acc = _tanh\(s_x\)", "s_acc = s_x * 1.0")},
}
if ROUND == "A":
    VARIANTS = {"product": None, "maxfirst": VARIANTS["maxfirst"], **ROUND_A}
if ROUND == "C":  # after CAP_MAX_FIRST (the product takes the max first): the fixed shift with l from the rounded P
    VARIANTS = {"product": None, "max after (main)": {"cap_max_first": 0},
                **{n: v for n, v in VARIANTS.items() if n.startswith(("fix", "mutant")) and n != "fix+pv"}}  # spills
TIMED = [n for n in VARIANTS if not n.startswith("mutant") and n != "product"]
# (mask, B, Hq, Hkv, Sq, Sk, cap): odd lengths (one build a mask), Sq != Sk both ways (causal 1300x777: 523 rows a
# head see no key: out 0, lse -inf), and the timed build's specialization (lengths divisible by 16) at 4096 / 2048
CHECKS = (("causal", 2, 4, 4, 1000, 1000, 50.0), ("causal", 1, 4, 4, 1300, 777, 20.0), ("none", 1, 4, 4, 777, 1300, 50.0),
          ("none", 1, 2, 2, 129, 2049, 20.0), ("causal", 1, 2, 2, 4096, 4096, 50.0), ("causal", 1, 2, 2, 2048, 4096, 20.0),
          ("neg", 1, 4, 4, 333, 1000, 50.0))  # neg: the full mask, every score near -80 (tanh near -0.92 of the cap)
PHASE_LIMIT = {"build": 21, "check": 10, "time": 17}
SHAPES = {"causal": (1000, 1000), "none": (777, 1300)}  # the odd-length build of each mask


def log(msg):
    print(f"[{time.time() - T0:5.1f}s] {msg}", flush=True)


def spec_of(mask):
    import fagen
    return fagen.KernelSpec(head_dim=128, mask=mask, softcap=True, dtype="bf16", backend="gluon")


def render_with(sp, changes):
    """The render of spec sp with GluonBackend.variant changed by `changes` for this render only."""
    import fagen
    from fagen import backends
    from fagen.codegen import render
    saved = dict(backends.GLUON.variant)
    backends.GLUON.variant.update(changes)
    render.render.cache_clear()
    try:
        return fagen.generate(sp)
    finally:
        backends.GLUON.variant.clear()
        backends.GLUON.variant.update(saved)
        render.render.cache_clear()


_MODS = {}


def module(name, mask):
    """The Gluon softcap forward of variant `name` (the product: fagen.load; a mutant: its patch on the render)."""
    import fagen
    from fagen.runtime.loader import load_source
    if (name, mask) in _MODS:
        return _MODS[name, mask]
    sp = spec_of(mask)
    if VARIANTS[name] is None:
        m = fagen.load(sp)
    else:
        changes = dict(VARIANTS[name])
        patch = changes.pop("patch", None)
        source = render_with(sp, changes)
        if patch:
            source, hits = re.subn(patch[0], patch[1], source)
            assert hits, f"{name}: no {patch[0]!r} in the render"
        m = load_source(source, f"{sp.name}_{re.sub(r'[^0-9a-z]+', '_', name)}")
    _MODS[name, mask] = m
    return m


ROWS = ("fwd-d128-softcap-causal-s16k", "fwd-d128-causal-s16k")


def jobs():
    out = [("row", r) for r in ROWS]
    for n in VARIANTS:
        for m in ("causal", "none"):
            if not (n.startswith("mutant") and m == "causal"):  # the mutant: the full mask's odd shapes
                out.append((n, m, "odd"))
            if m == "causal" and not n.startswith("mutant") and n != "product":
                out.append((n, m, "s16k"))
    return out


def _warm(job):
    t = time.time()
    try:
        import torch
        if job[0] == "row":  # the suite's row function, built (its inputs made) once so the time phase only times
            from fagen.bench import impls
            from fagen.bench.cases import CaseContext
            from fagen.bench.workloads import standard_suite
            cc = CaseContext({c.name: c for c in standard_suite()}[job[1]], torch.device("cuda"), 1)
            p = impls.prepare_fagen(cc.case, cc)
            p.fn(cc.sets[0])
            torch.cuda.synchronize()
            return f"built row {job[1]} ({p.spec}) in {time.time() - t:.1f}s"
        name, mask, shape = job
        m = module(name, mask)
        if shape == "odd":
            sq, sk = SHAPES[mask]
            q = torch.randn(1, 2, sq, 128, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(1, 2, sk, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        else:
            q, k, v = (torch.randn(1, 16, 16384, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        m.forward(q, k, v, softcap=50.0)
        torch.cuda.synchronize()
        return f"built {name} {mask} {shape} in {time.time() - t:.1f}s"
    except Exception as e:  # noqa: BLE001
        return f"build ERROR {job}: {type(e).__name__}: {str(e).splitlines()[0][:200]}"


def phase_build():
    js = jobs()
    js.sort(key=lambda j: j[0] != "row")
    with mp.get_context("spawn").Pool(min(len(js), 16)) as pool:
        for msg in pool.imap_unordered(_warm, js):
            log(msg)


def _mask(mask):
    return "none" if mask == "neg" else mask


def ok_file():
    return os.path.join(os.environ.get("OUT") or "/tmp/softcap-out", f"checked-{ROUND}.txt")


def phase_check():
    """Every variant (the turns last: a hang there costs only what follows) against float64 at every check; one line
    a variant. A variant that passes is appended to ok_file(), which the time phase reads."""
    import torch
    from fagen.verify import reference
    inputs = []
    for ci, (mask, b, hq, hkv, sq, sk, cap) in enumerate(CHECKS):
        g = torch.Generator(device="cuda").manual_seed(100 + ci)
        q = torch.randn(b, hq, sq, 128, device="cuda", generator=g).mul(2.5).to(torch.bfloat16)
        k, v = (torch.randn(b, hkv, sk, 128, device="cuda", generator=g).mul(2.5).to(torch.bfloat16) for _ in range(2))
        if mask == "neg":  # q = 30 u + noise, k = -30 u + noise: q.k / sqrt(128) near -80 with a spread of a few
            u = torch.nn.functional.normalize(torch.randn(128, device="cuda", generator=g), dim=0)
            q = (30 * u + torch.randn(b, hq, sq, 128, device="cuda", generator=g) * 0.3).to(torch.bfloat16)
            k = (-30 * u + torch.randn(b, hkv, sk, 128, device="cuda", generator=g) * 0.3).to(torch.bfloat16)
        ro, rl = reference.attention(q.double(), k.double(), v.double(), mask=_mask(mask), softcap=cap)
        inputs.append((q, k, v, ro, rl, torch.isfinite(rl)))
    log(f"checks: {len(CHECKS)} cases (mask Sq x Sk cap): "
        + ", ".join(f"{c[0]} {c[4]}x{c[5]} {c[6]:.0f}" for c in CHECKS))
    bad, prod = 0, {}
    order = sorted(VARIANTS, key=lambda n: ("turns" in n, n.startswith("mutant")))
    for name in order:
        mut = name.startswith("mutant")
        worst, wl, empty_ok, same, cases, err = (0.0, ""), 0.0, True, 0, 0, None
        fails = []
        for ci, (mask, b, hq, hkv, sq, sk, cap) in enumerate(CHECKS):
            if mut and (sq % 16 == 0 or mask == "causal"):  # "neg" included (the full mask)
                continue  # the mutant at the full mask's odd shapes (its own build)
            q, k, v, ro, rl, fin = inputs[ci]
            try:
                o, l = module(name, _mask(mask)).forward(q, k, v, softcap=cap)
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001
                err = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
                break
            eo = ((o.double() - ro).abs().max() / ro.abs().max()).item()  # relative to the largest output
            el = (l.double()[fin] - rl[fin]).abs().max().item() if fin.any() else 0.0
            e_ok = bool((o[~fin.unsqueeze(-1).expand_as(o)] == 0).all() and (l[~fin] == float("-inf")).all())
            if name == "product":
                prod[ci] = (o, l, eo)
            elif ci in prod:
                same += torch.equal(o, prod[ci][0]) and torch.equal(l, prod[ci][1])
                cases += 1
            # bf16 out: the largest error over the largest output (bf16's rounding ~4e-3); at most 1e-2 and 1.25x
            # the product's (plus 1e-3); lse within 5e-3; rows without a key: out 0, lse -inf
            ok = eo <= 1e-2 and el <= 5e-3 and e_ok and (ci not in prod or eo <= 1.25 * prod[ci][2] + 1e-3)
            if not ok:
                fails.append(ci)
            worst = max(worst, (eo, f"{mask} {sq}x{sk} cap {cap:.0f}"))
            wl, empty_ok = max(wl, el), empty_ok and e_ok
        if err:
            log(f"CHECK {name:16}: ERROR {err}")
            bad += not mut
            continue
        ok = not fails
        verdict = ("caught" if not ok else "NOT CAUGHT") if mut else ("ok" if ok else f"FAIL (cases {fails})")
        bad += (ok if mut else not ok)
        log(f"CHECK {name:16}: out <= {worst[0]:.2e} ({worst[1]}), lse <= {wl:.2e}, empty rows "
            f"{'ok' if empty_ok else 'BAD'}{'' if name == 'product' or mut else f', bitwise the product in {same}/{cases}'}: "
            f"{verdict}")
        if ok and not mut:
            with open(ok_file(), "a") as f:
                f.write(name + "\n")
    log(f"checks: {bad} bad")
    sys.exit(1 if bad else 0)


def phase_time():
    import torch
    from fagen.bench import impls
    from fagen.bench.cases import CaseContext
    from fagen.bench.timing import measure
    from fagen.bench.workloads import standard_suite
    dev = torch.device("cuda")
    suite = {c.name: c for c in standard_suite()}
    cc = CaseContext(suite["fwd-d128-softcap-causal-s16k"], dev, 3)
    pc = CaseContext(suite["fwd-d128-causal-s16k"], dev, 3)
    b, h, s, _ = cc.sets[0].q.shape
    flops = 4 * b * h * s * s * 128 / 2
    prod = impls.prepare_fagen(cc.case, cc)
    rows = [("product (row)", prod.fn, cc), ("plain causal (row)", impls.prepare_fagen(pc.case, pc).fn, pc)]
    log(f"row spec {prod.spec}; scores {cc.sets[0].scores}")
    checked = set(open(ok_file()).read().split()) if os.path.exists(ok_file()) else set()
    for name in TIMED:
        if name not in checked:
            log(f"not timed: {name} (did not pass the checks)")
            continue
        m = module(name, "causal")
        rows.append((name, lambda st, m=m: m.forward(st.q, st.k, st.v, **st.kwargs, **st.scores), cc))
    times = collections.defaultdict(list)
    with torch.no_grad():
        for label, fn, c in rows:
            fn(c.sets[0])
        torch.cuda.synchronize()
        t0 = time.time()
        for p in range(60):
            left = PHASE_LIMIT["time"] - 3 - (time.time() - T0)  # T0: this child's start, imports included
            if p and (time.time() - t0) / p * 1.2 > left:
                break
            for label, fn, c in random.Random(p).sample(rows, len(rows)):
                times[label].append(measure(lambda i, fn=fn, c=c: fn(c.sets[i]), len(c.sets), dev, 5, 25))
            if p % 5 == 0:
                log(f"pass {p}: " + ", ".join(f"{k} {v[-1]:.3f}" for k, v in times.items()) + " ms")
    n = min(len(t) for t in times.values())
    log(f"== time: {n} shuffled passes; TF/s median; per pass the product row's time / the row's: median "
        f"[quartiles], passes above 1; vs plain = TF/s / the plain causal row's")
    tf = {k: flops / statistics.median(v[:n]) / 1e9 for k, v in times.items()}
    for label, _, c in rows:
        r = sorted(a / x for a, x in zip(times["product (row)"][:n], times[label][:n]))
        q = len(r) // 4
        log(f"TIME {label:20} {tf[label]:6.1f} TF/s  vs product {statistics.median(r):.3f} [{r[q]:.3f}-{r[-1 - q]:.3f}]"
            f" {sum(x > 1 for x in r)}/{n}  vs plain {tf[label] / tf['plain causal (row)']:.3f}")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, f"softcap-times-{ROUND}.txt"), "w") as f:
            for k, v in times.items():
                f.write(f"{k}: {' '.join(f'{x:.4f}' for x in v)}\n")


def step_loops(dump):
    """The innermost SASS loops that hold HGMMA (a consumer step: S and P V), as lists of instructions."""
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
    return [[y for _, y in ins[r[0]:r[1] + 1]] for r in inner]


def loop_counts(body):
    """A step loop's length, opcode counts (MUFU by function, BAR by kind) and where the P V wait sits."""
    ops = collections.Counter()
    for y in body:
        op = re.sub(r"^@!?U?P\w+\s+", "", y).split(" ")[0]
        ops[".".join(op.split(".")[:2]) if op.startswith(("MUFU", "BAR")) else op.split(".")[0]] += 1
    idx = lambda pat: [i for i, y in enumerate(body) if re.search(pat, y)]  # noqa: E731
    ex2, pv = idx(r"MUFU\.EX2"), idx(r"DEPBAR\.LE gsb0, 0x0")
    keys = ("MUFU.EX2", "MUFU.TANH", "FMUL", "FFMA", "FADD", "FMNMX", "F2F", "F2FP", "FSEL", "BAR.SYNC", "BAR.ARV",
            "BAR.RED")
    return (f"n {len(body)} " + " ".join(f"{k.replace('MUFU.', '')} {ops[k]}" for k in keys if ops[k])
            + f"; P V wait after {sum(i < pv[0] for i in ex2) if pv else '-'} of {len(ex2)} EX2")


def dry_run():
    sys.path.insert(0, str(ROOT / "tests"))
    from sm90 import ptxas
    import fagen
    failed = 0
    for name in ("plain", *VARIANTS):  # plain: the causal forward without the softcap, main's render (the floor)
        for mask in ("causal", "none"):
            t = time.time()
            m = fagen.load(fagen.KernelSpec(head_dim=128, mask=mask, dtype="bf16", backend="gluon")) \
                if name == "plain" else module(name, mask)
            res, _, dump = ptxas(m.compile_for().asm["ptx"], sass=True)
            r = next(iter(res.values()))
            loops = step_loops(dump)
            print(f"{name:16} {mask:6}: {r.registers} regs, spills {r.spill_stores}/{r.spill_loads} "
                  f"({time.time() - t:.0f}s)", flush=True)
            for body in loops[:2]:  # the consumer's unmasked and masked loops (warpgroup 1; warpgroup 0 alike)
                print(f"    {loop_counts(body)}", flush=True)
            failed += bool(r.spill_stores or r.spill_loads or not loops)
    sys.exit(1 if failed else 0)


def main():
    if "--dry-run" in sys.argv:
        dry_run()
    if "--phase" in sys.argv:
        {"build": phase_build, "check": phase_check, "time": phase_time}[sys.argv[sys.argv.index("--phase") + 1]]()
        return
    out = os.environ.get("OUT", "/tmp/softcap-out")
    os.makedirs(out, exist_ok=True)
    if os.path.exists(ok_file()):
        os.remove(ok_file())
    env = child_env(os.path.join(out, "cache") if os.environ.get("OUT") else "/tmp/softcap-cache", ROOT)
    log(f"round {ROUND}: {len(jobs())} builds")
    rc = {}
    for ph in ("build", "check", "time"):
        rc[ph], _ = run_phase(__file__, ph, PHASE_LIMIT[ph], env)
        log(f"phase {ph}: {rc[ph]}")
    sys.exit(0 if rc["check"] == 0 else 1)


if __name__ == "__main__":
    main()
