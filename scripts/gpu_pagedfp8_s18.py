"""Paged fp8 KV decode, eighteenth session (issue 27; docs/serving.md "Paged fp8 decode (eighteenth session)"): the
serving suite's fp8 decode rows on the H200 (paged16, dense kv8k b32, dense kv32k b8) and the bf16 rows beside them
(dense kv8k b32, and the same shape paged16), the product's defaults, each over a copy of its bytes in the suite's
own measure; then the Triton paged decode's tile / warps / stages / split configs on the paged row.

    PYTHONPATH=$PWD python3 scripts/gpu_pagedfp8_s18.py [--round A|B] [--dry-run]

--dry-run (the CPU): builds every candidate's _decode_split for sm_90 (ptxas registers, spills, shared memory).
Phases, each a child process with a timeout (scripts/_phases.py):
1. warm (children in parallel, one per paged candidate and one per suite row): a candidate is checked against float64
   on the dequantized cache (28 sequences of 1..1200 keys, no multiple of a page or a block, shuffled table, entries
   past each sequence's pages outside the cache, per-head scales, through its split rule and 3 forced splits; it must
   FAIL on the cache read as bf16 and without its scales; garbage used entries run without a fault; 0 keys give
   out 0 and lse -inf), then runs once on the bench row's shapes (its build); a suite row runs the bench's own check.
2. time (one child): the paged row's candidates and the copy of its bytes by the bench's time_prepared ("loop"),
   PASSES passes in shuffled order, per pass candidate / copy and default / candidate, median and quartiles; then the
   suite rows, product default against their own copy, 3 shuffled passes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import re
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/, for _phases
from _phases import child_env, run_phase as run_child  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROUND = os.environ.get("GPU_PAGEDFP8_S18_ROUND", "A")
if "--round" in sys.argv[:-1]:  # before the candidates below are chosen (the children get it by the environment)
    ROUND = os.environ["GPU_PAGEDFP8_S18_ROUND"] = sys.argv[sys.argv.index("--round") + 1]
PHASES = {"warm": 28, "time": 28}
if os.environ.get("GPU_PAGEDFP8_S18_PHASES"):  # "name:seconds,..."
    PHASES = {n: float(t) for n, t in (p.split(":") for p in os.environ["GPU_PAGEDFP8_S18_PHASES"].split(","))}
PASSES = 5
CPU = os.environ.get("GPU_PAGEDFP8_S18_CPU") == "1"  # a CPU test of the phases: TRITON_INTERPRET=1, small shapes
DEV = "cpu" if CPU else "cuda"
PAGED_ROW = "decode-d128-kv8k-b32-fp8-paged16"
# name: (spec overrides, module-constant substitutions). pps: PROGRAMS_PER_SM of the split rule ([Note] Split
# heuristic): 4 at b32 x 8 KV heads (256 programs) gives 2 splits (512 programs), 3 gives 3 at n128.
C = lambda n, w, s, pps=2: (dict(block_n=n, num_warps=w, num_stages=s),  # noqa: E731
                             {r"^PROGRAMS_PER_SM = \d+$": f"PROGRAMS_PER_SM = {pps}"})
LAB = {  # the seventeenth session's Gluon swap-AB lab kernel (lab/pagedfp8_swap_decode.py; 18 SASS a key against
    # the Triton default's 27; H100: 0.913 of copy against the default's 0.927)
    "swap s4 red": ("lab", dict(stages=4, red=1)),
    "swap s5 red early1": ("lab", dict(stages=5, red=1, early=1)),
}
if ROUND == "A":  # (on the product before this session's tiles: its default was m64n128w8s3)
    CANDS_A = {  # programs an SM by ptxas' registers and shared memory (--dry-run), splits at b32 x 8 KV heads
        "default": ({}, {}),  # m64n128w8s3: 128 regs, 104 KB: 2 programs an SM, 1 split, 2 blocks ahead
        "n128w8s3 pps4": C(128, 8, 3, 4),  # the same, 2 splits (512 programs, 2 waves of 264)
        "n128w8s4": C(128, 8, 4),  # 136 KB: 1 program an SM, 3 blocks ahead
        "n128w4s3": C(128, 4, 3),  # 239 regs, 72 KB: 2 an SM by registers (V by the pure path)
        "n64w4s3 pps4": C(64, 4, 3, 4),  # 54 KB: 4 an SM, 2 splits (512 programs)
        "n64w4s4 pps3": C(64, 4, 4, 3),  # 70 KB: 3 an SM, 3 splits (768 programs)
        "n64w4s5": C(64, 4, 5),  # 86 KB: 2 an SM, 4 blocks ahead
        "n64w4s6": C(64, 4, 6),  # 2 an SM, 5 blocks ahead
        "n32w4s8 pps3": C(32, 4, 8, 3),  # 69 KB: 3 an SM, 3 splits, 7 blocks of 32 keys ahead
        "n32w4s4 pps5": C(32, 4, 4, 5),  # 96 regs, 37 KB: 5 an SM, 5 splits (1280 programs)
        "n64w2s3 pps4": C(64, 2, 3, 4),  # 187 regs, 54 KB: 4 an SM (8 warps), 2 splits; 19 SASS a key
        **LAB,
    }
else:  # round B (A, 12:59: m64n128w8s3 0.650 of copy, n64w2s3 pps4 0.810, n128w4s3 0.781, swap s5 red early1
    # 0.838; the bf16 rows 1.00-1.05): the product's default is now m64n64w2s3 with 4 programs an SM
    CANDS_A = {
        "default": ({}, {}),  # the product: m64n64w2s3, PROGRAMS_PER_SM 4 (2 splits at b32)
        "old n128w8s3": C(128, 8, 3),  # the product before (round A's default)
        "n64w2s4 pps3": C(64, 2, 4, 3),  # 70 KB: 3 an SM, 3 splits
        "n64w2s2 pps5": C(64, 2, 2, 5),  # 38 KB: 5 an SM, 5 splits, 1 block ahead
        "n64w2s3 pps2": C(64, 2, 3, 2),  # the default's tiles, 1 split (the rule's count: what 4 an SM gives)
        "n32w2s6 pps4": C(32, 2, 6, 4),  # 53 KB: 4 an SM, 28 SASS a key
        "n32w1s4 pps6": C(32, 1, 4, 6),  # 255 regs, 36 KB: 6 an SM, 19.5 SASS a key
        "n128w4s3": C(128, 4, 3),
        "swap s5 red early1": ("lab", dict(stages=5, red=1, early=1, splits=1)),  # round A's 1 split
    }
CANDS = CANDS_A
if os.environ.get("GPU_PAGEDFP8_S18_CANDS"):
    CANDS = {k: CANDS[k] for k in os.environ["GPU_PAGEDFP8_S18_CANDS"].split(",")}
# the suite rows beside it: (name, how to make it)
SUITE = ("decode-d128-kv8k-b32-fp8", "decode-d128-kv32k-b8-fp8", PAGED_ROW, "decode-d128-kv8k-b32",
         "decode-d128-kv8k-b32-paged16")
# rows timed after the paged row: {row: candidates beside the product's default}; the candidates' spec overrides
# apply to the row's own spec (the dense rows' default is m64n128w4s3)
EXTRA_C = {"w2 n64s3 pps4": C(64, 2, 3, 4), "w2 n64s4 pps3": C(64, 2, 4, 3), "old n128w8s3": C(128, 8, 3)}
if ROUND == "A":
    EXTRA = {n: () for n in SUITE if n != PAGED_ROW}
else:
    EXTRA = {"decode-d128-kv8k-b32-fp8": ("w2 n64s3 pps4", "w2 n64s4 pps3"),
             "decode-d128-kv32k-b8-fp8": ("w2 n64s3 pps4", "w2 n64s4 pps3"),
             "paged16-b128-kv8k-fp8": ("old n128w8s3",), "paged16-b8-kv32k-fp8": ("old n128w8s3",)}
ALL = {**CANDS_A, **EXTRA_C}
# the warm phase's row children (rows of one spec in one child: one build)
ROW_CHILDREN = ("decode-d128-kv8k-b32-fp8|decode-d128-kv32k-b8-fp8", *(n for n in EXTRA if "fp8" not in n or
                                                                        n.startswith("paged16")))


def emit(section, case, impl, value, ms, note=""):
    print("ROW " + json.dumps([section, case, impl, value, "" if ms is None else f"{ms:.4f}", note]), flush=True)


def paged_spec():
    import fagen
    return fagen.KernelSpec(head_dim=128, gqa=4, dtype="bf16", kind="decode", kv_dtype="fp8_e4m3", layout="paged")


def source(name, spec=None):
    import fagen
    over, subs = ALL[name]
    spec = dataclasses.replace(spec or paged_spec(), **over)
    src = fagen.generate(spec)
    for a, b in subs.items():
        src, n = re.subn(a, b, src, flags=re.M)
        if n != 1:
            raise AssertionError(f"{name}: {a!r} is not in the render once")
    return spec, src


_MODS = {}


class _Lab:
    """A Gluon lab candidate as a decode module (forward, forward_split, the product's _geometry) over
    lab/pagedfp8_swap_decode.py's forward, its split count the product's rule (scripts/gpu_pagedfp8_s17.py's)."""

    def __init__(self, product, kw):
        sys.path.insert(0, os.path.join(ROOT, "lab"))
        import importlib
        self.lab, self.p, self.kw = importlib.import_module("pagedfp8_swap_decode"), product, dict(kw)
        self.force = self.kw.pop("splits", None)  # a split count in place of the product's rule
        self._geometry = product._geometry

    def _rule(self, q, k, block_table):
        if self.force:
            return self.force
        span = -(-block_table.shape[1] * k.shape[1] // self.p.BLOCK_N) * self.p.BLOCK_N
        return self._geometry(q.shape[0], k.shape[2], 1, span, None, q.device.index or 0)[3]

    def forward(self, q, k, v, *, block_table, seqlens_k, k_scale=None, v_scale=None, scale=None, **_):
        return self.lab.forward(q, k, v, block_table=block_table, seqlens_k=seqlens_k, k_scale=k_scale,
                                v_scale=v_scale, scale=scale, num_splits=self._rule(q, k, block_table), **self.kw)

    def forward_split(self, q, k, v, *, num_splits, block_table, seqlens_k, k_scale=None, v_scale=None, scale=None):
        return self.lab.forward(q, k, v, block_table=block_table, seqlens_k=seqlens_k, k_scale=k_scale,
                                v_scale=v_scale, scale=scale, num_splits=num_splits, **self.kw)


def module(name, spec=None):
    from fagen.runtime.loader import load_source
    key = (name, spec)
    if ALL[name][0] == "lab":
        if key not in _MODS:
            _MODS[key] = _Lab(module("default", spec), ALL[name][1])
        return _MODS[key]
    if key not in _MODS:
        s, src = source(name, spec)
        _MODS[key] = load_source(src, f"{s.name}_s18_{abs(hash(name)) % 10**8}")
    return _MODS[key]


def suite_cases():
    from fagen.bench import workloads
    from fagen.bench.serving import serving_rows
    from fagen.bench.workloads import make_case, standard_suite
    by = {c.name: c for c in serving_rows(CPU) + standard_suite(CPU)}
    bf = by["decode-d128-kv8k-b32"]
    by["decode-d128-kv8k-b32-paged16"] = make_case("decode-d128-kv8k-b32-paged16", head_dim=128, mask="none",
                                                   batch=bf.batch, heads_q=32, heads_kv=8, seq_q=1,
                                                   seq_k=max(bf.seq_k, 256), page_size=16, peers=False)
    for label, b, sk in (("paged16-b128-kv8k-fp8", 128, 8192), ("paged16-b8-kv32k-fp8", 8, 32768)):
        by[label] = make_case(label, head_dim=128, mask="none", batch=2 if CPU else b, heads_q=32, heads_kv=8,
                              seq_q=1, seq_k=256 if CPU else sk, kv_dtype="fp8_e4m3", page_size=16, peers=False)
    for n in by:  # the copy reference runs on the rows whose target names it; the bf16 rows for comparison
        if n in SUITE or n in EXTRA:
            workloads.RELATIVE_TARGETS.setdefault(n, (("copy", 0.95),))
    assert bf.page_size is None
    return {n: by[n] for n in by if n in SUITE or n in EXTRA}


def check_candidate(name):  # noqa: C901 - the sixteenth session's checks
    import torch

    from fagen.verify import reference
    from fagen.verify.tolerances import LSE_TOLERANCE, TOLERANCE, compare

    dev = DEV
    HD, HKV, G, page, b = 128, 8, 4, 16, 4 if CPU else 28
    gen = torch.Generator(device=dev).manual_seed(13)
    lens = torch.randint(1, (200 if CPU else 1200) + 1, (b,), device=dev, generator=gen, dtype=torch.int32)
    lens[0], lens[1] = 150 if CPU else 1000, 77
    width = -(-(-(-int(lens.max()) // page) + 1) // 16) * 16
    q = torch.randn(b, HKV * G, 1, HD, device=dev, generator=gen).mul(2).bfloat16()
    npg = b * width + 3
    kc = torch.randn(npg, page, HKV, HD, device=dev, generator=gen).to(torch.float8_e4m3fn)
    vc = torch.randn(npg, page, HKV, HD, device=dev, generator=gen).to(torch.float8_e4m3fn)
    table = torch.randperm(npg, device=dev, generator=gen)[:b * width].to(torch.int32).view(b, width)
    for i in range(b):  # entries past each sequence's pages point outside the cache ([Note] Memory safety)
        used = -(-int(lens[i]) // page)
        table[i, used:] = torch.tensor([10**6, -3, npg] * width, dtype=torch.int32, device=dev)[:width - used]
    ks = torch.exp2(torch.rand(HKV, device=dev, generator=gen) * 6 - 3)
    vs = torch.exp2(torch.rand(HKV, device=dev, generator=gen) * 6 - 3)

    def gathered(cache, i, n):
        return cache[table[i, :-(-n // page)].long()].reshape(-1, cache.shape[2], cache.shape[3])[:n] \
            .transpose(0, 1)[None]

    def misread(x):
        return x.view(torch.uint8).view(torch.bfloat16).double().nan_to_num(0.0).clamp(-1e4, 1e4) \
            .repeat_interleave(2, -1)

    kd, vd = reference.dequantize(kc, ks, head_dim_axis=2), reference.dequantize(vc, vs, head_dim_axis=2)
    m = module(name)
    kw = dict(block_table=table, seqlens_k=lens, k_scale=ks, v_scale=vs)
    runs = [("rule", m.forward(q, kc, vc, **kw)), ("3 splits", m.forward_split(q, kc, vc, num_splits=3, **kw))]
    worst, far = 0.0, []
    for i in range(b):
        n = int(lens[i])
        want, wlse = reference.attention(q[i:i + 1].double(), gathered(kd, i, n), gathered(vd, i, n))
        terms, _ = reference.attention(q[i:i + 1].double(), gathered(kd, i, n), gathered(vd, i, n).abs())
        unit = terms.clamp(min=1.0)
        for how, (o2, l2) in runs:
            got = o2[i:i + 1].double() / unit
            worst = max(worst, compare(f"out {i} {how}", got, want / unit, **TOLERANCE["bf16"]))
            compare(f"lse {i} {how}", l2[i:i + 1], wlse, **LSE_TOLERANCE)
        if i == 0:
            got = runs[0][1][0][0:1].double() / unit
            for what, k2, v2 in (("read as bf16", gathered(misread(kc), i, n), gathered(misread(vc), i, n)),
                                 ("no scales", gathered(kc.double(), i, n), gathered(vc.double(), i, n))):
                wrong, _ = reference.attention(q[i:i + 1].double(), k2, v2)
                try:
                    compare(what, got, wrong / unit, **TOLERANCE["bf16"])
                except AssertionError:
                    far.append(what)
                else:
                    raise AssertionError(f"the result also matches the reference on the cache {what}")
    bad = table.clone()
    bad[:, 0], bad[:, 1] = 10**7, -5
    lz = lens.clone()
    lz[3] = 0
    oz, lz_ = m.forward(q, kc, vc, block_table=bad, seqlens_k=lz, k_scale=ks, v_scale=vs)
    if not (bool((oz[3] == 0).all()) and bool((lz_[3] == float("-inf")).all())):
        raise AssertionError("a sequence of 0 keys does not give out 0 and lse -inf")
    n_rule = m._geometry(32, HKV, 1, 8192, None, 0)[3]
    return f"ok (3 splits too), err {worst:.1e}; fails as {' and as '.join(far)}; bad entries: no fault; " \
           f"0 keys: 0 / -inf; rule at the row: {n_rule} splits"


def warm_phase(which):
    """One candidate (its checks, then its build at the row's shapes) or one suite row (the bench's check)."""
    import torch

    from fagen.bench import impls
    from fagen.bench.cases import BenchOptions, CaseContext
    from fagen.bench.check import check
    from fagen.runtime import loader
    kind, name = which.split(":", 1)
    try:
        if kind == "cand":
            note = check_candidate(name)
            if CPU:
                emit("check", "page16 b4 1..200 keys (cpu)", name, "-", None, note)
                return
            m = module(name)  # the row's shapes (Triton's specialisations): its build lands in the cache
            q = torch.randn(32, 32, 1, 128, device="cuda").bfloat16()
            kc = torch.zeros(32 * 512, 16, 8, 128, device="cuda", dtype=torch.float8_e4m3fn)
            table = torch.randperm(32 * 512, device="cuda").to(torch.int32).view(32, 512)
            lens = torch.full((32,), 8192, dtype=torch.int32, device="cuda")
            ks = torch.ones(8, device="cuda")
            m.forward(q, kc, kc, block_table=table, seqlens_k=lens, k_scale=ks, v_scale=ks)
            torch.cuda.synchronize()
            emit("check", "page16 b28 1..1200 keys", name, "-", None, note)
        for name in name.split("|") if kind == "row" else ():  # rows of one spec in one child (one build)
            case = suite_cases()[name]
            cc = CaseContext(case, torch.device(DEV), BenchOptions().sets)
            real_load = loader.load
            for impl in ("fagen", *EXTRA.get(name, ())):  # the product, then each candidate of the row
                try:
                    if impl != "fagen":
                        loader.load = lambda spec, impl=impl: module(impl, spec)
                    prep = impls.prepare_fagen(case, cc)
                finally:
                    loader.load = real_load
                status, message, err = check("fagen", prep, cc)
                spec = case.spec(DEV)[0]
                if impl != "fagen":
                    spec = dataclasses.replace(spec, **ALL[impl][0])
                del prep
                e = "-" if err is None else format(err, ".1e")
                emit("check", name, impl, "-", None, f"{'' if status == 'ok' else 'ERROR '}{status} err {e} "
                     f"{(message or '')[:80]} (n{spec.block_n} w{spec.num_warps} s{spec.num_stages})")
            del cc
    except Exception as e:  # noqa: BLE001
        emit("check", name, kind, "-", None, f"ERROR {type(e).__name__}: {str(e)[:200]}")
    del loader


def q3(xs):
    s = sorted(xs)
    if len(s) < 3:
        return f"{statistics.median(s):.3f}"
    qs = statistics.quantiles(s, n=4)
    return f"{statistics.median(s):.3f} [{qs[0]:.3f}-{qs[2]:.3f}]"


def time_phase():  # noqa: C901 - one phase
    import torch

    from fagen.bench import impls, timing
    from fagen.bench.cases import BenchOptions, CaseContext
    from fagen.bench.workloads import kv_bytes
    from fagen.runtime import loader

    T0 = time.time()
    dev = torch.device(DEV)
    cases = suite_cases()
    row = cases[PAGED_ROW]
    opts = BenchOptions(device=str(dev), warmup_ms=5.0, rep_ms=40.0)
    skip = set(filter(None, os.environ.get("GPU_PAGEDFP8_S18_SKIP", "").split(",")))
    cc = CaseContext(row, dev, opts.sets)
    nb = kv_bytes(row)
    entries, real_load = {}, loader.load
    for name in CANDS:
        if name in skip:
            continue
        try:
            loader.load = lambda spec, name=name: module(name, spec)
            entries[name] = impls.prepare_fagen(row, cc)
        except Exception as e:  # noqa: BLE001
            emit("time", row.name, name, "-", None, f"ERROR {type(e).__name__}: {str(e)[:200]}")
        finally:
            loader.load = real_load
    entries["copy"] = impls.prepare_copy(row, cc)
    res, names, rng = {}, list(entries), random.Random(18 if ROUND == "A" else 1818)
    with torch.no_grad():
        for p in range(PASSES):
            if time.time() - T0 > PHASES["time"] - 10:
                break
            order = names[:]
            rng.shuffle(order)
            for name in order:
                res.setdefault(name, []).append(timing.time_prepared(entries[name], cc, opts)["ms"])
    npass = min(len(v) for v in res.values()) if res else 0
    for name in names:
        if name not in res or "copy" not in res:
            continue
        rc = [c / x for c, x in zip(res["copy"][:npass], res[name][:npass])]
        vs = ""
        if "default" in res and name not in ("default", "copy"):
            vs = "; default/cand " + q3([d / x for d, x in zip(res["default"][:npass], res[name][:npass])])
        ml = statistics.median(res[name][:npass])
        emit("paged", row.name, name, f"{nb / ml / 1e6:.0f} GB/s", ml,
             f"/copy {q3(rc)} ({npass} passes {[round(x, 3) for x in rc]}){vs}")
    del entries, cc
    if not CPU:
        torch.cuda.empty_cache()
    # the other rows: the product's default (and the row's candidates) against the copy of the row's bytes, 3
    # shuffled passes
    for cname, cands in EXTRA.items():
        if time.time() - T0 > PHASES["time"] - 3:
            emit("rows", cname, "fagen", "-", None, "skipped: time budget")
            continue
        try:
            case = cases[cname]
            cc = CaseContext(case, dev, opts.sets)
            ent = {"fagen": impls.prepare_fagen(case, cc), "copy": impls.prepare_copy(case, cc)}
            for c in cands:
                if c in skip:
                    continue
                try:
                    loader.load = lambda spec, c=c: module(c, spec)
                    ent[c] = impls.prepare_fagen(case, cc)
                finally:
                    loader.load = real_load
            got = {}
            with torch.no_grad():
                for p in range(3):
                    order = list(ent)
                    rng.shuffle(order)
                    for n in order:
                        got.setdefault(n, []).append(timing.time_prepared(ent[n], cc, opts)["ms"])
            b = kv_bytes(case)
            for n in ent:
                if n == "copy":
                    continue
                r = [c / x for c, x in zip(got["copy"], got[n])]
                vs = "" if n == "fagen" else "; fagen/cand " + q3([f / x for f, x in zip(got["fagen"], got[n])])
                emit("rows", cname, n, f"{b / statistics.median(got[n]) / 1e6:.0f} GB/s", statistics.median(got[n]),
                     f"/copy {q3(r)} {[round(x, 3) for x in r]}{vs}; copy "
                     f"{b / statistics.median(got['copy']) / 1e6:.0f} GB/s")
            del cc, ent
            if not CPU:
                torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001
            emit("rows", cname, "fagen", "-", None, f"ERROR {type(e).__name__}: {str(e)[:200]}")


def dry_run():
    """Each candidate's _decode_split built for sm_90 (the CPU): 1 split (DIRECT) and the split form."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fagen.runtime.loader import load_source
    from sm90 import ptxas
    PTR = {"Q": "*bf16", "K": "*fp8e4nv", "V": "*fp8e4nv", "Dst": "*fp32", "DstLse": "*fp32", "Out": "*bf16",
           "Lse": "*fp32", "Counter": "*i32", "SeqlensK": "*i32", "KScale": "*fp32", "VScale": "*fp32",
           "BlockTable": "*i32"}
    bad = 0
    for name in CANDS:
        if CANDS[name][0] == "lab":
            sys.path.insert(0, os.path.join(ROOT, "lab"))
            import pagedfp8_swap_decode as lab
            try:
                ck, r = lab.build_sm90(**{k: v for k, v in CANDS[name][1].items() if k != "splits"})
                print(f"{name:24s} direct=1 gluon: {r.registers} regs, {r.spill_stores + r.spill_loads} spill bytes, "
                      f"{ck.metadata.shared // 1024} KB smem", flush=True)
            except Exception as e:  # noqa: BLE001
                bad += 1
                print(f"{name:24s}: ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        spec, src = source(name)
        m = load_source(src, f"{spec.name}_s18dry_{abs(hash(name)) % 10**8}")
        fn = m._decode_split
        for direct in (True, False):
            consts = dict(HEAD_DIM=128, BLOCK_D=128, HEAD_DIM_V=128, BLOCK_DV=128, ROWS=m.tile_rows(4),
                          BLOCK_N=spec.block_n, GQA=4, DOT=True, DIRECT=direct, SPLITS_PER_SEQ=0, UPCAST=False,
                          ROWS32=1)
            sig, cx, attrs = {}, {}, {}
            for i, p in enumerate(fn.params):
                n = p.name
                if p.is_constexpr:
                    sig[n], cx[n] = "constexpr", consts[n]
                elif n == "seq_q":
                    sig[n], cx[n] = "constexpr", 1
                elif n in ("SeqlensQ", "TreeMask", "KTok", "VTok"):
                    sig[n], cx[n] = "constexpr", None
                elif n in PTR:
                    sig[n] = PTR[n]
                    attrs[(i,)] = [["tt.divisibility", 16]]
                elif n in ("qk_scale", "k_scale", "v_scale"):
                    sig[n] = "fp32"
                else:
                    sig[n] = "i32"
                    if n.startswith("stride_") and n not in ("stride_qm", "stride_om", "stride_dm", "stride_tb",
                                                              "stride_tm"):
                        attrs[(i,)] = [["tt.divisibility", 16]]
            try:
                ck = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=cx, attrs=attrs),
                                    target=GPUTarget("cuda", 90, 128),
                                    options=dict(num_warps=spec.num_warps, num_stages=spec.num_stages))
                r = next(iter(ptxas(ck.asm["ptx"])[0].values()))
                sys.path.insert(0, os.path.join(ROOT, "lab"))
                from pagedfp8_swap_decode import loop_sass  # the key loops' SASS (cuobjdump)
                loops = "; ".join(f"loop {x['instructions']} SASS, {x['per_key']} a key, {x['bar']} BAR"
                                  for x in loop_sass(ck, spec.block_n, spec.num_warps, "HMMA"))
                print(f"{name:24s} direct={int(direct)} n{spec.block_n} w{spec.num_warps} s{spec.num_stages}: "
                      f"{r.registers} regs, {r.spill_stores + r.spill_loads} spill bytes, "
                      f"{ck.metadata.shared // 1024} KB smem, "
                      f"cp.async {ck.asm['ttgir'].count('async_copy_global_to_local')}; {loops}", flush=True)
            except Exception as e:  # noqa: BLE001
                bad += 1
                print(f"{name:24s} direct={int(direct)}: ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)
    return bad


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--round", default=None)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--phase")
    ap.add_argument("--which")
    a, _ = ap.parse_known_args()
    if a.round:
        os.environ["GPU_PAGEDFP8_S18_ROUND"] = a.round
    if a.dry_run:
        sys.exit(1 if dry_run() else 0)
    if a.phase == "warm":
        warm_phase(a.which)
        return
    if a.phase == "time":
        time_phase()
        return
    t0 = time.time()
    env = child_env("/tmp/fagen-cache-gpu-pagedfp8-s18", ROOT)
    env["GPU_PAGEDFP8_S18_ROUND"] = os.environ.get("GPU_PAGEDFP8_S18_ROUND", "A")
    if CPU:  # the phases' CPU test: the interpreter in the children too
        env["TRITON_INTERPRET"] = "1"
    rows, logs, lock = [], [], threading.Lock()
    import torch
    print(torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU", flush=True)

    def one(which):
        rc, lines = run_child(os.path.abspath(__file__), "warm", PHASES["warm"], env,
                              lambda line: line.startswith("ROW ") or print(line, end="", flush=True),
                              extra=("--which", which))
        with lock:
            got = [json.loads(line[4:]) for line in lines if line.startswith("ROW ")]
            rows.extend(got)
            logs.extend(lines)
            if rc != 0 or not got:
                rows.append(["check", which, "-", "-", "", f"ERROR rc={rc}"])

    print(f"[{time.time() - t0:6.1f}s] #### phase warm (parallel, timeout {PHASES['warm']}s)", flush=True)
    ths = [threading.Thread(target=one, args=(w,)) for w in [f"cand:{n}" for n in CANDS]
           + [f"row:{n}" for n in ROW_CHILDREN]]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    ok = {r[2] for r in rows if r[0] == "check" and r[5].startswith("ok")}
    bad = [n for n in CANDS if n not in ok]
    if bad:
        env["GPU_PAGEDFP8_S18_SKIP"] = ",".join(bad)
        rows.append(["time", "(left out)", ", ".join(bad), "-", "", "not checked ok in the warm phase"])
    print(f"[{time.time() - t0:6.1f}s] #### phase time (timeout {PHASES['time']}s)", flush=True)
    rc, lines = run_child(os.path.abspath(__file__), "time", PHASES["time"], env,
                          lambda line: line.startswith("ROW ") or print(line, end="", flush=True))
    rows += [json.loads(line[4:]) for line in lines if line.startswith("ROW ")]
    logs += lines
    if rc != 0:
        rows.append(["time", "(phase)", "-", "-", "", f"ERROR rc={rc}"])
    text = "\n".join(["| section | case | impl | value | ms | note |", "|---|---|---|---|---|---|"]
                     + ["| " + " | ".join(r) + " |" for r in rows])
    print("\n" + text, flush=True)
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "gpu_pagedfp8_s18.md"), "w") as f:
            f.write(text + "\n\n" + "".join(logs))
    failed = [r for r in rows if "ERROR" in r[5]]
    print(f"done in {time.time() - t0:.0f} s; {len(failed)} failures", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
