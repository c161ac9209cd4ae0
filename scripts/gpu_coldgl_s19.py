"""Issue 26's cold first call (nineteenth session, helper coldgl): the Gluon modded forward with variant
fwd_tail_first 1 ([Note] Tail block first in fagen/templates/gluon/attention.py.j2: a non-causal score_mod render
reads its last key block first, masked, then the full blocks in one unmasked loop: one softmax copy fewer per
consumer) against the product's render (fwd_tail_first 0). docs/mods.md, "The cold first call: a smaller modded
forward (nineteenth session)".

Phases (on the GPU machine, ~35 s):
  1. warm-up children, all at once: one per (case, variant) builds the kernel the main process times (each in its own
     TRITON_CACHE_DIR, merged into the main process's afterwards, so the main process finds them compiled).
  2. cold children (the issue's case, as gpu_coldstart.py's "new mod cold"): fresh FAGEN_CACHE_DIR and
     TRITON_CACHE_DIR, import, CUDA init, one plain fagen.attention call on q = k = v [1, 16, 4096, 128] bf16
     (untimed: it compiles the plain Gluon forward), then the timed first call, no gradient, of score +
     where(q_idx >= kv_idx, c, -0.5) with a literal c new to every child: wall seconds to its result, Triton's
     compile stages (listener) and the call's CPU seconds (the process's and ptxas's). COLD_PER children per
     variant, all at once (--cold-par 1: one at a time, alternating).
  3. the main process: for each case (issue: that mod with c = 0.5; the suite's relative-bias, alibi (lowered to
     its row-free score_mod) and softcap (on the H200 not lowered: the Gluon modded forward too)) and variant,
     through fagen.attention without gradient (the module fagen.attention picked, re-picked after each variant
     switch): float64 checks (heads 0 and 15 at B1 H16 S8192; the issue's mod also at Sq 3000
     Sk 4001 and B8 Sq 8192 Sk 77, where the last key block is partial), repeatability, then the warm forward's
     TF/s in shuffled passes, per-pass ratios prod ms / tail ms. Round A timed each (case, variant) of a pass by
     fagen.bench.timing.measure (do_bench, L2 flushed; per-pass ratios spread 0.89-1.22); round B by batches of
     BATCH calls back to back between CUDA events (the median of BATCHES batches), each case's two variants
     adjacent in a pass (their order drawn), more passes.
Exit 1 on a FAIL.

    PYTHONPATH=$PWD python3 scripts/gpu_coldgl_s19.py [--round A|B] [--cold-par N] [--passes P]
    PYTHONPATH=$PWD python3 scripts/gpu_coldgl_s19.py --dry-run   # CPU: every kernel built for sm_90, sizes
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
ARGS = sys.argv[1:]
DRY = "--dry-run" in ARGS


def _opt(name, default):
    return type(default)(ARGS[ARGS.index(name) + 1]) if name in ARGS else default


ROUND = _opt("--round", "A").upper()
COLD_PAR = _opt("--cold-par", 4)
COLD_PER = _opt("--cold-per", 2)
PASSES = _opt("--passes", 9 if ROUND == "A" else 21)
BATCH, BATCHES = 8, 5
VARIANTS = {"prod": 0, "tail": 1}
CASES = ("issue", "relative-bias", "alibi", "softcap")
TMP = tempfile.mkdtemp(prefix="coldgl-")
if not DRY:  # the main process's own caches, fresh; the warm-up children's triton caches are merged into it
    os.environ["TRITON_CACHE_DIR"] = os.path.join(TMP, "main-triton")
    os.environ["FAGEN_CACHE_DIR"] = os.path.join(TMP, "main-fagen")
T0 = time.time()
FAILS: list = []


def log(msg):
    print(f"[{time.time() - T0:5.1f}s] {msg}", flush=True)


def check(ok, text):
    print(f"CHECK {'PASS' if ok else 'FAIL'} {text}", flush=True)
    if not ok:
        FAILS.append(text)


# Shared by the children and the main process: the cases' score_mods on their inputs, the variant switch.
COMMON = r'''
import torch

def issue_mod(c):
    return eval(f"lambda score, b, h, q_idx, kv_idx: score + torch.where(q_idx >= kv_idx, {c!r}, -0.5)",
                {"torch": torch})

def case_mod(case, device):
    """The case's score_mod: the issue's with c = 0.5, or the mods suite's row (fagen.bench.mods.cases, S8192)."""
    if case == "issue":
        return issue_mod(0.5)
    from fagen.bench.mods import ModsShape, cases
    return {name: sm for name, sm, _, _ in cases(ModsShape(), device)}[case]

def suite_inputs(device, batch=1, sq=8192, sk=8192, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(batch, 16, sq, 128, generator=g).to(device, torch.bfloat16)
    k = torch.randn(batch, 16, sk, 128, generator=g).to(device, torch.bfloat16)
    v = torch.randn(batch, 16, sk, 128, generator=g).to(device, torch.bfloat16)
    return q, k, v

def use(tail):
    """fwd_tail_first = tail for the renders from now on, and the modded path's memos of the picked module cleared
    (they key on the spec alone), so the next fagen.attention loads that variant's module."""
    from fagen import backends
    from fagen.runtime import modded, resolve
    backends.GLUON.variant["fwd_tail_first"] = tail
    for memo in (modded._FORWARD_ONLY, modded._MODULES, modded._GLUON_BWD, resolve._FAST):
        memo.clear()
    resolve._module.cache_clear()
'''

WARM = COMMON + r'''
import json, sys, time
sys.path.insert(0, sys.argv[1])
case, tail = sys.argv[2], int(sys.argv[3])
import triton, fagen
COMPILES = []
triton.knobs.compilation.listener = lambda src, metadata, metadata_group, times, cache_hit: COMPILES.append(
    [getattr(src, "name", "?"), bool(cache_hit)])
use(tail)
q, k, v = suite_inputs("cuda")
t = time.perf_counter()
with torch.no_grad():
    fagen.attention(q, k, v, score_mod=case_mod(case, "cuda"))
torch.cuda.synchronize()
print("RESULT " + json.dumps({"case": case, "tail": tail, "s": time.perf_counter() - t, "compiles": COMPILES}))
'''

COLD = COMMON + r'''
import json, resource, sys, time
T = time.perf_counter
sys.path.insert(0, sys.argv[1])
tail, c = int(sys.argv[2]), float(sys.argv[3])
t0 = T()
import triton, fagen
rec = {"tail": tail, "c": c, "imports": T() - t0}
COMPILES = []
triton.knobs.compilation.listener = lambda src, metadata, metadata_group, times, cache_hit: COMPILES.append(
    [getattr(src, "name", "?"), bool(cache_hit), {"ir init": times.ir_initialization / 1e6,
                                                  **{k: v / 1e6 for k, v in times.lowering_stages}}])
use(tail)
t = T()
torch.empty(1, device="cuda")
torch.cuda.synchronize()
rec["cuda init"] = T() - t
q = torch.randn(1, 16, 4096, 128, device="cuda", dtype=torch.bfloat16)
t = T()
fagen.attention(q, q, q)  # the plain call: untimed setup ([Note] Cold rows in fagen/bench/mods.py)
torch.cuda.synchronize()
rec["plain call"] = T() - t
mod = issue_mod(c)


def cpu_now():
    ch = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + ch.ru_utime + ch.ru_stime


n0, c0, t = len(COMPILES), cpu_now(), T()
with torch.no_grad():
    out = fagen.attention(q, q, q, score_mod=mod)
torch.cuda.synchronize()
rec["call"], rec["call cpu"] = T() - t, cpu_now() - c0
rec["compiles"] = COMPILES[n0:]
rec["finite"] = bool(torch.isfinite(out).all())
print("RESULT " + json.dumps(rec))
'''


def spawn(code, argv, env):
    return subprocess.Popen([sys.executable, "-c", code, ROOT, *map(str, argv)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def result(p, what):
    out, err = p.communicate(timeout=300)
    if p.returncode or "RESULT " not in out:
        check(False, f"{what}: child failed: {err.strip()[-600:]}")
        return None
    return json.loads(out.split("RESULT ", 1)[1])


def child_env(name):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=os.path.join(TMP, name, "triton"), FAGEN_CACHE_DIR=os.path.join(TMP, name, "fagen"),
               PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""))
    return env


def merge(src, dst):
    """Copy a child's triton cache entries (hash-named directories) into dst, keeping dst's where both have one."""
    if not os.path.isdir(src):
        return 0
    n = 0
    for entry in os.listdir(src):
        if not os.path.exists(os.path.join(dst, entry)):
            shutil.copytree(os.path.join(src, entry), os.path.join(dst, entry))
            n += 1
    return n


def warm_up():
    procs = [((case, name), spawn(WARM, (case, tail), child_env(f"warm-{case}-{name}")))
             for case in CASES for name, tail in VARIANTS.items()]
    os.makedirs(os.environ["TRITON_CACHE_DIR"], exist_ok=True)
    t = time.time()
    import torch  # noqa: F401 - the main process's imports, while the children build

    import fagen  # noqa: F401
    log(f"main imports {time.time() - t:.1f} s")
    entries = 0
    for (case, name), p in procs:
        r = result(p, f"warm-up {case} {name}")
        if r:
            built = [c[0] for c in r["compiles"] if not c[1]]
            log(f"warm-up {case} {name}: {r['s']:.2f} s, built {built}")
        entries += merge(os.path.join(TMP, f"warm-{case}-{name}", "triton"), os.environ["TRITON_CACHE_DIR"])
    log(f"merged {entries} triton cache entries")


def cold_children():
    stamp = time.time_ns() % 10**6 / 10**6
    jobs = [(tail, 0.5 + stamp + i + 0.25 * tail) for i in range(COLD_PER) for tail in VARIANTS.values()]
    recs = []
    for start in range(0, len(jobs), COLD_PAR):
        batch = jobs[start:start + COLD_PAR]
        procs = [(j, spawn(COLD, j, child_env(f"cold-{j[0]}-{start + i}"))) for i, j in enumerate(batch)]
        for (tail, c), p in procs:
            r = result(p, f"cold tail={tail}")
            if r:
                recs.append(r)
                built = [x for x in r["compiles"] if not x[1]]
                check(r["finite"] and len(built) == 1 and built[0][0] == "_attn_fwd_hopper",
                      f"cold tail={tail}: one compile, _attn_fwd_hopper ({[x[0] for x in built]}), finite output")
    return recs


def cold_table(recs):
    stages = ("ir init", "ttgir", "llir", "ptx", "cubin")
    lines = ["| variant (child) | call s | call CPU s | compile (sum of stages) | " + " | ".join(stages) + " | plain call s |",
             "|---|" + "---:|" * (4 + len(stages))]
    by = {t: [] for t in VARIANTS.values()}
    for r in recs:
        st = next((x[2] for x in r["compiles"] if not x[1]), {})
        by[r["tail"]].append((r["call"], r["call cpu"], sum(st.values())))
        name = [n for n, t in VARIANTS.items() if t == r["tail"]][0]
        lines.append(f"| {name} | {r['call']:.3f} | {r['call cpu']:.3f} | {sum(st.values()):.3f} | "
                     + " | ".join(f"{st.get(s, 0):.3f}" for s in stages) + f" | {r['plain call']:.2f} |")
    if all(by.values()):
        med = {t: [statistics.median(x[i] for x in v) for i in range(3)] for t, v in by.items()}
        lines.append("cold medians prod / tail: call %.3f / %.3f s (%.3f), CPU %.3f / %.3f s (%.3f), compile %.3f / "
                     "%.3f s (%.3f); the issue's target 3 s: tail %s" % (
                         med[0][0], med[1][0], med[1][0] / med[0][0], med[0][1], med[1][1], med[1][1] / med[0][1],
                         med[0][2], med[1][2], med[1][2] / med[0][2], "met" if med[1][0] <= 3.0 else "missed"))
    return "\n".join(lines)


def reference(q, k, v, mod, heads):
    """float64 attention of heads `heads` (batch 0) with the score_mod applied, [len(heads), Sq, 128]."""
    import torch

    outs = []
    sq, sk = q.shape[2], k.shape[2]
    qi = torch.arange(sq, device=q.device)[:, None]
    ki = torch.arange(sk, device=q.device)[None, :]
    for h in heads:
        s = (q[0, h].double() @ k[0, h].double().T) * 128 ** -0.5
        s = mod(s, torch.zeros((), dtype=torch.long, device=q.device), torch.tensor(h, device=q.device), qi, ki)
        outs.append(torch.softmax(s.double(), -1) @ v[0, h].double())
    return torch.stack(outs)


def main_phase():
    import torch

    import fagen
    from fagen.bench.timing import measure
    from fagen.runtime import modded

    ns = {}
    exec(COMMON, ns)
    use, case_mod, suite_inputs = ns["use"], ns["case_mod"], ns["suite_inputs"]
    import triton

    compiles = []
    triton.knobs.compilation.listener = lambda src, metadata, metadata_group, times, cache_hit: compiles.append(
        (getattr(src, "name", "?"), bool(cache_hit)))
    q, k, v = suite_inputs("cuda")
    heads = (0, 15)
    calls, outs = {}, {}
    for case in CASES:
        mod = case_mod(case, "cuda")
        ref = reference(q, k, v, mod, heads)
        errs = {}
        for name, tail in VARIANTS.items():
            use(tail)
            n0 = len(compiles)
            with torch.no_grad():
                out = fagen.attention(q, k, v, score_mod=mod)
                again = fagen.attention(q, k, v, score_mod=mod)
            torch.cuda.synchronize()
            picked = dict(modded._FORWARD_ONLY)  # the module this variant's call picked (none: the plain path)
            calls[case, name] = (picked, mod)
            outs[case, name] = out
            errs[name] = (out[0, list(heads)].double() - ref).abs().max().item()
            check(torch.equal(out, again), f"{case} {name}: two calls bit for bit")
            built = [c[0] for c in compiles[n0:] if not c[1]]
            log(f"{case} {name}: modules {[getattr(m, 'NAME', m.__name__) for m in picked.values()]}, "
                f"compiled here {built}, max |out - float64| {errs[name]:.2e} (heads {heads})")
        tol = max(2e-2, 2 * errs["prod"] + 1e-3)
        check(errs["tail"] <= tol, f"{case}: tail {errs['tail']:.2e} <= {tol:.2e} against float64 (prod "
                                   f"{errs['prod']:.2e})")
        same = torch.equal(outs[case, "prod"], outs[case, "tail"])
        log(f"{case}: tail's output bit for bit prod's: {same}; max |tail - prod| "
            f"{(outs[case, 'tail'].float() - outs[case, 'prod'].float()).abs().max().item():.2e}")
    mod = case_mod("issue", "cuda")
    for batch, sq, sk in ((1, 3000, 4001), (8, 8192, 77)):  # the last key block partial: the tail's prologue
        qq, kk, vv = suite_inputs("cuda", batch, sq, sk, seed=1)
        ref = reference(qq, kk, vv, mod, heads)
        for name, tail in VARIANTS.items():
            use(tail)
            with torch.no_grad():
                out = fagen.attention(qq, kk, vv, score_mod=mod)
            torch.cuda.synchronize()
            err = (out[0, list(heads)].double() - ref).abs().max().item()
            picked = [getattr(m, "NAME", m.__name__) for m in modded._FORWARD_ONLY.values()]
            check(err <= 2e-2 and any("gluon" in p for p in picked),
                  f"issue B{batch} Sq {sq} Sk {sk} {name}: {err:.2e} against float64, module {picked}")
    del qq, kk, vv
    log(f"compiles in the main process: {sum(not c[1] for c in compiles)} built, {sum(c[1] for c in compiles)} "
        f"cache hits")

    flops = 4.0 * 128 * 16 * 8192 * 8192
    times = {key: [] for key in calls}
    device = torch.device("cuda")

    def timed(key):
        picked, mod = calls[key]

        def call(_):
            modded._FORWARD_ONLY.update(picked)  # this variant's module (the memo is keyed by the spec alone)
            return fagen.attention(q, k, v, score_mod=mod)
        return call

    rng = random.Random(19)
    event = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731

    def batches(key):
        """ms a call: the median of BATCHES batches of BATCH calls back to back between two events."""
        call = timed(key)
        for _ in range(3):
            call(0)
        marks = [(event(), event()) for _ in range(BATCHES)]
        for a, b in marks:
            a.record()
            for _ in range(BATCH):
                call(0)
            b.record()
        torch.cuda.synchronize()
        return statistics.median(a.elapsed_time(b) / BATCH for a, b in marks)

    with torch.no_grad():
        for p in range(PASSES):
            cases = list(CASES)
            rng.shuffle(cases)
            for case in cases:
                names = list(VARIANTS)
                rng.shuffle(names)
                for name in names:
                    key = (case, name)
                    if ROUND == "A":
                        times[key].append(measure(timed(key), 1, device, warmup_ms=10, rep_ms=40))
                    else:
                        times[key].append(batches(key))
    print("| case | prod TF/s | tail TF/s | tail / prod per pass: median | q1 | q3 | min | max |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for case in CASES:
        a, b = times[case, "prod"], times[case, "tail"]
        r = sorted(x / y for x, y in zip(a, b))  # speed ratio: prod ms / tail ms
        qs = statistics.quantiles(r, n=4) if len(r) > 1 else [r[0]] * 3
        print(f"| {case} | {flops / statistics.median(a) / 1e9:.0f} | {flops / statistics.median(b) / 1e9:.0f} | "
              f"{statistics.median(r):.4f} | {qs[0]:.4f} | {qs[2]:.4f} | {r[0]:.4f} | {r[-1]:.4f} |")
    how = "do_bench, L2 flushed" if ROUND == "A" else f"median of {BATCHES} batches of {BATCH} calls back to back"
    print(f"({PASSES} shuffled passes, {how}; ratio = prod ms / tail ms, > 1: tail faster; B1 H16 S8192 d128 bf16 "
          "forward, no gradient, through fagen.attention)")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "coldgl_times.json"), "w") as f:
            json.dump({f"{c}|{n}": t for (c, n), t in times.items()}, f)


# ---------------------------------------------------------------- CPU: --dry-run
def dry_run():
    """Every timed kernel (issue, relative-bias, alibi's row-free mod; both variants) built for sm_90 with sizes."""
    ns = {}
    exec(COMMON, ns)
    import torch

    import fagen
    from fagen.runtime import mods, modded
    from fagen.spec.kernel import KernelSpec

    q = torch.zeros(1, 16, 8192, 128, dtype=torch.bfloat16)
    nvdis = os.path.join(os.path.dirname(__import__("triton").__file__), "backends", "nvidia", "bin", "cuobjdump")
    print("| case | variant | build s | PTX lines | SASS instructions | MUFU.EX2 | HGMMA |")
    print("|---|---|---:|---:|---:|---:|---:|")
    sizes = {}
    for case in ("issue", "relative-bias", "alibi"):
        m = mods.prepare(score_mod=ns["case_mod"](case, "cpu"))
        low = modded._lower(m, q, q, q, "none", {}, None, None, None, None)
        fields = m.fields if low is None else low.fields
        spec = modded.modded_spec(KernelSpec(head_dim=128, dtype="bf16", mask="none"), fields, arch="sm_90")
        spec = KernelSpec(head_dim=128, mask=spec.mask, gqa=spec.gqa, dtype=spec.dtype, backend="gluon",
                          score_mod=spec.score_mod, mod_tensors=spec.mod_tensors, mod_scalars=spec.mod_scalars)
        for name, tail in VARIANTS.items():
            ns["use"](tail)
            module = fagen.load(spec)
            t = time.perf_counter()
            ck = module.compile_for(seq_q=8192, seq_k=8192)
            dt = time.perf_counter() - t
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(ck.asm["cubin"])
                f.flush()
                sass = subprocess.run([nvdis, "-sass", f.name], capture_output=True, text=True).stdout
            ins = [x for x in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]+\*/\s+[A-Z@]", x)]
            sizes[case, name] = len(ins)
            print(f"| {case} | {name} | {dt:.2f} | {ck.asm['ptx'].count(chr(10))} | {len(ins)} | "
                  f"{sum('MUFU.EX2' in x for x in ins)} | {sum('HGMMA' in x for x in ins)} |", flush=True)
        check(sizes[case, "tail"] < 0.85 * sizes[case, "prod"], f"{case}: tail's SASS {sizes[case, 'tail']} < 0.85 x "
                                                                f"prod's {sizes[case, 'prod']}")
    ns["use"](0)
    return 1 if FAILS else 0


def main():
    if DRY:
        return dry_run()
    log(f"round {ROUND}; cold children {COLD_PER} a variant, {COLD_PAR} at once; load {os.getloadavg()}, "
        f"{os.cpu_count()} CPUs")
    warm_up()
    log(f"cold children (load {os.getloadavg()[0]:.1f})")
    recs = cold_children()
    print(cold_table(recs), flush=True)
    log("main phase")
    main_phase()
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "coldgl_cold.json"), "w") as f:
            json.dump(recs, f)
    log(f"done; {len(FAILS)} FAIL")
    shutil.rmtree(TMP, ignore_errors=True)
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
