"""The learned bias's gradient (issue 26), twenty-third session: the mods suite's row learned-bias+grad (attention-gym's
relative bias over a learned fp32 [H, 2S - 1] table, causal mask_mod, B1 H16 S8192 d128 bf16) with the dK/dV tile's
diagonal sums through a per-program scratch (fagen/codegen/mod_args.py DIAG_SUMS, [Note] Diagonal sums through a
scratch: 1 "scratch", the band read back masked; 2 "padded", zeros around the band, read unmasked and vectorised,
one 256-wide chunk; 4 "pipelined", 2 read a step late, one barrier a step) or by a rotation (3 "rotate": one tl.gather
of the tile's own shape, no scratch) against the product's tl.gather (DIAG_SUMS 0, "gather"). Round B ran 0 and 1
(the script of commit ca72c219); round C runs 0, 2, 3, 4.

Phases, each a child process under a wall-clock limit, < 50 s in all (round B ran check and time apart, and the check
was killed at its 8 s limit before its first row; round C runs both in one process, the timing first):
  build  a pool makes every call the later phases make once (so they find their kernels compiled);
  main   time (below), then check: dq, dk, dv and d(bias) against float64 (fagen.verify.reference, autograd) at odd
         small shapes, causal (the row's MHA module) and full GQA 2, every variant, each bitwise repeatable (two
         calls); fails on a rel. error (max |diff| / max |ref|) over 2e-2, or a variant's d(bias) error over 2x the
         gather's + 1e-3;
         time: the suite's row (fagen.bench.mods.cases and _inputs, its block mask): each variant's d(bias) against the
         gather's at S 8192 (rel. diff <= 1e-4, fails otherwise; dq, dk, dv bitwise equal or not), then backward alone
         (kept graph) and forward+backward of each, and the backward without the bias gradient (the same mod, the
         table not requiring grad: the ceiling), in seeded shuffled passes, per-pass ratios against the gather; one
         backward of each under torch's profiler (the kernels' split).

    python3 scripts/gpu_lbgrad_s23.py --round C     # (B: 8 passes, C: 5)
    python3 scripts/gpu_lbgrad_s23.py --dry-run     # every kernel of every variant built for sm_90 on the CPU
    python3 scripts/gpu_lbgrad_s23.py --smoke       # the phases on the CPU through the interpreter, tiny shapes

docs/mods.md, "The learned bias's gradient (twenty-third session)".
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))
from _phases import child_env, run_phase  # noqa: E402

ROUND = (sys.argv[sys.argv.index("--round") + 1] if "--round" in sys.argv
         else os.environ.get("LBGRAD_ROUND", "B")).upper()
OUT = Path(os.environ.get("OUT") or "/tmp/lbgrad-out")
WORK = Path("/tmp/lbgrad-work")
LIMIT = {"build": 21, "main": 28}
# DIAG_SUMS: 0 the product's gather, 1 the scratch (band read masked), 2 padded (unmasked, one chunk), 3 the rotation,
# 4 padded a step late (one barrier a step). Round B ran (0, 1); C runs the rest beside the product.
VARIANTS = {"B": (0, 1)}.get(ROUND, (0, 2, 3, 4))
NAMES = {0: "gather", 1: "scratch", 2: "padded", 3: "rotate", 4: "pipelined"}
# (causal, Hq, Hkv, S): odd lengths; causal MHA (the row's module), full GQA 2
CASES = [(True, 2, 2, 333), (False, 4, 2, 201)]
PASSES = {"B": 8, "C": 5}.get(ROUND, 5)
REPS = 3
# --smoke (LBGRAD_SMOKE=1 in the children): the check and time phases on the CPU through Triton's interpreter at tiny
# shapes, to run this script's code paths here (no timing meaning)
SMOKE = "--smoke" in sys.argv or os.environ.get("LBGRAD_SMOKE") == "1"
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"
    CASES, PASSES, REPS, LIMIT = [(True, 4, 2, 45), (False, 2, 1, 33)], 2, 1, {"build": 300, "main": 600}
DEV = "cpu" if SMOKE else "cuda"


def log(*a):
    print(*a, flush=True)


def use(v, memo={}):  # noqa: B006 - the per-variant modded-module memos, kept across calls
    """DIAG_SUMS v for the next fagen.attention calls: the lever and its own memo of modded modules (the memo keys
    on the spec, the loader on the spec and the render state)."""
    from fagen.codegen import mod_args
    from fagen.runtime import modded

    mod_args.DIAG_SUMS = v
    modded._MODULES = memo.setdefault(v, {})


def _case_inputs(causal, hq, hkv, s, seed=0):
    import torch

    g = torch.Generator().manual_seed(seed + s)
    d = 32 if SMOKE else 128
    q = torch.randn(1, hq, s, d, generator=g).to(DEV, torch.bfloat16).requires_grad_()
    k, v = (torch.randn(1, hkv, s, d, generator=g).to(DEV, torch.bfloat16).requires_grad_() for _ in range(2))
    do = torch.randn(1, hq, s, d, generator=g).to(DEV, torch.bfloat16)
    bias = (torch.randn(hq, 2 * s - 1, generator=g) * 0.5).to(DEV).requires_grad_()
    return q, k, v, do, bias


def _case_grads(causal, q, k, v, do, bias):
    import torch

    import fagen
    from fagen.bench import gym_mods as g

    out = fagen.attention(q, k, v, score_mod=g.generate_relative_bias(bias, q.shape[2]),
                          mask_mod=g.causal_mask if causal else None)
    return torch.autograd.grad(out, (q, k, v, bias), do)


def _row():
    """The suite's row: (shape, q, k, v, do, learned, score_mod, mask_mod, block mask, flops)."""
    import fagen
    from fagen.bench import mods

    shape = mods.ModsShape(heads=2, seq=96, head_dim=32) if SMOKE else mods.ModsShape()
    name, score_mod, mask_mod, leaves = next(c for c in mods.cases(shape, DEV) if c[0] == "learned-bias+grad")
    q, k, v, do = mods._inputs(shape, DEV, True)
    bm = fagen.create_block_mask(mask_mod, None, None, shape.seq, shape.seq, device=DEV)
    flops = 4.0 * shape.head_dim * shape.heads * shape.batch * shape.seq * (shape.seq + 1) / 2
    return shape, q, k, v, do, leaves[0], score_mod, mask_mod, bm, flops


def _warm(key):
    if not SMOKE:
        os.environ.pop("TRITON_INTERPRET", None)
    t = time.time()
    try:
        import torch

        import fagen
        if key[0] == "check":
            use(key[1])
            c = key[2:]
            _case_grads(c[0], *_case_inputs(*c))
        else:
            shape, q, k, v, do, learned, score_mod, mask_mod, bm, _ = _row()
            use(key[1])
            table = learned if key[0] == "time" else learned.detach()
            mod = score_mod if key[0] == "time" else _same_mod(table, shape.seq)
            out = fagen.attention(q, k, v, score_mod=mod, mask_mod=mask_mod, block_mask=bm)
            torch.autograd.grad(out, (q, k, v, table) if key[0] == "time" else (q, k, v), do)
        torch.cuda.synchronize() if not SMOKE else None
        return f"built {key} in {time.time() - t:.1f}s"
    except Exception as e:  # noqa: BLE001
        return f"build ERROR {key}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def _same_mod(table, s):
    from fagen.bench import gym_mods as g

    return g.generate_relative_bias(table, s)


def phase_build():
    work = [("time", v) for v in VARIANTS] + [("nograd", 0)] + [("check", v, *c) for v in VARIANTS for c in CASES]
    with mp.get_context("spawn").Pool(min(len(work), 16)) as pool:
        for msg in pool.imap_unordered(_warm, work):
            log(msg)


def _rel(a, b):
    return ((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def phase_check():
    import torch

    from fagen.bench import gym_mods as g
    from fagen.verify import reference

    bad = 0
    log("| case | variant | dq | dk | dv | dbias | bitwise |")
    log("|---|---|---|---|---|---|---|")
    for c in CASES:
        causal = c[0]
        q, k, v, do, bias = _case_inputs(*c)
        leaves = [t.detach().double().requires_grad_() for t in (q, k, v, bias)]
        want = reference.attention(*leaves[:3], mask_mod=g.causal_mask if causal else None,
                                   score_mod=g.generate_relative_bias(leaves[3], c[3]))
        want = torch.autograd.grad(want[0] if isinstance(want, tuple) else want, leaves, do.double())
        errs = {}
        for vv in VARIANTS:
            use(vv)
            runs = [_case_grads(causal, q, k, v, do, bias) for _ in range(2)]
            bitwise = all(torch.equal(a, b) for a, b in zip(*runs))
            e = [_rel(a, b) for a, b in zip(runs[0], want)]
            errs[vv] = e
            ok = bitwise and max(e) < 2e-2 and (vv == 0 or e[3] <= 2 * errs[0][3] + 1e-3)
            bad += not ok
            name = f"{'causal' if causal else 'full'} Hq{c[1]} Hkv{c[2]} S{c[3]}"
            log(f"| {name} | {NAMES[vv]} | " + " | ".join(f"{x:.2e}" for x in e) + f" | {bitwise} |"
                + ("" if ok else " FAIL"))
    log(f"check: {'FAILED ' + str(bad) if bad else 'all passed'}")
    return 1 if bad else 0


def _ms(fn, reps):
    import torch

    fn()
    if SMOKE:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def _quart(xs):
    xs = sorted(xs)
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return f"{q[1]:.4f} [{q[0]:.4f}, {q[2]:.4f}]"


def _profile(fn):
    import torch
    from torch.profiler import ProfilerActivity, profile

    if SMOKE:
        return []
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = sorted(((e.key, (getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)) / 1e3)
                   for e in prof.key_averages()), key=lambda r: -r[1])
    return [(n[:48], round(ms, 3)) for n, ms in rows if not n.startswith(("aten::", "autograd"))][:6]


def phase_main():
    bad = phase_time()  # first: its S 8192 comparison with the product is a check too
    return phase_check() or bad


def phase_time():
    import torch

    import fagen

    shape, q, k, v, do, learned, score_mod, mask_mod, bm, fl = _row()
    attend = lambda mod: fagen.attention(q, k, v, score_mod=mod, mask_mod=mask_mod, block_mask=bm)  # noqa: E731
    outs, grads = {}, {}
    for vv in VARIANTS:
        use(vv)
        outs[vv] = attend(score_mod)
        grads[vv] = torch.autograd.grad(outs[vv], (q, k, v, learned), do, retain_graph=True)
        cls = getattr(outs[vv].grad_fn, "_forward_cls", None)
        m = sys.modules.get(getattr(cls, "__module__", ""))
        log(f"{NAMES[vv]}: module {getattr(m, '__name__', '?')}, scratch in it {hasattr(m, '_mod_cta_barrier')}")
    bad, diff = False, {}
    for vv in VARIANTS[1:]:
        diff[vv] = _rel(grads[vv][3], grads[0][3].double())
        same = [torch.equal(a, b) for a, b in zip(grads[0][:3], grads[vv][:3])]
        log(f"S {shape.seq}: {NAMES[vv]} d(bias) vs gather rel. diff {diff[vv]:.2e}; dq, dk, dv bitwise equal {same}")
        bad |= diff[vv] > 1e-4
    table = learned.detach()
    use(0)
    out_f = attend(_same_mod(table, shape.seq))

    def fwdbwd(vv):
        def run():
            use(vv)
            torch.autograd.grad(attend(score_mod), (q, k, v, learned), do)
        return run

    items = {f"bwd {NAMES[vv]}": (lambda vv=vv: torch.autograd.grad(outs[vv], (q, k, v, learned), do,
                                                                     retain_graph=True)) for vv in VARIANTS}
    items |= {f"fwd+bwd {NAMES[vv]}": fwdbwd(vv) for vv in VARIANTS}
    items["bwd no bias grad"] = lambda: torch.autograd.grad(out_f, (q, k, v), do, retain_graph=True)
    times = {n: [] for n in items}
    rng = random.Random(23)
    for _ in range(PASSES):
        order = list(items)
        rng.shuffle(order)
        for n in order:
            times[n].append(_ms(items[n], REPS))
    log(f"\n{PASSES} shuffled passes, {REPS} reps each (median per pass); ms median [quartiles]; TF/s at the median "
        "(4 D per visible pair, bwd 2.5x)")
    log("| item | ms | TF/s |")
    log("|---|---|---|")
    for n, ts in times.items():
        m = statistics.median(ts)
        log(f"| {n} | {_quart(ts)} | {(2.5 if n.startswith('bwd') else 3.5) * fl / m / 1e9:.0f} |")
    log("\nper-pass ratios against the gather (the product): median [quartiles]")
    for vv in VARIANTS[1:]:
        for part in ("bwd", "fwd+bwd"):
            r = [a / b for a, b in zip(times[f"{part} {NAMES[vv]}"], times[f"{part} gather"])]
            log(f"  {part} {NAMES[vv]} / gather: {_quart(r)}")
        r = [a / b for a, b in zip(times[f"bwd {NAMES[vv]}"], times["bwd no bias grad"])]
        log(f"  bwd {NAMES[vv]} / bwd without the bias gradient: {_quart(r)}")
    for vv in VARIANTS:
        log(f"profile bwd {NAMES[vv]}: " + json.dumps(_profile(items[f"bwd {NAMES[vv]}"])))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "lbgrad.json").write_text(json.dumps({"round": ROUND, "times_ms": times, "dbias_rel_diff": diff}))
    return 1 if bad else 0


def dry_run():
    """Every kernel of both variants' modules (the row's spec, the check specs) built for sm_90: regs, spills, shared,
    cp.async in the dK/dV kernel, whether ptxas serialised its wgmma."""
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, str(ROOT / "tests"))
    import torch

    from fagen.aot.artifacts import _compile_kernel, _compiled_mode, import_for_compile
    from fagen.bench import gym_mods as g
    from fagen.codegen import mod_args
    from fagen.runtime.modded import modded_spec
    from fagen.runtime.mods import prepare
    from fagen.spec.kernel import KernelSpec
    from sm90 import ptxas

    specs = {"row": ("causal", 1), "check causal gqa2": ("causal", 2), "check full gqa2": ("none", 2)}
    for vv in NAMES:
        mod_args.DIAG_SUMS = vv
        for name, (mask, gqa) in specs.items():
            base = KernelSpec(head_dim=128, dtype="bf16", direction="bwd", mask=mask, gqa=gqa)
            spec = modded_spec(base, prepare(score_mod=g.generate_relative_bias(torch.zeros(16, 511), 256)).fields,
                               arch="sm_90")
            for entry in import_for_compile(spec).AOT_KERNELS:
                entry = dict(entry, signature=dict(entry["signature"]), constexprs=dict(entry["constexprs"]))
                t = time.time()
                with _compiled_mode():
                    ptx, _, rec = _compile_kernel(spec, "sm_90", entry)
                ptx = ptx.decode()
                log_ = ptxas(ptx)[1]
                log(f"{NAMES[vv]} {name} {entry['name']}: regs {rec['registers']} spills {rec['spills']} shared "
                    f"{rec['shared']} cp.async {ptx.count('cp.async.')} serialized "
                    f"{'serialized' in log_} ({time.time() - t:.1f}s)")
    return 0


def main():
    if "--phase" in sys.argv:
        name = sys.argv[sys.argv.index("--phase") + 1]
        sys.exit({"build": phase_build, "main": phase_main}[name]() or 0)
    if "--dry-run" in sys.argv:
        sys.exit(dry_run())
    t0 = time.time()
    WORK.mkdir(parents=True, exist_ok=True)
    env = child_env(str(WORK / "fagen-cache"), ROOT)
    env.setdefault("TRITON_CACHE_DIR", str(WORK / "triton-cache"))
    env["LBGRAD_ROUND"] = ROUND
    if SMOKE:
        env["LBGRAD_SMOKE"], env["TRITON_INTERPRET"] = "1", "1"
    log(f"gpu_lbgrad_s23 round {ROUND}")
    rcs = {}
    for phase in ("build", "main"):
        rc, _ = run_phase(__file__, phase, LIMIT[phase], env)
        rcs[phase] = rc
        log(f"[{phase}: rc {rc}, {time.time() - t0:.1f}s]")
    sys.exit(0 if all(rc == 0 for rc in rcs.values()) else 1)


if __name__ == "__main__":
    main()
