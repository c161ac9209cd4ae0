"""fp8 KV decode, twenty-first session (issue 27; docs/serving.md "fp8 decode (twenty-first session)"): the Triton fp8
(e4m3) decode against the product (swapped dots on, dense m64n64w2s3 with the one-warp tile n32w1s4 by shape, paged
m64n64w2s3 at SPLIT_WAVES 0.95), on the serving suite's fp8 dense and paged shapes and b8/b32/b128 x kv 4k/32k (d128,
Hq 32 / Hkv 8, bf16 q, per-KV-head scales), each over the copy of its bytes in the suite's measure (the bench's
time_prepared, "loop").

    PYTHONPATH=$PWD python3 scripts/gpu_fp8dec_s21.py [--round A|B] [--dry-run]

The candidates are the product's render with substitutions (CANDS). Round A: dense, the one-warp 64-key tile by
shape (64, 1, 3, 4), with and without the lazy rescale, the lazy rescale alone, the 2-warp tile only; paged, one
warp (64 keys), one warp at 6 programs an SM, 128 keys a step, the lazy rescale, PAGED_SAME_ROWS (v's row offsets
are k's: one layout conversion a step). Round A ran (H200, 00:08 UTC, at 9ce0ea77; docs/serving.md "fp8 decode
(twenty-first session)"); round B was cancelled.

--dry-run (the CPU): builds every candidate's _decode_split for sm_90 (ptxas registers, spills, shared memory, the
key loop's SASS a key) and prints each candidate's split count at every timed shape.
Phases, each a child process with a timeout (scripts/_phases.py):
1. warm (children in parallel, one per candidate): checks against float64 on the dequantized cache (B 3, odd
   lengths 77 and 1201; per-KV-head scales; its split rule, 3 forced splits and batch_invariant=True; dense: also
   2 queries a sequence, 8 rows a tile), which must FAIL on the cache read without its scales; batch_invariant=True
   bit for bit: each sequence alone against its row in batches of 5 and 24 (Sk 1201 and 4099); then its builds at
   the timed shapes' forms.
2. time (one child): every shape, its candidates and the copy of its bytes, PASSES shuffled passes; per pass
   candidate / copy and product / candidate, median [quartiles].
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
ENV = "GPU_FP8DEC_S21_"
ROUND = os.environ.get(ENV + "ROUND", "A")
if "--round" in sys.argv[:-1]:  # before the candidates below are chosen (the children get it by the environment)
    ROUND = os.environ[ENV + "ROUND"] = sys.argv[sys.argv.index("--round") + 1]
PHASES = {"warm": 30, "time": 16}
if os.environ.get(ENV + "PHASES"):  # "name:seconds,..."
    PHASES = {n: float(t) for n, t in (p.split(":") for p in os.environ[ENV + "PHASES"].split(","))}
PASSES = 3
CPU = os.environ.get(ENV + "CPU") == "1"  # a CPU test of the phases: TRITON_INTERPRET=1, small shapes
DEV = "cpu" if CPU else "cuda"


INV, INV_ON = r"^BATCH_INVARIANT = False", "BATCH_INVARIANT = True"
# the product (main at a06b7936): SWAP_AB on, dense m64n64w2s3 with SHAPE_TILE (32, 1, 4, 6) by shape, paged
# m64n64w2s3 at SPLIT_WAVES 0.95 with PAGE_PREFETCH; the candidates are its render with substitutions
ST64 = {r"^SHAPE_TILE = \(.*\)$": "SHAPE_TILE = (64, 1, 3, 4)"}  # the one-warp 64-key tile by shape
NO_SHAPE = {r"^SHAPE_TILE = \(.*\)$": "SHAPE_TILE = None"}
LAZY = {r"^LAZY_RESCALE = tl\.constexpr\(False\)$": "LAZY_RESCALE = tl.constexpr(True)"}
W1 = {r"^NUM_WARPS = 2$": "NUM_WARPS = 1"}  # paged: the one-warp 64-key tile everywhere
PPS6 = {r"^PROGRAMS_PER_SM = 4$": "PROGRAMS_PER_SM = 6"}
N128 = {r"^BLOCK_N = 64$": "BLOCK_N = 128"}  # paged: 128 keys a step (8 pages), 2 warps
SAME = {r"^PAGED_SAME_ROWS = False$": "PAGED_SAME_ROWS = True"}  # paged: v's row offsets are k's (one conversion)
NOPF = {r"^PAGE_PREFETCH = tl\.constexpr\(True\)$": "PAGE_PREFETCH = tl.constexpr(False)"}

# name: substitutions in the product's render (spec as the product resolves it)
CANDS = {
    "product": {},
    "st n64w1s3": ST64,
    "st n64w1s3 lazy": {**ST64, **LAZY},
    "lazy": LAZY,
    "n64 only": NO_SHAPE,
    "inv product": {INV: INV_ON},
    "paged product": {},
    "paged w1": W1,
    "paged w1 pps6": {**W1, **PPS6},
    "paged n128": N128,
    "paged lazy": LAZY,
    "paged same rows": SAME,
}
if os.environ.get(ENV + "CANDS"):
    CANDS = {k: CANDS[k] for k in os.environ[ENV + "CANDS"].split(",")}
# the timed shapes: (batch, KV length); d128 Hq 32 / Hkv 8 as the suite's rows; the suite's two fp8 dense rows first
# (batch, KV length, page size or None)
SHAPES = [(32, 8192, None), (8, 32768, None), (32, 8192, 16), (8, 4096, None), (32, 4096, None), (128, 4096, None),
          (32, 32768, None), (128, 8192, None), (8, 32768, 16), (128, 8192, 16), (32, 4096, 16), (8, 4096, 16)]
if CPU:
    SHAPES = [(2, 256, None), (4, 512, None), (2, 256, 16)]
SUITE = {(32, 8192, None): "decode-d128-kv8k-b32-fp8", (8, 32768, None): "decode-d128-kv32k-b8-fp8",
         (32, 8192, 16): "decode-d128-kv8k-b32-fp8-paged16"}
if CPU:
    SUITE[(2, 256, None)] = "cpu-dense-b2-kv256"


def paged(name):
    return name.startswith("paged")


def invariant(name):
    return name.startswith("inv ")


def default_of(name):
    return "paged product" if paged(name) else "inv product" if invariant(name) else "product"


def emit(section, case, impl, value, ms, note=""):
    print("ROW " + json.dumps([section, case, impl, value, "" if ms is None else f"{ms:.4f}", note]), flush=True)


def base_spec(name):
    import fagen
    return fagen.KernelSpec(head_dim=128, gqa=4, dtype="bf16", kind="decode", kv_dtype="fp8_e4m3",
                            layout="paged" if paged(name) else "dense")


def source(name, spec=None):
    import fagen
    subs = CANDS[name]
    spec = spec or base_spec(name)
    src = fagen.generate(spec)
    for a, b in subs.items():
        src, n = re.subn(a, b, src, flags=re.M)
        if n != 1:
            raise AssertionError(f"{name}: {a!r} is not in the render once")
    return spec, src


_MODS = {}


def module(name, spec=None):
    from fagen.runtime.loader import load_source
    key = (name, spec)
    if key not in _MODS:
        s, src = source(name, spec)
        _MODS[key] = load_source(src, f"{s.name}_s21_{abs(hash(name)) % 10**8}")
    return _MODS[key]


def case_of(b, sk, page):
    from fagen.bench import workloads
    from fagen.bench.workloads import make_case
    kv = f"{sk // 1024}k" if sk >= 1024 else str(sk)
    name = SUITE.get((b, sk, page), f"fp8-{'paged' + str(page) if page else 'dense'}-b{b}-kv{kv}")
    c = make_case(name, head_dim=128, mask="none", batch=b, heads_q=32, heads_kv=8, seq_q=1, seq_k=sk,
                  kv_dtype="fp8_e4m3", page_size=page, peers=False)
    workloads.RELATIVE_TARGETS.setdefault(name, (("copy", 0.95),))
    return c


def paged_problem(lens, page, gen, scale_range=6):
    """q, the paged caches (pages of `page` keys, a shuffled table whose entries past each sequence point outside
    the cache), the call's keywords and each sequence's float64 dequantized (k, v) [1, Hkv, n, D]."""
    import torch

    from fagen.verify import reference
    dev, HKV, G, HD, b = DEV, 8, 4, 128, len(lens)
    width = -(-max(lens) // page) + 1
    npg = b * width + 3
    q = torch.randn(b, HKV * G, 1, HD, device=dev, generator=gen).mul(2).bfloat16()
    kc = torch.randn(npg, page, HKV, HD, device=dev, generator=gen).to(torch.float8_e4m3fn)
    vc = torch.randn(npg, page, HKV, HD, device=dev, generator=gen).to(torch.float8_e4m3fn)
    table = torch.randperm(npg, device=dev, generator=gen)[:b * width].to(torch.int32).view(b, width)
    for i, n in enumerate(lens):
        used = -(-n // page)
        table[i, used:] = torch.tensor([10**6, -3, npg] * width, dtype=torch.int32, device=dev)[:width - used]
    ks = torch.exp2(torch.rand(HKV, device=dev, generator=gen) * scale_range - scale_range / 2)
    vs = torch.exp2(torch.rand(HKV, device=dev, generator=gen) * scale_range - scale_range / 2)
    kd, vd = reference.dequantize(kc, ks, head_dim_axis=2), reference.dequantize(vc, vs, head_dim_axis=2)

    def gathered(cache, i, n):
        return cache[table[i, :-(-n // page)].long()].reshape(-1, HKV, HD)[:n].transpose(0, 1)[None]

    kw = dict(block_table=table, seqlens_k=torch.tensor(lens, dtype=torch.int32, device=dev), k_scale=ks,
              v_scale=vs)
    return q, kc, vc, kw, [(gathered(kd, i, n), gathered(vd, i, n)) for i, n in enumerate(lens)], \
        [(gathered(kc.double(), i, n), gathered(vc.double(), i, n)) for i, n in enumerate(lens)]


def check_paged(name):
    """The paged candidate: float64 on the dequantized cache (lengths 77, 1201, 333, 16: pages of 16), through its
    rule, 3 forced splits and batch_invariant=True; fails without the scales; invariant bits alone and in the batch."""
    import torch

    from fagen.verify import reference
    from fagen.verify.tolerances import LSE_TOLERANCE, TOLERANCE, compare
    m = module(name)
    gen = torch.Generator(device=DEV).manual_seed(191)
    lens = (77, 133, 1, 50) if CPU else (77, 1201, 333, 16, 1)
    q, kc, vc, kw, seqs, raw = paged_problem(lens, 16, gen)
    runs = [("rule", m.forward(q, kc, vc, **kw)), ("3 splits", m.forward_split(q, kc, vc, num_splits=3, **kw)),
            ("invariant", m.forward(q, kc, vc, batch_invariant=True, **kw))]
    worst, far = 0.0, 0
    for i, (k, v) in enumerate(seqs):
        want, wlse = reference.attention(q[i:i + 1].double(), k, v)
        terms, _ = reference.attention(q[i:i + 1].double(), k, v.abs())
        unit = terms.clamp(min=1.0)
        for how, (o, lse) in runs:
            worst = max(worst, compare(f"out {i} {how}", o[i:i + 1].double() / unit, want / unit,
                                       **TOLERANCE["bf16"]))
            compare(f"lse {i} {how}", lse[i:i + 1], wlse, **LSE_TOLERANCE)
        if lens[i] > 1:
            wrong, _ = reference.attention(q[i:i + 1].double(), *raw[i])
            try:
                compare("no scales", runs[0][1][0][i:i + 1].double() / unit, wrong / unit, **TOLERANCE["bf16"])
            except AssertionError:
                far += 1
            else:
                raise AssertionError(f"sequence {i}: the result also matches the reference without the scales")
    o, lse = runs[2][1]
    for i in range(len(lens)):  # each sequence alone: its own table row and length
        o1, l1 = m.forward(q[i:i + 1], kc, vc, block_table=kw["block_table"][i:i + 1],
                           seqlens_k=kw["seqlens_k"][i:i + 1], k_scale=kw["k_scale"], v_scale=kw["v_scale"],
                           batch_invariant=True)
        if not (torch.equal(o1[0], o[i]) and torch.equal(l1[0], lse[i])):
            raise AssertionError(f"batch_invariant=True: sequence {i} alone is not its row's bits in the batch")
    rule = ", ".join(f"b{b}k{sk // 1024}:{m._geometry(b, 8, 1, sk, None, 0)[3]}" for b, sk, p in SHAPES if p)
    return (f"ok err {worst:.1e} ({len(seqs) * 3} runs); fails without scales ({far}/{far}); invariant bits "
            f"{len(lens)}/{len(lens)}; splits {rule}")


def check_candidate(name):
    """float64 on the dequantized cache at odd lengths; batch_invariant=True bit for bit alone and in batches."""
    import torch

    from fagen.verify import reference
    from fagen.verify.tolerances import LSE_TOLERANCE, TOLERANCE, compare

    if paged(name):
        return check_paged(name)
    dev, HKV, G, HD = DEV, 8, 4, 128
    m = module(name)
    gen = torch.Generator(device=dev).manual_seed(19)
    worst, far, n_checked = 0.0, [], 0
    st = None  # with a tile by shape: the same render with SHAPE_TILE_MIN_CHUNK 1, so that these small problems take it
    if getattr(m, "SHAPE_TILE", None) is not None:
        from fagen.runtime.loader import load_source
        spec, src = source(name)
        src, n = re.subn(r"^SHAPE_TILE_MIN_CHUNK = \d+$", "SHAPE_TILE_MIN_CHUNK = 1", src, flags=re.M)
        assert n == 1
        st = load_source(src, f"{spec.name}_s21st_{abs(hash(name)) % 10**8}")
    for sk in ((77, 133) if CPU else (77, 1201)):
        b = 3
        q = torch.randn(b, HKV * G, 1, HD, device=dev, generator=gen).mul(2).bfloat16()
        kc = torch.randn(b, HKV, sk, HD, device=dev, generator=gen).to(torch.float8_e4m3fn)
        vc = torch.randn(b, HKV, sk, HD, device=dev, generator=gen).to(torch.float8_e4m3fn)
        ks = torch.exp2(torch.rand(HKV, device=dev, generator=gen) * 6 - 3)
        vs = torch.exp2(torch.rand(HKV, device=dev, generator=gen) * 6 - 3)
        kd, vd = reference.dequantize(kc, ks, 1), reference.dequantize(vc, vs, 1)
        want, wlse = reference.attention(q.double(), kd, vd)
        terms, _ = reference.attention(q.double(), kd, vd.abs())
        unit = terms.clamp(min=1.0)
        kw = dict(k_scale=ks, v_scale=vs)
        runs = [("rule", m.forward(q, kc, vc, **kw)), ("3 splits", m.forward_split(q, kc, vc, num_splits=3, **kw)),
                ("invariant", m.forward(q, kc, vc, batch_invariant=True, **kw))]
        if st is not None and sk > 1:
            span = -(-sk // st.BLOCK_N) * st.BLOCK_N
            assert st._geometry(b, HKV, 1, span, None, 0)[4] == st.SHAPE_TILE, "the shape tile is not taken"
            runs.append(("shape tile", st.forward(q, kc, vc, **kw)))
        for how, (o, lse) in runs:
            worst = max(worst, compare(f"out sk{sk} {how}", o.double() / unit, want / unit, **TOLERANCE["bf16"]))
            compare(f"lse sk{sk} {how}", lse, wlse, **LSE_TOLERANCE)
            n_checked += 1
        # two queries a sequence: 8 packed rows a tile (swapped dots where on), through the rule and 3 splits
        q2 = torch.randn(b, HKV * G, 2, HD, device=dev, generator=gen).mul(2).bfloat16()
        want2, wlse2 = reference.attention(q2.double(), kd, vd)
        terms2, _ = reference.attention(q2.double(), kd, vd.abs())
        for how, (o, lse) in (("2 queries", m.forward(q2, kc, vc, **kw)),
                              ("2 queries 3 splits", m.forward_split(q2, kc, vc, num_splits=3, **kw))):
            u2 = terms2.clamp(min=1.0)
            worst = max(worst, compare(f"out sk{sk} {how}", o.double() / u2, want2 / u2, **TOLERANCE["bf16"]))
            compare(f"lse sk{sk} {how}", lse, wlse2, **LSE_TOLERANCE)
            n_checked += 1
        if sk > 1:  # it must fail on the cache read without its scales
            wrong, _ = reference.attention(q.double(), kc.double(), vc.double())
            try:
                compare("no scales", runs[0][1][0].double() / unit, wrong / unit, **TOLERANCE["bf16"])
            except AssertionError:
                far.append(sk)
            else:
                raise AssertionError(f"sk {sk}: the result also matches the reference on the cache without scales")
    # batch invariance: each sequence alone, and in a batch, the same bits under batch_invariant=True
    inv = 0
    for sk, b in ((133, 5), (300, 3)) if CPU else ((1201, 5), (4099, 24)):
        q = torch.randn(b, HKV * G, 1, HD, device=dev, generator=gen).bfloat16()
        kc = torch.randn(b, HKV, sk, HD, device=dev, generator=gen).to(torch.float8_e4m3fn)
        vc = torch.randn(b, HKV, sk, HD, device=dev, generator=gen).to(torch.float8_e4m3fn)
        ks = torch.exp2(torch.rand(HKV, device=dev, generator=gen) * 2 - 1)
        o, lse = m.forward(q, kc, vc, k_scale=ks, v_scale=ks, batch_invariant=True)
        for i in (0, b // 2, b - 1):
            o1, l1 = m.forward(q[i:i + 1], kc[i:i + 1], vc[i:i + 1], k_scale=ks, v_scale=ks, batch_invariant=True)
            if not (torch.equal(o1[0], o[i]) and torch.equal(l1[0], lse[i])):
                raise AssertionError(f"batch_invariant=True: sequence {i} of {b} (Sk {sk}) alone is not its row's "
                                     "bits in the batch")
            inv += 1
    rule = ", ".join(f"b{b}k{sk // 1024}:{m._geometry(b, 8, 1, sk, None, 0)[3]}" for b, sk, p in SHAPES if not p)
    return (f"ok err {worst:.1e} ({n_checked} runs); fails without scales ({len(far)}/{len(far)}); invariant bits "
            f"{inv}/{inv}; splits {rule}")


def warm_phase(name):
    import torch
    try:
        note = check_candidate(name)
        if not CPU:  # its builds at the timed shapes' forms: one split (DIRECT) and several, Sk a multiple of 16
            m = module(name)
            q = torch.randn(2, 32, 1, 128, device="cuda").bfloat16()
            ks = torch.ones(8, device="cuda")
            kw = dict(k_scale=ks, v_scale=ks)
            if paged(name):
                kc = torch.zeros(2 * 256, 16, 8, 128, device="cuda", dtype=torch.float8_e4m3fn)
                kw.update(block_table=torch.randperm(512, device="cuda").to(torch.int32).view(2, 256),
                          seqlens_k=torch.full((2,), 4096, dtype=torch.int32, device="cuda"))
            else:
                kc = torch.zeros(2, 8, 4096, 128, device="cuda", dtype=torch.float8_e4m3fn)
            for n in (1, 3):
                m.forward_split(q, kc, kc, num_splits=n, **kw)
            m.forward(q, kc, kc, batch_invariant=True, **kw)
            if getattr(m, "SHAPE_TILE", None) is not None:  # the tile by shape at the timed shapes (b8 kv32k takes it)
                q8 = torch.randn(8, 32, 1, 128, device="cuda").bfloat16()
                k8 = torch.zeros(8, 8, 32768, 128, device="cuda", dtype=torch.float8_e4m3fn)
                assert m._geometry(8, 8, 1, 32768, None, 0)[4] == m.SHAPE_TILE
                m.forward(q8, k8, k8, **kw)
            torch.cuda.synchronize()
        where = ("paged16 " if paged(name) else "dense ") + ("(cpu)" if CPU else "odd lengths")
        emit("check", where, name, "-", None, note)
    except Exception as e:  # noqa: BLE001
        emit("check", "-", name, "-", None, f"ERROR {type(e).__name__}: {str(e)[:300]}")


def q3(xs):
    s = sorted(xs)
    if len(s) < 3:
        return f"{statistics.median(s):.3f}"
    qs = statistics.quantiles(s, n=4)
    return f"{statistics.median(s):.3f} [{qs[0]:.3f}-{qs[2]:.3f}]"


def time_phase():
    import torch

    from fagen.bench import cases, impls, timing
    from fagen.bench.cases import BenchOptions, CaseContext
    from fagen.bench.inputs import set_bytes
    from fagen.bench.workloads import kv_bytes
    from fagen.runtime import loader

    cases.SET_BUDGET = 8 << 30
    T0 = time.time()
    dev = torch.device(DEV)
    opts = BenchOptions(device=str(dev), warmup_ms=3.0, rep_ms=25.0)
    skip = set(filter(None, os.environ.get(ENV + "SKIP", "").split(",")))
    rng = random.Random(19 if ROUND == "A" else 1919)
    real_load = loader.load
    for b, sk, page in SHAPES:
        case = case_of(b, sk, page)
        names = [n for n in CANDS if n not in skip and paged(n) == bool(page)
                 and (not invariant(n) or (b, sk, page) in SUITE)]
        if "product" not in names and "paged product" not in names:
            continue
        if time.time() - T0 > PHASES["time"] - 2:
            emit("time", case.name, "-", "-", None, "skipped: the phase's time is short")
            continue
        try:
            # sets: the "loop" measure needs the other sets to hold the flush's 256 MB ([Note] L2 flush), so small
            # shapes take more than the suite's 3; the budget is raised from 4 GB for the 2 GB shapes' 3 sets
            n_sets = 1 if CPU else max(3, 1 + -(-timing._FLUSH_BYTES // set_bytes(case)))
            cc = CaseContext(case, dev, n_sets)
            ent = {}
            for n in names:
                try:
                    loader.load = lambda spec, n=n: module(n, spec)
                    ent[n] = impls.prepare_fagen(case, cc)
                finally:
                    loader.load = real_load
            ent["copy"] = impls.prepare_copy(case, cc)
            with torch.no_grad():
                for n in ent:  # one call each first: a build missed by the warm phase is not timed
                    ent[n].fn(cc.sets[0])
                got = {}
                for p in range(PASSES):
                    order = list(ent)
                    rng.shuffle(order)
                    for n in order:
                        got.setdefault(n, []).append(timing.time_prepared(ent[n], cc, opts)["ms"])
            nb = kv_bytes(case)
            for n in ent:
                r = [c / x for c, x in zip(got["copy"], got[n])]
                vs = [d / x for d, x in zip(got[default_of(n)] if n != "copy" else got[n], got[n])]
                mod = module(n) if n != "copy" else None
                geo = (0, 0, 0, 0) if mod is None else mod._geometry(
                    b, 8, 1, sk, (mod.INVARIANT_MIN_CHUNK, mod.INVARIANT_SPLITS) if invariant(n) else None, 0)
                splits = f"{geo[3]} sp n{geo[4][0] if len(geo) > 4 else mod.BLOCK_N}" if mod else "0"
                emit("time", case.name, n, f"{nb / statistics.median(got[n]) / 1e6:.0f}", statistics.median(got[n]),
                     json.dumps({"splits": splits, "copy": [round(x, 4) for x in r], "vs": [round(x, 4) for x in vs]}))
            del cc, ent
            if not CPU:
                torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001
            emit("time", case.name, "-", "-", None, f"ERROR {type(e).__name__}: {str(e)[:200]}")


def dry_run():
    """Each candidate's _decode_split built for sm_90 (the CPU): 1 split (DIRECT) and the split form."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from sm90 import ptxas
    PTR = {"Q": "*bf16", "K": "*fp8e4nv", "V": "*fp8e4nv", "Dst": "*fp32", "DstLse": "*fp32", "Out": "*bf16",
           "Lse": "*fp32", "Counter": "*i32", "KScale": "*fp32", "VScale": "*fp32", "SeqlensK": "*i32",
           "BlockTable": "*i32"}
    bad = 0
    for name in CANDS:
        if invariant(name):  # the same kernels as the name without "inv "
            continue
        spec, _ = source(name)
        m = module(name)
        fn = m._decode_split
        print(f"{name:20s} splits at " + ", ".join(f"b{b} kv{sk // 1024}k: {m._geometry(b, 8, 1, sk, None, 0)[3]}"
                                                   for b, sk, p in SHAPES if bool(p) == paged(name)), flush=True)
        tiles = [(m.BLOCK_N, m.NUM_WARPS, m.NUM_STAGES)]
        if getattr(m, "SHAPE_TILE", None) is not None:  # the tile by shape too
            tiles.append(m.SHAPE_TILE[:3])
        for (bn, nw, ns), direct in [(t, d) for t in tiles for d in (True, False)]:
            consts = dict(HEAD_DIM=128, BLOCK_D=128, HEAD_DIM_V=128, BLOCK_DV=128, ROWS=m.tile_rows(4),
                          BLOCK_N=bn, GQA=4, DOT=m.tile_rows(4) >= 16, DIRECT=direct, SPLITS_PER_SEQ=0, UPCAST=False,
                          ROWS32=3 if getattr(m, "PAGED_SAME_ROWS", False) else 1)
            sig, cx, attrs = {}, {}, {}
            for i, p in enumerate(fn.params):
                n = p.name
                if p.is_constexpr:
                    sig[n], cx[n] = "constexpr", consts[n]
                elif n == "seq_q":
                    sig[n], cx[n] = "constexpr", 1
                elif n in ("SeqlensQ", "TreeMask", "KTok", "VTok") or (n == "SeqlensK" and not paged(name)):
                    sig[n], cx[n] = "constexpr", None
                elif n in PTR:
                    sig[n] = PTR[n]
                    attrs[(i,)] = [["tt.divisibility", 16]]
                elif n in ("qk_scale", "k_scale", "v_scale"):
                    sig[n] = "fp32"
                else:
                    sig[n] = "i32"
                    if n.startswith("stride_") and n not in ("stride_qm", "stride_om", "stride_dm", "stride_tb",
                                                              "stride_tm", "stride_zb", "stride_zh", "stride_zn") \
                            or n in ("seq_k", "chunk"):
                        attrs[(i,)] = [["tt.divisibility", 16]]
            try:
                ck = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=cx, attrs=attrs),
                                    target=GPUTarget("cuda", 90, 128),
                                    options=dict(num_warps=nw, num_stages=ns))
                r = next(iter(ptxas(ck.asm["ptx"])[0].values()))
                smem = ck.metadata.shared
                by_regs = 65536 // (max(r.registers, 1) * 32 * nw)
                by_smem = (233472 - 1024) // (smem + 1024)
                loops = ""
                try:
                    sys.path.insert(0, os.path.join(ROOT, "lab"))
                    from pagedfp8_swap_decode import loop_sass  # the key loops' SASS (cuobjdump)
                    got = loop_sass(ck, bn, nw, "HMMA")
                    loops = "; ".join(f"loop {x['instructions']} SASS, {x['per_key']} a key" for x in got)
                    if "--ops" in sys.argv and got:  # the unmasked key loop's opcodes (the hot one)
                        loops += "\n    ops " + json.dumps(got[0]["top"])
                except Exception as e:  # noqa: BLE001
                    loops = f"(no SASS: {type(e).__name__})"
                print(f"{name:20s} direct={int(direct)} n{bn} w{nw} s{ns}: "
                      f"{r.registers} regs, {r.spill_stores + r.spill_loads} spill bytes, {smem // 1024} KB smem; "
                      f"an SM by regs {by_regs}, by smem {by_smem}; {loops}", flush=True)
            except Exception as e:  # noqa: BLE001
                bad += 1
                print(f"{name:20s} direct={int(direct)}: ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)
    return bad


def summary(rows):
    """The compact table: checks and errors, then a line a shape: copy GB/s, the default's share of copy, and each
    candidate's share of copy and speed against the default (per-pass ratios: median [quartiles]), its splits."""
    lines = [f"| {r[0]} | {r[1]} | {r[2]} | {r[5][:230]} |" for r in rows if r[0] != "time" or "ERROR" in r[5]
             or r[1] == "(left out)" or "skipped" in r[5]]
    by = {}
    for r in rows:
        if r[0] == "time" and r[5].startswith("{"):
            by.setdefault(r[1], {})[r[2]] = (r[3], json.loads(r[5]))
    for layout in (False, True):
        cands = [n for n in CANDS if paged(n) == layout and any(n in v for v in by.values())]
        if cands:
            lines += ["", "| shape | copy GB/s | " + " | ".join(cands) + " |", "|---|---:|" + "---|" * len(cands)]
            lines += [row(shape, got, cands) for shape, got in by.items() if any(n in got for n in cands)]
    return "\n".join(lines)


def row(shape, got, cands):
    if True:
        cells = []
        for n in cands:
            if n not in got:
                cells.append("-")
                continue
            gbs, d = got[n]
            cell = f"{gbs} GB/s {statistics.median(d['copy']):.3f} copy, {d['splits']}"
            if n != default_of(n):
                cell += f"; x{q3(d['vs'])}"
            cells.append(cell)
        return f"| {shape} | {got.get('copy', ('-',))[0]} | " + " | ".join(cells) + " |"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--round", default=None)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--phase")
    ap.add_argument("--which")
    a, _ = ap.parse_known_args()
    if a.round:
        os.environ[ENV + "ROUND"] = a.round
    if a.dry_run:
        sys.exit(1 if dry_run() else 0)
    if a.phase == "warm":
        warm_phase(a.which)
        return
    if a.phase == "time":
        time_phase()
        return
    t0 = time.time()
    env = child_env("/tmp/fagen-cache-gpu-fp8dec-s21", ROOT)
    env[ENV + "ROUND"] = ROUND
    if CPU:  # the phases' CPU test: the interpreter in the children too
        env["TRITON_INTERPRET"] = "1"
    rows, logs, lock = [], [], threading.Lock()
    import torch
    print(f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU'}; round {ROUND}", flush=True)

    def one(which):
        rc, lines = run_child(os.path.abspath(__file__), "warm", PHASES["warm"], env,
                              lambda line: line.startswith("ROW ") or print(line, end="", flush=True),
                              extra=("--which", which))
        with lock:
            got = [json.loads(line[4:]) for line in lines if line.startswith("ROW ")]
            rows.extend(got)
            logs.extend(lines)
            if rc != 0 or not got:
                rows.append(["check", "-", which, "-", "", f"ERROR rc={rc}"])

    print(f"[{time.time() - t0:5.1f}s] phase warm (parallel, timeout {PHASES['warm']}s)", flush=True)
    ths = [threading.Thread(target=one, args=(n,)) for n in CANDS if not invariant(n)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    ok = {r[2] for r in rows if r[0] == "check" and r[5].startswith("ok")}
    ok |= {n for n in CANDS if invariant(n) and n[4:] in ok}  # the same kernels: their checks ran batch_invariant
    bad = [n for n in CANDS if n not in ok]
    if "product" in bad or "paged product" in bad:
        rows.append(["time", "-", "-", "-", "", "ERROR the product failed its checks: nothing timed"])
    else:
        if bad:
            env[ENV + "SKIP"] = ",".join(bad)
            rows.append(["time", "(left out)", ", ".join(bad), "-", "", "not checked ok in the warm phase"])
        print(f"[{time.time() - t0:5.1f}s] phase time (timeout {PHASES['time']}s)", flush=True)
        rc, lines = run_child(os.path.abspath(__file__), "time", PHASES["time"], env,
                              lambda line: line.startswith("ROW ") or print(line, end="", flush=True))
        rows += [json.loads(line[4:]) for line in lines if line.startswith("ROW ")]
        logs += lines
        if rc != 0:
            rows.append(["time", "(phase)", "-", "-", "", f"ERROR rc={rc}"])
    text = "\n".join(["| section | case | impl | GB/s | ms | note |", "|---|---|---|---|---|---|"]
                     + ["| " + " | ".join(r) + " |" for r in rows])
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "gpu_fp8dec_s21.md"), "w") as f:
            f.write(text + "\n\n" + "".join(logs))
    print("\n" + summary(rows), flush=True)
    failed = [r for r in rows if "ERROR" in r[5]]
    print(f"done in {time.time() - t0:.0f} s; {len(failed)} failures", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
