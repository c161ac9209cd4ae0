"""MLA's fp8 latent cache at the compute-bound shape, twenty-fourth session (issue 27; docs/serving.md "MLA fp8 seesaw:
the conversion's place (twenty-fourth session)"): where the fp8 seesaw's 0.63x of the bf16 seesaw goes, and the
converter's switches ([Note] Seesaw bit conversion, [Note] Seesaw split half, [Note] Converter order in
fagen/templates/gluon/mla_seesaw.j2; the module constants SEESAW_CVT, SEESAW_SPLIT, SEESAW_ORDER) against the product
(the fp8 seesaw as it stands) on the serving suite's row decode-mla-absorbed-h128-sq2-kv8k-b32-fp8, and the bf16
seesaw's row.

After round C (the lead's run of round B at 06340bd5) SEESAW_CVT 2, the f16 operands, became the product's default
and the switches that lost (SEESAW_CVT 1 and 9, SEESAW_SPLIT, SEESAW_ORDER 2/3, SEESAW_LOADER) left the template:
this script stays as the rounds' record. Its "product" configuration is now the product's default, f16 (SEESAW_CVT
2, ORDER 1; in rounds A and B it was the bf16 conversion, now "cvt0"); a configuration that uses a removed switch
is skipped in the timing and the dry run with a printed note, and a check written for one runs with the product.

    PYTHONPATH=$PWD python3 scripts/gpu_seesaw8_s24.py [--round A|B] [--dry-run]

--dry-run (the CPU): every configuration built for sm_90 (ptxas registers, spills, shared memory) in the forms the
checks and the timing run.
Phases, each a child process with a timeout (scripts/_phases.py), one kernel build a child:
1. in parallel: the checks (GROUPS, each a configuration) and the warm children (WARM, one configuration each: its
   build, in its own caches, which the time child then reads merged); the time child starts when the warm children
   are done. Checks (gpu_mlafp8c_s23.py's): the gluon fp8 module against float64 on the dequantized cache, dense and
   paged (NaN bytes and NaN per-token scales past each length), per tensor / per KV head / per token, Sq 1 and 2,
   Hq 64 and 128, lengths not a multiple of 64, the split rule, forced splits, one split, batch_invariant=True (each
   sequence alone: the same bits); plus a cache of e4m3 subnormals and zeros only (scale 512): a conversion that
   flushes them fails. Each case asserts that the seesaw ran and that the cache read without its scales and read as
   e5m2 each miss the tolerance. The diagnostic build (SEESAW_CVT 9: no conversion, the bytes read wrong) is
   timed only.
2. time: the suite's fp8 row through the suite's row function (fagen.bench.impls.prepare_fagen) with each
   configuration set on the module for its calls, and the bf16 row (the bf16 seesaw), the bench's measure
   (timing.time_prepared), PASSES shuffled passes; per pass the ratios of the times against the product (> 1: the
   candidate is faster).
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
ENV = "GPU_SEESAW8_S24_"
ROUND = os.environ.get(ENV + "ROUND", "A")
if "--round" in sys.argv[:-1]:
    ROUND = os.environ[ENV + "ROUND"] = sys.argv[sys.argv.index("--round") + 1]
PHASES = {"checks": 44, "warm": 24, "time": 24}  # all in parallel but time, which follows the warm children
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
    if form == "sub":  # e4m3 subnormals and zeros only (bytes 0x00-0x07, 0x80-0x87): a flushing conversion fails
        byte = torch.randint(0, 8, cache.shape, device=DEV, generator=gen, dtype=torch.int32)
        sign = torch.randint(0, 2, cache.shape, device=DEV, generator=gen, dtype=torch.int32) * 0x80
        cache = (byte | sign).to(torch.uint8).view(torch.float8_e4m3fn)
    if form == "bigq":  # |q| past f16's range: [Note] Seesaw f16 operands' power-of-two scale of Q
        q = (q.float() * 2.0 ** 20).bfloat16()
    ks = {"token": lambda: torch.exp2(torch.rand(cache.shape[:-1], device=DEV, generator=gen) * 6 - 3),
          "tensor": lambda: 0.7, "head": lambda: torch.tensor([1.3], device=DEV), "sub": lambda: 512.0,
          "bigq": lambda: 2.0 ** -20}[form]()
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


# configurations: the module constants (SEESAW_CVT, SEESAW_SPLIT, SEESAW_ORDER, SEESAW_LOADER); the product's first
# (since the flip f16: rounds A and B ran "product" as (0, 0, 1, 0), now "cvt0")
KEYS = ("SEESAW_CVT", "SEESAW_SPLIT", "SEESAW_ORDER", "SEESAW_LOADER")
LIVE = {"SEESAW_CVT": (0, 2), "SEESAW_ORDER": (0, 1)}  # the values the product's template still has (after round C)
CONFIGS = {"product": (2, 0, 1, 0), "cvt0": (0, 0, 1, 0), "diag-nocvt": (9, 0, 1, 0), "bit": (1, 0, 1, 0),
           "split": (0, 1, 1, 0),
           "split2": (0, 2, 1, 0), "order2": (0, 0, 2, 0), "order3": (0, 0, 3, 0), "loader": (0, 0, 1, 1),
           "split2+order3": (0, 2, 3, 0), "loader+split2": (0, 2, 1, 1), "bit+split2+order3": (1, 2, 3, 0),
           # round B: [Note] Seesaw f16 operands
           "f16": (2, 0, 1, 0), "f16+split": (2, 1, 1, 0), "f16+split2": (2, 2, 1, 0), "f16+order2": (2, 0, 2, 0),
           "f16+order3": (2, 0, 3, 0), "f16+order0": (2, 0, 0, 0)}
GROUPS_A = {  # (scale form, layout, mask, Hq, Sq, lengths, how, configuration): a child a kernel build
    "check-dense-tensor": [("tensor", "dense", "causal", 128, 2, [1201] * 3, "rule", "split2+order3")],
    "check-dense-head-direct": [("head", "dense", "causal", 128, 2, [777] * 2, "s1", "bit")],
    "check-dense-head-sq1": [("head", "dense", "causal", 128, 1, [1201] * 2, "s3", "order2")],
    "check-paged-token": [("token", "paged", "causal", 128, 2, [77, 1201, 0, 640], "rule", "loader")],
    "check-paged-head-inv": [("head", "paged", "causal", 128, 2, [77, 1201, 640], "inv", "split")],
    "check-h64-tensor": [("tensor", "paged", "none", 64, 1, [1201, 65, 4096], "rule", "loader+split2")],
    "check-h64-token": [("token", "paged", "none", 64, 1, [1201, 65, 4096], "s3", "bit+split2+order3")],
    "check-sub-bit": [("sub", "dense", "causal", 128, 2, [777] * 2, "s1", "bit")],
}
GROUPS_B = {  # round B: the f16 operands in every form the flip would serve
    "check-dense-tensor": [("tensor", "dense", "causal", 128, 2, [1201] * 3, "rule", "f16")],
    "check-dense-head-direct": [("head", "dense", "causal", 128, 2, [777] * 2, "s1", "f16+split2")],
    "check-dense-head-sq1": [("head", "dense", "causal", 128, 1, [1201] * 2, "s3", "f16")],
    "check-paged-token": [("token", "paged", "causal", 128, 2, [77, 1201, 0, 640], "rule", "f16")],
    "check-paged-head-inv": [("head", "paged", "causal", 128, 2, [77, 1201, 640], "inv", "f16")],
    "check-h64-tensor": [("tensor", "paged", "none", 64, 1, [1201, 65, 4096], "rule", "f16+order3")],
    "check-h64-token": [("token", "paged", "none", 64, 1, [1201, 65, 4096], "s3", "f16")],
    "check-sub": [("sub", "dense", "causal", 128, 2, [777] * 2, "s1", "f16")],
    "check-bigq": [("bigq", "dense", "causal", 128, 2, [777] * 2, "rule", "f16")],
}
GROUPS = GROUPS_A if ROUND == "A" else GROUPS_B


def removed(config):
    """True for a configuration that sets a switch the product's template no longer has (after round C)."""
    return any(v not in LIVE[k] if k in LIVE else v != 0 for k, v in zip(KEYS, CONFIGS[config]))


def live(configs, what):
    """configs without the removed ones, a note printed for each of those."""
    for c in configs:
        if removed(c):
            print(f"  {what} {c}: skipped (its switch left the template after round C)", flush=True)
    return tuple(c for c in configs if not removed(c))


TIMED = ("product", "diag-nocvt", "bit", "split", "split2", "order2", "order3", "loader") if ROUND == "A" else \
    ("product", "cvt0", "diag-nocvt", "f16", "f16+split2", "f16+order3")  # cvt0: rounds A and B's product
TIMED = live(TIMED, "time")
IMPLS = tuple(f"fp8 {c}" for c in TIMED) + ("bf16 seesaw", )
if ROUND != "A":  # a shape that is not a suite row: Hq 64 Sq 1 (one 64-row program a sequence), b64
    IMPLS += ("x fp8 product", "x fp8 cvt0")
ROWX = "decode-mla-absorbed-h64-sq1-kv8k-b64-fp8"


def row_of(impl):
    return ROW16 if impl == "bf16 seesaw" else ROWX if impl.startswith("x ") else ROW8
WARM = {f"warm-{impl.replace(' ', '-').replace('+', '_')}": impl for impl in IMPLS}


def configure(m, config):
    assert not removed(config), config
    for key, value in zip(KEYS, CONFIGS[config]):
        if key in LIVE:
            setattr(m, key, value)


def config_of(m):
    return tuple(getattr(m, key, 0) for key in KEYS)  # a removed switch reads 0


def check_phase(name):
    import torch
    from fagen.verify import reference
    seesaw_on()
    for form, layout, mask, hq, sq, lens, how, config in GROUPS[name]:
        case = f"{layout} {mask} h{hq} sq{sq} {form} {how} n{max(lens)}"
        t = time.time()
        if removed(config):
            print(f"  check {case} {config}: its switch left the template after round C: checked with the product",
                  flush=True)
            config = "product"
        try:
            m = module(layout, mask, hq)
            assert config_of(m) == CONFIGS["product"], "the product's defaults"
            configure(m, config)
            counted = m._fast_mla_decode_ss8 = Counted(m._fast_mla_decode_ss8)
            q, cache, table, tl, ks = inputs(form, layout, len(lens), hq, sq, lens, 3)
            out, lse = run(m, q, cache, table, tl, ks, how, layout)
            print(f"  {case}: launched at {time.time() - t:.1f} s (built)", flush=True)
            torch.cuda.synchronize()
            print(f"  {case}: done at {time.time() - t:.1f} s", flush=True)
            assert counted.n == 1, f"the seesaw ran {counted.n} times"
            axis = 1 if layout == "dense" else 2
            out_c, q_c, ks_c, ks_bad = out, q, ks, None
            if form == "bigq":  # out 2^-20 of the terms' size: compared as out 2^20 against q 2^-20 and the cache
                # read with scale 1 (the same scores, exact powers of two); the wrong reading: the scale doubled
                out_c, q_c, ks_c, ks_bad = out.double() * 2.0 ** 20, q.double() * 2.0 ** -20, 1.0, 2.0
            err = worst(out_c, lse, q_c, reference.dequantize(cache, ks_c, head_dim_axis=axis), table, tl, layout,
                        mask)
            # the check can fail: the cache without its scales, the bytes as e5m2
            bad1 = misses(out_c, lse, q_c, reference.dequantize(cache, ks_bad, head_dim_axis=axis), table, tl, layout,
                          mask)
            bad2 = misses(out_c, lse, q_c, reference.dequantize(cache.view(torch.float8_e5m2), ks_c,
                                                                head_dim_axis=axis), table, tl, layout, mask)
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
            emit("check", case, config, "ok", f"err {err:.1e}; wrong reads fail at {bad1} / {bad2}"
                 f"{note}; {time.time() - t:.1f} s")
        except Exception as e:  # noqa: BLE001 - a failure is a row
            import traceback
            traceback.print_exc(file=sys.stdout)
            emit("check", case, config, "FAIL", f"ERROR {type(e).__name__}: "
                 f"{(str(e).splitlines() or [''])[0][:150]}")


def q3(xs):
    s = sorted(xs)
    if len(s) < 3:
        return f"{statistics.median(s):.3f}"
    qs = statistics.quantiles(s, n=4)
    return f"{statistics.median(s):.3f} [{qs[0]:.3f}-{qs[2]:.3f}]"


class Configured:
    """A prepared call run with the module's switches set to a configuration (CONFIGS)."""

    def __init__(self, prepared, mod, config):
        self.p, self.mod, self.config = prepared, mod, config

    def fn(self, s):
        keep = config_of(self.mod)
        configure(self.mod, self.config)
        try:
            return self.p.fn(s)
        finally:
            for key, value in zip(KEYS, keep):
                if key in LIVE:
                    setattr(self.mod, key, value)


def time_phase(passes, only=IMPLS):
    import torch

    from fagen.bench import cases, impls, timing
    from fagen.bench.cases import BenchOptions, CaseContext
    from fagen.bench.inputs import set_bytes
    from fagen.bench.serving import serving_rows
    from fagen.bench.workloads import flops
    from fagen.runtime import loader

    cases.SET_BUDGET = 8 << 30
    dev = torch.device("cuda")
    opts = BenchOptions(device=DEV, warmup_ms=3.0, rep_ms=25.0)
    rng = random.Random(24 if ROUND == "A" else 2424)
    rows = {c.name: c for c in serving_rows()}
    rows[ROWX] = dataclasses.replace(rows[ROW8], name=ROWX, heads_q=64, seq_q=1, batch=64)  # dense: the bench's
    # paged inputs have no shared-KV form (round B's paged 64 failed in fagen/bench/inputs.py's to_pages)
    ent, ctx = {}, {}
    counted = {}
    for row in (ROW8, ROW16, ROWX):
        want = [x for x in only if row_of(x) == row]
        if not want:
            continue
        case = rows[row]
        ctx[row] = CaseContext(case, dev, max(3, 1 + -(-timing._FLUSH_BYTES // set_bytes(case))) if passes else 1)
        spec, note = case.spec(dev)
        if spec.backend.value != "gluon":
            raise AssertionError(f"{row}: the row's spec is {spec.name} ({note})")
        p = impls.prepare_fagen(case, ctx[row])
        if passes:
            emit("time", row, "spec", "", f"{spec.name}; {note}")
        if row == ROW16:
            ent["bf16 seesaw"] = (p, row)
            continue
        mod = loader.load(spec)
        assert config_of(mod) == CONFIGS["product"], "the product's defaults"
        counted[row] = mod._fast_mla_decode_ss8 = Counted(mod._fast_mla_decode_ss8)  # the timed calls: the seesaw
        for impl in want:
            config = impl.split("fp8 ")[1]
            ent[impl] = (dataclasses.replace(p, fn=Configured(p, mod, config).fn), row)
    got = {}
    with torch.no_grad():
        for impl, (p, row) in ent.items():  # one call each first (the builds; warm's: from the cache)
            t = time.time()
            p.fn(ctx[row].sets[0])
            print(f"  {impl}: launched at {time.time() - t:.1f} s (built)", flush=True)
            torch.cuda.synchronize()
            if passes:
                emit("time", row, impl, "built", f"{time.time() - t:.1f} s a first call")
        for row, c in counted.items():
            assert c.n == len([x for x in ent if row_of(x) == row]), f"{row}: the seesaw ran {c.n} times"
        for _ in range(passes):
            order = list(ent)
            rng.shuffle(order)
            for impl in order:
                p, row = ent[impl]
                got.setdefault(impl, []).append(timing.time_prepared(p, ctx[row], opts)["ms"])
    if not passes:
        return
    for impl, (p, row) in ent.items():
        ms = statistics.median(got[impl])
        emit("time", row, impl, f"{flops(rows[row]) / ms / 1e9:.0f}", f"TF/s; {ms:.4f} ms; passes "
             f"{[round(x, 4) for x in got[impl]]}")
    for cand in got:
        base = "x fp8 product" if cand.startswith("x ") else "fp8 product"
        if cand == base or base not in got:
            continue
        r = [b / x for b, x in zip(got[base], got[cand])]
        emit("ratio", row_of(cand), f"{cand} / product", q3(r),
             f"per pass (time ratio, > 1 faster) {[round(x, 3) for x in r]}")


def dry_run():
    """Every configuration built for sm_90 on the CPU (the timed form and the checks' forms)."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from sm90 import ptxas
    seesaw_on()
    bad = 0
    configs = dict.fromkeys(TIMED + live(tuple(g[0][-1] for g in GROUPS.values()), "build"))  # the round's, in order
    forms = [("dense", "causal", 128, 2, 1, 1, c) for c in configs]
    if ROUND == "A":
        forms += [("paged", "causal", 128, 2, 2, 3, "loader"), ("paged", "none", 64, 1, 0, 3, "loader+split2"),
                  ("paged", "none", 64, 1, 2, 3, "bit+split2+order3")]
    else:
        forms += [("paged", "causal", 128, 2, 2, 3, "f16"), ("paged", "none", 64, 1, 0, 3, "f16+order3"),
                  ("paged", "none", 64, 1, 2, 3, "f16")]
    for layout, mask, hq, sq, scales, splits, config in forms:
        if removed(config):
            print(f"  build {layout} {mask} h{hq} {config}: skipped (its switch left the template after round C)")
            continue
        m = module(layout, mask, hq)
        configure(m, config)
        t = time.time()
        ck = m.compile_for(seq_q=sq, seesaw=True, scales=scales, num_splits=splits)
        res, log, _ = ptxas(ck.asm["ptx"])
        r = next(iter(res.values()))
        spills = r.spill_stores + r.spill_loads
        f16 = CONFIGS[config][0] == 2  # [Note] Seesaw f16 operands: 52 B, one 4-byte value reloaded
        ok = ck.metadata.shared <= 232448 and (spills == 0 or scales == 2 or (f16 and spills <= 56))
        bad += not ok
        emit("build", f"{layout} {mask} h{hq} sq{sq} scales{scales} sp{splits}", config, "ok" if ok else "BAD",
             f"shared {ck.metadata.shared} B, spills {spills} B, {time.time() - t:.1f} s")
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
    print(f"gpu_seesaw8_s24 round {ROUND}: section | case | impl | value | note", flush=True)
    rcs = {}

    def env_of(name):
        env = child_env(f"/tmp/fagen-cache-seesaw8-{name}", ROOT)
        env["TRITON_CACHE_DIR"] = f"/tmp/triton-cache-seesaw8-{name}"
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
