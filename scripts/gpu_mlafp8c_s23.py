"""MLA's fp8 latent cache at the compute-bound shape, twenty-third session (issue 27; docs/serving.md "MLA fp8 latent
decode at 64-row programs (twenty-third session)"): the seesaw decode over an e4m3 cache (variant fp8lat_seesaw,
[Note] Seesaw fp8 conversion in fagen/templates/gluon/mla_seesaw.j2) against the product's Triton decode on the
serving suite's row decode-mla-absorbed-h128-sq2-kv8k-b32-fp8, and against the bf16 seesaw's row.

    PYTHONPATH=$PWD python3 scripts/gpu_mlafp8c_s23.py [--round A|B] [--dry-run]

--dry-run (the CPU): the fp8 seesaw built for sm_90 (ptxas registers, spills, shared memory) in the forms the checks
and the timing run, and the split counts of the timed shapes.
Phases, each a child process with a timeout (scripts/_phases.py), one kernel build a child (the GPU host's builds
take 5-15 s: round A's children of two and three builds ran out of time; each case prints when its call returned,
the build done, and when the GPU finished, so a hang and a slow build read apart):
1. in parallel: the checks (GROUPS) and the warm children (WARM, one implementation each: its build, in its own
   caches, which the time child then reads merged); the time child starts when the warm children are done (the
   checks' children are then building on the CPU: their GPU work is a few ms).
   Checks: the gluon fp8 module with the variant on against float64 on the dequantized cache: dense and paged (page
   64, pages in a random order, NaN bytes and NaN per-token scales past each length), per tensor (a float), per KV
   head (a float32 [1]) and per token, Sq 1 and 2, Hq 64 and 128, causal and none, lengths not a multiple of 64
   (and 0), the split rule, forced splits, one split (direct), batch_invariant=True (each sequence alone: the same
   bits), [Note] Converter order's ORDER 1. Each case also asserts that the seesaw ran (its launcher counted) and
   that the check can fail: the cache read without its scales and the cache's bytes read as e5m2 must each miss the
   tolerance (a kernel reading the bytes some other way would not pass).
2. time: the suite's fp8 row through the suite's row function (fagen.bench.impls.prepare_fagen, BenchCase.spec:
   hopper.latent_decode_spec picks the module), the variant off (the product: the Triton decode) and on (the
   seesaw, also with ORDER 1), and the bf16 row (the bf16 seesaw), the bench's measure (timing.time_prepared),
   PASSES shuffled passes; per pass the ratios of the times (> 1: the candidate is faster). Only what its warm child
   built is timed.
Exit status 1 if a check fails or a phase dies.
"""

from __future__ import annotations

import dataclasses
import os
import random
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/, for _phases
from _phases import child_env, run_phase as run_child  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = "GPU_MLAFP8C_S23_"
ROUND = os.environ.get(ENV + "ROUND", "A")
if "--round" in sys.argv[:-1]:
    ROUND = os.environ[ENV + "ROUND"] = sys.argv[sys.argv.index("--round") + 1]
PHASES = {"checks": 46, "warm": 28, "time": 18}  # all in parallel but time, which follows the warm children
PASSES = 5 if ROUND == "A" else 7
D, DV, PAGE, SCALE = 576, 512, 64, 576 ** -0.5
ROW8, ROW16 = "decode-mla-absorbed-h128-sq2-kv8k-b32-fp8", "decode-mla-absorbed-h128-sq2-kv8k-b32"
LINES: list[str] = []
DEV = os.environ.get(ENV + "DEV", "cuda")  # "cpu": a CPU test of the checks' inputs and references
FAILED = threading.Event()


def emit(section, case, impl, value, note=""):
    line = f"{section:5} | {case:34} | {impl:22} | {value:>8} | {note}"
    print(line, flush=True)
    LINES.append(line)


def seesaw_on():
    from fagen import backends
    backends.GLUON.variant = {**backends.GLUON.variant, "fp8lat_seesaw": 1}


def module(layout, mask, hq):
    import fagen
    return fagen.load(fagen.KernelSpec(head_dim=D, head_dim_v=DV, shared_kv=True, kind="decode", gqa=hq,
                                       dtype="bf16", mask=mask, layout=layout, backend="gluon", kv_dtype="fp8_e4m3"))


class Counted:
    """A launcher wrapper counting the launches of the seesaw kernel (the module's _fast_mla_decode_ss8)."""

    def __init__(self, fn):
        self.fn, self.n = fn, 0

    def __getitem__(self, grid):
        self.n += 1
        return self.fn[grid]


def inputs(form, layout, b, hq, sq, lens, seed):
    """q, cache, table, lens, k_scale: dense [b, 1, max(lens), D] or paged (pages of 64 in a random order, NaN bytes
    0x7f and NaN per-token scales past each length)."""
    import torch
    gen = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(b, hq, sq, D, device=DEV, generator=gen).bfloat16()
    n_max = max(lens)
    if layout == "dense":
        cache = torch.randn(b, 1, n_max, D, device=DEV, generator=gen).to(torch.float8_e4m3fn)
        table = tl = None
    else:
        per = -(-max(n_max, 1) // PAGE)
        cache = torch.randn(b * per, PAGE, 1, D, device=DEV, generator=gen).to(torch.float8_e4m3fn)
        table = torch.randperm(b * per, device=DEV, generator=gen).to(torch.int32).view(b, per)
        tl = torch.tensor(lens, dtype=torch.int32, device=DEV)
    ks = {"token": lambda: torch.exp2(torch.rand(cache.shape[:-1], device=DEV, generator=gen) * 6 - 3),
          "tensor": lambda: 0.7, "head": lambda: torch.tensor([1.3], device=DEV)}[form]()
    if layout == "paged":
        for i, n in enumerate(lens):
            for p in range(table.shape[1]):
                if n - p * PAGE < PAGE:
                    pg, lo = int(table[i, p]), max(0, n - p * PAGE)
                    cache.view(torch.uint8)[pg, lo:] = 0x7F
                    if form == "token":
                        ks[pg, lo:] = float("nan")
    return q, cache, table, tl, ks


def run(m, q, cache, table, lens, ks, how, layout):
    call = dict(scale=SCALE, k_scale=ks)
    if layout == "paged":
        call.update(block_table=table, seqlens_k=lens)
    if how == "rule":
        return m.forward(q, cache, None, **call)
    if how == "inv":
        return m.forward(q, cache, None, batch_invariant=True, **call)
    return m.forward_split(q, cache, None, num_splits=int(how[1:]), **call)


def worst(out, lse, q, keys_all, table, lens, layout, mask):
    """max error of out (in units of the output's terms) against float64 on keys_all; raises PropertyFailure past
    bf16's tolerance (out) or LSE_TOLERANCE (lse)."""
    import torch
    from fagen.verify import reference
    from fagen.verify.tolerances import LSE_TOLERANCE, TOLERANCE, compare
    err = 0.0
    for i in range(q.shape[0]):
        if layout == "dense":
            keys, n = keys_all[i:i + 1], keys_all.shape[2]
        else:
            n = int(lens[i])
            keys = keys_all[table[i].long()].reshape(-1, 1, D)[:n].transpose(0, 1)[None]
        if n == 0:
            assert (out[i] == 0).all() and (lse[i] == float("-inf")).all(), "an empty sequence: out 0, lse -inf"
            continue
        qi = q[i:i + 1].double()
        want, wlse = reference.attention(qi, keys, None, head_dim_v=DV, mask=mask, scale=SCALE)
        terms, _ = reference.attention(qi, keys, keys[..., :DV].abs(), mask=mask, scale=SCALE)
        unit = terms.clamp(min=1.0)
        err = max(err, compare(f"out {i}", out[i:i + 1].double() / unit, want / unit, **TOLERANCE["bf16"]))
        compare(f"lse {i}", lse[i:i + 1].double(), wlse, **LSE_TOLERANCE)
    return err


def misses(out, lse, q, keys_all, table, lens, layout, mask):
    """Where the check against a wrong reading of the cache fails: its first failure (a sentence), or ''."""
    from fagen.verify.tolerances import PropertyFailure
    try:
        worst(out, lse, q, keys_all, table, lens, layout, mask)
    except (PropertyFailure, AssertionError) as e:
        return str(e).split(":")[0] or "fails"
    return ""


GROUPS = {  # (scale form, layout, mask, Hq, Sq, lengths, how): a child a kernel build (the GPU host's builds take
    # 5-15 s each: round A's children of two or three builds ran out of time)
    "check-dense-tensor": [("tensor", "dense", "causal", 128, 2, [1201] * 3, "rule")],
    "check-dense-head-direct": [("head", "dense", "causal", 128, 2, [777] * 2, "s1")],
    "check-dense-head-sq1": [("head", "dense", "causal", 128, 1, [1201] * 2, "s3")],
    "check-paged-token": [("token", "paged", "causal", 128, 2, [77, 1201, 0, 640], "rule")],
    "check-paged-head-inv": [("head", "paged", "causal", 128, 2, [77, 1201, 640], "inv")],
    "check-h64-tensor": [("tensor", "paged", "none", 64, 1, [1201, 65, 4096], "rule")],
    "check-h64-token": [("token", "paged", "none", 64, 1, [1201, 65, 4096], "s3")],
    "check-order1": [("head", "dense", "causal", 128, 2, [777] * 2, "s1 order1")],
}
IMPLS = ("triton fp8 (product)", "gluon fp8 seesaw", "gluon fp8 seesaw order1", "gluon bf16 seesaw")
WARM = {f"warm-{k}": impl for k, impl in zip(("triton", "seesaw", "order1", "bf16"), IMPLS)}


def check_phase(name):
    import torch
    from fagen.verify import reference
    seesaw_on()
    for form, layout, mask, hq, sq, lens, how in GROUPS[name]:
        case = f"{layout} {mask} h{hq} sq{sq} {form} {how} n{max(lens)}"
        how, _, order = how.partition(" order")
        t = time.time()
        try:
            m = module(layout, mask, hq)
            m.SEESAW_ORDER = int(order or 0)  # [Note] Converter order
            counted = m._fast_mla_decode_ss8 = Counted(m._fast_mla_decode_ss8)
            q, cache, table, tl, ks = inputs(form, layout, len(lens), hq, sq, lens, 3)
            out, lse = run(m, q, cache, table, tl, ks, how, layout)
            print(f"  {case}: launched at {time.time() - t:.1f} s (built)", flush=True)
            torch.cuda.synchronize()
            print(f"  {case}: done at {time.time() - t:.1f} s", flush=True)
            assert counted.n == 1, f"the seesaw ran {counted.n} times"
            axis = 1 if layout == "dense" else 2
            err = worst(out, lse, q, reference.dequantize(cache, ks, head_dim_axis=axis), table, tl, layout, mask)
            # the check can fail: the cache without its scales, the bytes as e5m2
            bad1 = misses(out, lse, q, reference.dequantize(cache, None, head_dim_axis=axis), table, tl, layout, mask)
            bad2 = misses(out, lse, q, reference.dequantize(cache.view(torch.float8_e5m2), ks, head_dim_axis=axis),
                          table, tl, layout, mask)
            if not (bad1 and bad2):
                raise AssertionError(f"a wrong reading passes: no scales '{bad1}', e5m2 '{bad2}'")
            note = ""
            if how == "inv":  # each sequence alone: the same bits
                same = True
                for i in range(q.shape[0]):
                    o1, l1 = m.forward(q[i:i + 1], cache, None, block_table=table[i:i + 1], seqlens_k=tl[i:i + 1],
                                       scale=SCALE, k_scale=ks, batch_invariant=True)
                    same &= torch.equal(o1, out[i:i + 1]) and torch.equal(l1, lse[i:i + 1])
                note = f"; alone bitwise: {'yes' if same else 'NO'}"
                if not same:
                    raise AssertionError("batch_invariant: not the same bits")
            emit("check", case, "gluon fp8 seesaw", "ok", f"err {err:.1e}; wrong reads fail at {bad1} / {bad2}"
                 f"{note}; {time.time() - t:.1f} s")
        except Exception as e:  # noqa: BLE001 - a failure is a row
            import traceback
            traceback.print_exc(file=sys.stdout)
            emit("check", case, "gluon fp8 seesaw", "FAIL", f"ERROR {type(e).__name__}: "
                 f"{(str(e).splitlines() or [''])[0][:150]}")


def q3(xs):
    s = sorted(xs)
    if len(s) < 3:
        return f"{statistics.median(s):.3f}"
    qs = statistics.quantiles(s, n=4)
    return f"{statistics.median(s):.3f} [{qs[0]:.3f}-{qs[2]:.3f}]"


class Ordered:
    """A prepared call run with the module's SEESAW_ORDER set to `order` ([Note] Converter order)."""

    def __init__(self, prepared, mod, order):
        self.p, self.mod, self.order = prepared, mod, order
        self.note, self.spec = prepared.note, prepared.spec

    def fn(self, s):
        keep, self.mod.SEESAW_ORDER = self.mod.SEESAW_ORDER, self.order
        try:
            return self.p.fn(s)
        finally:
            self.mod.SEESAW_ORDER = keep


def time_phase(passes, only=IMPLS):
    import torch

    from fagen import backends
    from fagen.bench import cases, impls, timing
    from fagen.bench.cases import BenchOptions, CaseContext
    from fagen.bench.inputs import set_bytes
    from fagen.bench.serving import serving_rows
    from fagen.bench.workloads import flops

    cases.SET_BUDGET = 8 << 30
    dev = torch.device("cuda")
    opts = BenchOptions(device=DEV, warmup_ms=3.0, rep_ms=25.0)
    rng = random.Random(23 if ROUND == "A" else 2323)
    rows = {c.name: c for c in serving_rows()}
    keep = backends.GLUON.variant
    ent, ctx = {}, {}
    for impl, row, seesaw in (("triton fp8 (product)", ROW8, 0), ("gluon fp8 seesaw", ROW8, 1),
                              ("gluon bf16 seesaw", ROW16, 0)):
        want = [x for x in only if x == impl or (seesaw and x == "gluon fp8 seesaw order1")]
        if not want:
            continue
        case = rows[row]
        if row not in ctx:
            ctx[row] = CaseContext(case, dev, max(3, 1 + -(-timing._FLUSH_BYTES // set_bytes(case))) if passes else 1)
        backends.GLUON.variant = {**keep, "fp8lat_seesaw": seesaw}
        try:
            spec, note = case.spec(dev)
            if (spec.backend.value == "gluon") != (impl != "triton fp8 (product)"):
                raise AssertionError(f"{impl}: the row's spec is {spec.name} ({note})")
            ent[impl] = (impls.prepare_fagen(case, ctx[row]), row, spec.name)
        finally:
            backends.GLUON.variant = keep
        if passes:
            emit("time", row, impl, "spec", f"{spec.name}; {note}")
        if seesaw and "gluon fp8 seesaw order1" in want:
            from fagen.runtime import loader
            backends.GLUON.variant = {**keep, "fp8lat_seesaw": 1}
            try:
                mod = loader.load(spec)
            finally:
                backends.GLUON.variant = keep
            assert mod.SEESAW_ORDER == 0
            ent["gluon fp8 seesaw order1"] = (dataclasses.replace(ent[impl][0], fn=Ordered(ent[impl][0], mod, 1).fn),
                                              row, spec.name)
        if impl not in only:
            del ent[impl]
    got = {}
    with torch.no_grad():
        for impl, (p, row, _) in ent.items():  # one call each first (the builds; warm's: from the cache)
            t = time.time()
            p.fn(ctx[row].sets[0])
            print(f"  {impl}: launched at {time.time() - t:.1f} s (built)", flush=True)
            torch.cuda.synchronize()
            emit("time", row, impl, "built", f"{time.time() - t:.1f} s a first call")
        for _ in range(passes):
            order = list(ent)
            rng.shuffle(order)
            for impl in order:
                p, row, _ = ent[impl]
                got.setdefault(impl, []).append(timing.time_prepared(p, ctx[row], opts)["ms"])
    if not passes:
        return
    for impl, (p, row, _) in ent.items():
        ms = statistics.median(got[impl])
        emit("time", row, impl, f"{flops(rows[row]) / ms / 1e9:.0f}", f"TF/s; {ms:.4f} ms; passes "
             f"{[round(x, 4) for x in got[impl]]}")
    for cand, base in (("gluon fp8 seesaw", "triton fp8 (product)"), ("gluon fp8 seesaw", "gluon bf16 seesaw"),
                       ("gluon fp8 seesaw order1", "gluon fp8 seesaw"), ("gluon fp8 seesaw order1",
                                                                          "triton fp8 (product)")):
        if cand not in got or base not in got:
            continue
        r = [b / x for b, x in zip(got[base], got[cand])]
        emit("ratio", ROW8, f"{cand.replace('gluon fp8 ', '')} / {base.split(' (')[0]}", q3(r),
             f"per pass (time ratio, > 1 faster) {[round(x, 3) for x in r]}")


def dry_run():
    """The fp8 seesaw built for sm_90 on the CPU, and the split counts of the timed shapes."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from sm90 import ptxas
    seesaw_on()
    bad = 0
    for layout, mask, hq, sq, scales, splits, order in (
            ("dense", "causal", 128, 2, 1, 1, 0), ("dense", "causal", 128, 2, 1, 1, 1),
            ("paged", "causal", 128, 2, 2, 3, 0), ("paged", "none", 64, 1, 0, 3, 0)):
        m = module(layout, mask, hq)
        m.SEESAW_ORDER = order
        t = time.time()
        ck = m.compile_for(seq_q=sq, seesaw=True, scales=scales, num_splits=splits)
        res, log, _ = ptxas(ck.asm["ptx"])
        r = next(iter(res.values()))
        spills = r.spill_stores + r.spill_loads
        ok = ck.metadata.shared <= 232448 and (spills == 0 or scales == 2)
        bad += not ok
        emit("build", f"{layout} {mask} h{hq} sq{sq} scales{scales} sp{splits}", f"gluon fp8 seesaw order{order}",
             "ok" if ok else "BAD", f"shared {ck.metadata.shared} B, spills {spills} B, {time.time() - t:.1f} s")
    m = module("dense", "causal", 128)
    for b, hq, sq, sk in ((32, 128, 2, 8192), (3, 128, 2, 1201), (2, 64, 1, 4096)):
        emit("split", f"b{b} h{hq} sq{sq} kv{sk}", "gluon fp8 seesaw", str(m.seesaw_splits(b, hq * sq, sk)[1]),
             f"per {m.seesaw_splits(b, hq * sq, sk)[0]} blocks (132 SMs)")
    return bad


def main():
    if "--phase" in sys.argv:
        name = sys.argv[sys.argv.index("--phase") + 1]
        if name == "time":
            time_phase(PASSES, tuple(os.environ[ENV + "TIMED"].split("|")))
        elif name in WARM:
            time_phase(0, (WARM[name], ))
        else:
            check_phase(name)
        return 0
    if "--dry-run" in sys.argv:
        return 1 if dry_run() else 0
    t0 = time.time()
    print(f"gpu_mlafp8c_s23 round {ROUND}: section | case | impl | value | note", flush=True)
    rcs = {}

    def env_of(name):
        env = child_env(f"/tmp/fagen-cache-mlafp8c-{name}", ROOT)
        env["TRITON_CACHE_DIR"] = f"/tmp/triton-cache-mlafp8c-{name}"
        return env

    def one(name, limit, env):
        rcs[name], lines = run_child(__file__, name, limit, env)
        if any(" FAIL " in x or "| FAIL" in x for x in lines):
            FAILED.set()

    checks = [threading.Thread(target=one, args=(n, PHASES["checks"], env_of(n))) for n in GROUPS]
    warm = [threading.Thread(target=one, args=(n, PHASES["warm"], env_of(n))) for n in WARM]
    for th in (*checks, *warm):
        th.start()
    for th in warm:  # the time child starts once the warm children are done: the checks' children build on the CPU
        th.join()  # meanwhile, their GPU work is a few ms
    import shutil
    env = env_of("time")  # the warm children's builds, one cache (their keys differ)
    for name in WARM:
        for var in ("TRITON_CACHE_DIR", "FAGEN_CACHE_DIR"):
            if os.path.isdir(env_of(name)[var]):
                shutil.copytree(env_of(name)[var], env[var], dirs_exist_ok=True)
    timed = [impl for name, impl in WARM.items() if rcs.get(name) == 0]
    print(f"  time: {len(timed)} built by warm children ({time.time() - t0:.1f} s)", flush=True)
    env[ENV + "TIMED"] = "|".join(timed)
    if timed:
        one("time", PHASES["time"], env)
    for th in checks:
        th.join()
    for name, rc in rcs.items():
        if rc != 0:
            print(f"phase {name}: {rc}", flush=True)
            FAILED.set()
    print(f"total {time.time() - t0:.1f} s; {'FAILED' if FAILED.is_set() else 'all checks passed'}", flush=True)
    return 1 if FAILED.is_set() else 0


if __name__ == "__main__":
    sys.exit(main())
