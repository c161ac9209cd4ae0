"""MLA 192/128 decode, twenty-third session (issue 27; docs/serving.md "MLA 192/128 decode (twenty-third session)"):
the Triton decode (d_qk 192, d_v 128, Hq 16 over one KV head, Sq 1, bf16, dense cache) against cuDNN through SDPA, on
the serving suite's rows decode-mla-d192v128-h16-kv{4k,8k,32k}-b{128,64,32} and b1 / b8 shapes, each over the copy of
its bytes in the suite's measure (the bench's time_prepared, "loop", the suite's own row functions: fagen's
impls.prepare_fagen with the candidate's module, cuDNN's peers.sdpa_preparer("sdpa-cudnn")).

    PYTHONPATH=$PWD python3 scripts/gpu_mla192dec_s23.py [--round A|B] [--dry-run]

The candidates are the product's spec with other tiles (block_n, num_warps, num_stages) and its render with
substitutions (PROGRAMS_PER_SM: the split rule's programs an SM, so its split counts).

Round A (H200, 05:35 UTC, at c8a149e0; docs/serving.md): the product's render at other tiles and programs an SM.
Round B: the product's own render with MLA192_DECODE off (the s22 product) against it on at round A's three best
tiles (m32n32w4s3 at 3 an SM, the branch's default then; m32n64w4s3 and m32n32w4s4 at 2), 5 passes, on the suite's
rows, b1 / b8 / b16 / b128 and the suite's Hq 128 Sq 2 causal row (no cuDNN there: the suite runs fagen alone on it).
Round B ran (H200, about 06:00 UTC, at ea21c362, 42 s): m32n64w4s3 at 2 won 7 of 9 shapes and is the default since.

--dry-run (the CPU): builds every candidate's _decode_split for sm_90 (ptxas registers, spills, shared memory, the
key loop's SASS a key) and prints each candidate's split count at every timed shape.
Phases, each a child process with a timeout (scripts/_phases.py):
1. warm (children in parallel, one per candidate): checks against float64 (B 3, Sk 77 and 1201, not multiples of the
   block; GQA 16; through the rule, 3 and 7 forced splits (more splits than blocks: empty splits), padding lengths
   with an empty sequence (seqlens_k 0: out 0, lse -inf), batch_invariant=True), then its builds at the timed forms.
2. time (one child): every shape, its candidates, cuDNN and the copy of its bytes, PASSES shuffled passes; per pass
   candidate / copy, product / candidate and cuDNN / candidate (speed over cuDNN's), median [quartiles].
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
ENV = "GPU_MLA192DEC_S23_"
ROUND = os.environ.get(ENV + "ROUND", "A")
if "--round" in sys.argv[:-1]:  # before the candidates below are chosen (the children get it by the environment)
    ROUND = os.environ[ENV + "ROUND"] = sys.argv[sys.argv.index("--round") + 1]
PHASES = {"warm": 27, "time": 19} if ROUND == "A" else {"warm": 19, "time": 23}
if os.environ.get(ENV + "PHASES"):  # "name:seconds,..."
    PHASES = {n: float(t) for n, t in (p.split(":") for p in os.environ[ENV + "PHASES"].split(","))}
PASSES = 3 if ROUND == "A" else 5
CPU = os.environ.get(ENV + "CPU") == "1"  # a CPU test of the phases: TRITON_INTERPRET=1, small shapes
DEV = "cpu" if CPU else "cuda"
HKV, G, HD, HDV = 1, 16, 192, 128


def pps(n):  # the split rule's programs an SM
    return {r"^PROGRAMS_PER_SM = \d+$": f"PROGRAMS_PER_SM = {n}"}


# name: (spec fields over the product's, substitutions in its render). The product (main at b2a3fb7f, rendered with
# MLA192_DECODE off): m32n32w4s2 (the wide decode default), the rule at 2 programs an SM.
CANDS = {
    "product": ({}, {}),
    "pps4": ({}, pps(4)),
    "pps5": ({}, pps(5)),
    "pps4 max256": ({}, {**pps(4), r"^MAX_SPLITS = 128$": "MAX_SPLITS = 256"}),  # b1: 1024 blocks of 32 keys
    "n32s3 pps3": (dict(num_stages=3), pps(3)),
    "n32s3 pps4": (dict(num_stages=3), pps(4)),
    "n64s2 pps3": (dict(block_n=64), pps(3)),
    "n32w2s3 pps3": (dict(num_warps=2, num_stages=3), pps(3)),
    "n16w1s4 pps5": (dict(block_n=16, num_warps=1, num_stages=4), pps(5)),
    "n64s3": (dict(block_n=64, num_stages=3), {}),
    "n32s4": (dict(num_stages=4), {}),
}
BASE = "product"  # the baseline of the per-pass ratios
if ROUND != "A":
    # round B: the product's own render with MLA192_DECODE off (the s22 product, m32n32w4s2 at 2 an SM) and on at the
    # round A winners (tile, programs an SM); the branch's default was (32, 4, 3, 3) then, (64, 4, 3, 2) since round B
    BASE = "off (s22)"
    CANDS = {BASE: ({}, {"lever": None}), "lever n32s3p3": ({}, {"lever": (32, 4, 3, 3)}),
             "lever n64s3p2": ({}, {"lever": (64, 4, 3, 2)}), "lever n32s4p2": ({}, {"lever": (32, 4, 4, 2)})}
if os.environ.get(ENV + "CANDS"):
    CANDS = {k: CANDS[k] for k in os.environ[ENV + "CANDS"].split(",")}
# the timed shapes (batch, KV length[, query heads, queries a sequence, mask]): the suite's three rows first, then b1 /
# b8; round B adds b16 / b128 kv8k and the suite's compute-bound row (Hq 128 over one KV head, Sq 2, causal)
SHAPES = [(128, 4096), (64, 8192), (32, 32768), (1, 32768), (8, 32768), (8, 4096), (32, 4096)]
if ROUND != "A":
    SHAPES = [(128, 4096), (64, 8192), (32, 32768), (1, 32768), (8, 32768), (16, 8192), (128, 8192),
              (32, 8192, 128, 2, "causal"), (32, 4096)]
if CPU:
    SHAPES = [(2, 256), (4, 512), (2, 256, 32, 2, "causal")]
SUITE = {(128, 4096): "decode-mla-d192v128-h16-kv4k-b128", (64, 8192): "decode-mla-d192v128-h16-kv8k-b64",
         (32, 32768): "decode-mla-d192v128-h16-kv32k-b32",
         (32, 8192, 128, 2, "causal"): "decode-mla-d192v128-h128-sq2-kv8k-b32"}
PEER = "sdpa-cudnn"


def emit(section, case, impl, value, ms, note=""):
    print("ROW " + json.dumps([section, case, impl, value, "" if ms is None else f"{ms:.4f}", note]), flush=True)


def base_spec():
    import fagen
    return fagen.KernelSpec(head_dim=HD, head_dim_v=HDV, gqa=G, dtype="bf16", mask="none", kind="decode")


LEVER = "lever"  # a candidate's substitutions key: the product's own render with MLA192_DECODE on at this tile


def cand_spec(name, spec=None):
    fields, subs = CANDS[name]
    # the lever's tile ([Note] MLA 192/128 decode tiles in fagen/backends/triton.py); off (and round A's candidates,
    # the s22 product's render with fields and substitutions): the wide decode default m32n32w4s2 at 2 an SM
    bn, nw, ns, _ = subs.get(LEVER) or (32, 4, 2, 2)
    fields = {"block_n": bn, "num_warps": nw, "num_stages": ns, **fields}
    return dataclasses.replace(spec or base_spec(), **fields)


def source(name, spec=None):
    """(spec, source): the render with MLA192_DECODE on at the candidate's lever tile, else off, and its
    substitutions."""
    import fagen
    from fagen.backends import triton as triton_backend
    spec = cand_spec(name, spec)
    subs = dict(CANDS[name][1])
    tile = subs.pop(LEVER, None)
    was = triton_backend.MLA192_DECODE, triton_backend.MLA192_DECODE_TILE
    triton_backend.MLA192_DECODE, triton_backend.MLA192_DECODE_TILE = tile is not None, tile or was[1]
    try:
        src = fagen.generate(spec)
    finally:
        triton_backend.MLA192_DECODE, triton_backend.MLA192_DECODE_TILE = was
    pps = tile[3] if tile else 2
    if spec.mask in ("none", "padding", "causal") and f"\nPROGRAMS_PER_SM = {pps}\n" not in src:
        raise AssertionError(f"{name}: the render does not count {pps} programs an SM")
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
        _MODS[key] = load_source(src, f"{s.name}_s23_{abs(hash(name)) % 10**8}")
    return _MODS[key]


def splits_at(m, b, sk, hq=16, sq=1, mask="none"):
    return m._geometry(b, HKV, sq, sk, None, 0)[3]


def case_of(b, sk, hq=16, sq=1, mask="none"):
    from fagen.bench import workloads
    from fagen.bench.workloads import make_case
    kv = f"{sk // 1024}k" if sk >= 1024 else str(sk)
    name = SUITE.get((b, sk, hq, sq, mask) if hq != 16 else (b, sk), f"mla192-h{hq}-sq{sq}-kv{kv}-b{b}")
    c = make_case(name, head_dim=HD, head_dim_v=HDV, mask=mask, batch=b, heads_q=hq, heads_kv=1, seq_q=sq,
                  seq_k=sk, peers=hq == 16)
    workloads.RELATIVE_TARGETS.setdefault(name, (("copy", 0.95),))
    return c


def check_candidate(name):
    """float64 at odd lengths (GQA 16, one KV head) through the rule, forced splits, padding lengths with an empty
    sequence and batch_invariant=True; invariant bits alone and in a batch."""
    import torch

    from fagen.verify import reference
    from fagen.verify.tolerances import LSE_TOLERANCE, TOLERANCE, compare
    dev = DEV
    m = module(name)
    gen = torch.Generator(device=dev).manual_seed(23)
    worst, n_checked = 0.0, 0
    for sk in ((77, 133) if CPU else (77, 1201)):
        b = 3
        q = torch.randn(b, HKV * G, 1, HD, device=dev, generator=gen).bfloat16()
        k = torch.randn(b, HKV, sk, HD, device=dev, generator=gen).bfloat16()
        v = torch.randn(b, HKV, sk, HDV, device=dev, generator=gen).bfloat16()
        want, wlse = reference.attention(q.double(), k.double(), v.double())
        runs = [("rule", m.forward(q, k, v)), ("3 splits", m.forward_split(q, k, v, num_splits=3)),
                ("7 splits", m.forward_split(q, k, v, num_splits=7)),
                ("invariant", m.forward(q, k, v, batch_invariant=True))]
        for how, (o, lse) in runs:
            worst = max(worst, compare(f"out sk{sk} {how}", o.double(), want, **TOLERANCE["bf16"]))
            compare(f"lse sk{sk} {how}", lse, wlse, **LSE_TOLERANCE)
            n_checked += 1
    # padding lengths, one empty: the padding spec of the candidate's tiles (same render substitutions)
    import fagen
    spec_p = cand_spec(name, fagen.KernelSpec(head_dim=HD, head_dim_v=HDV, gqa=G, dtype="bf16", mask="padding",
                                              kind="decode"))
    mp = module(name, spec_p)
    sk = 133 if CPU else 1201
    lens = (sk, 0, 50) if CPU else (sk, 0, 777)
    q = torch.randn(3, G, 1, HD, device=dev, generator=gen).bfloat16()
    k = torch.randn(3, HKV, sk, HD, device=dev, generator=gen).bfloat16()
    v = torch.randn(3, HKV, sk, HDV, device=dev, generator=gen).bfloat16()
    lq = torch.ones(3, dtype=torch.int32, device=dev)
    lk = torch.tensor(lens, dtype=torch.int32, device=dev)
    for how, (o, lse) in (("padding rule", mp.forward(q, k, v, seqlens_q=lq, seqlens_k=lk)),
                          ("padding 5 splits", mp.forward_split(q, k, v, num_splits=5, seqlens_q=lq, seqlens_k=lk))):
        for i, n in enumerate(lens):
            if n == 0:
                if not (torch.all(o[i] == 0) and torch.all(lse[i] == float("-inf"))):
                    raise AssertionError(f"{how}: the empty sequence is not out 0, lse -inf")
                continue
            want, wlse = reference.attention(q[i:i + 1].double(), k[i:i + 1, :, :n].double(),
                                             v[i:i + 1, :, :n].double())
            worst = max(worst, compare(f"out {how} {i}", o[i:i + 1].double(), want, **TOLERANCE["bf16"]))
            compare(f"lse {how} {i}", lse[i:i + 1], wlse, **LSE_TOLERANCE)
        n_checked += 1
    # the compute-bound form: Hq 128 over one KV head, 2 queries a sequence, causal (bottom-right), several row tiles
    spec_c = cand_spec(name, fagen.KernelSpec(head_dim=HD, head_dim_v=HDV, gqa=128 if not CPU else 32, dtype="bf16",
                                              mask="causal", kind="decode"))
    mc = module(name, spec_c)
    gq = spec_c.gqa
    q = torch.randn(2, gq, 2, HD, device=dev, generator=gen).bfloat16()
    k = torch.randn(2, HKV, sk, HD, device=dev, generator=gen).bfloat16()
    v = torch.randn(2, HKV, sk, HDV, device=dev, generator=gen).bfloat16()
    want, wlse = reference.attention(q.double(), k.double(), v.double(), mask="causal")
    for how, (o, lse) in (("causal h%d sq2 rule" % gq, mc.forward(q, k, v)),
                          ("causal h%d sq2 3 splits" % gq, mc.forward_split(q, k, v, num_splits=3))):
        worst = max(worst, compare(f"out {how}", o.double(), want, **TOLERANCE["bf16"]))
        compare(f"lse {how}", lse, wlse, **LSE_TOLERANCE)
        n_checked += 1
    # batch invariance: each sequence alone, and in a batch, the same bits under batch_invariant=True
    inv = 0
    for sk, b in ((133, 5),) if CPU else ((1201, 5), (4099, 24)):
        q = torch.randn(b, G, 1, HD, device=dev, generator=gen).bfloat16()
        k = torch.randn(b, HKV, sk, HD, device=dev, generator=gen).bfloat16()
        v = torch.randn(b, HKV, sk, HDV, device=dev, generator=gen).bfloat16()
        o, lse = m.forward(q, k, v, batch_invariant=True)
        for i in (0, b // 2, b - 1):
            o1, l1 = m.forward(q[i:i + 1], k[i:i + 1], v[i:i + 1], batch_invariant=True)
            if not (torch.equal(o1[0], o[i]) and torch.equal(l1[0], lse[i])):
                raise AssertionError(f"batch_invariant=True: sequence {i} of {b} (Sk {sk}) alone is not its row's "
                                     "bits in the batch")
            inv += 1
    rule = ", ".join(f"b{s[0]}k{s[1] // 1024}:{splits_at(m, *s)}" for s in SHAPES if len(s) == 2)
    return f"ok err {worst:.1e} ({n_checked} runs); invariant bits {inv}/{inv}; splits {rule}"


def warm_phase(name):
    import torch
    try:
        note = check_candidate(name)
        if not CPU:  # its builds at the timed shapes' forms: one split (DIRECT) and several, Sk a multiple of 16
            m = module(name)
            q = torch.randn(2, G, 1, HD, device="cuda").bfloat16()
            k = torch.zeros(2, HKV, 4096, HD, device="cuda").bfloat16()
            v = torch.zeros(2, HKV, 4096, HDV, device="cuda").bfloat16()
            for n in (1, 3):
                m.forward_split(q, k, v, num_splits=n)
            torch.cuda.synchronize()
        emit("check", "odd lengths" if not CPU else "(cpu)", name, "-", None, note)
    except Exception as e:  # noqa: BLE001
        emit("check", "-", name, "-", None, f"ERROR {type(e).__name__}: {str(e)[:300]}")


def peer_phase():
    """cuDNN through SDPA on the suite's case, checked by the bench's own check (float64 reference)."""
    import torch

    from fagen.bench import peers
    from fagen.bench.cases import CaseContext
    from fagen.bench.check import check
    try:
        case = case_of(*SHAPES[0]) if not CPU else None
        if case is None:
            emit("check", "-", PEER, "-", None, "ok (cpu: no cuDNN)")
            return
        small = case_of(4, 1201)
        cc = CaseContext(small, torch.device(DEV), 1)
        prep = peers.sdpa_preparer(PEER)(small, cc)
        status, msg, err = check(PEER, prep, cc)
        if status != "ok":
            raise AssertionError(f"{status}: {msg}")
        emit("check", small.name, PEER, "-", None, f"ok err {err:.1e}")
    except Exception as e:  # noqa: BLE001
        emit("check", "-", PEER, "-", None, f"ERROR {type(e).__name__}: {str(e)[:300]}")


def q3(xs):
    s = sorted(xs)
    if len(s) < 3:
        return f"{statistics.median(s):.3f}"
    qs = statistics.quantiles(s, n=4)
    return f"{statistics.median(s):.3f} [{qs[0]:.3f}-{qs[2]:.3f}]"


def time_phase():
    import torch

    from fagen.bench import cases, impls, peers, timing
    from fagen.bench.cases import BenchOptions, CaseContext
    from fagen.bench.inputs import set_bytes
    from fagen.bench.workloads import kv_bytes
    from fagen.runtime import loader

    cases.SET_BUDGET = 8 << 30
    T0 = time.time()
    dev = torch.device(DEV)
    opts = BenchOptions(device=str(dev), warmup_ms=3.0, rep_ms=25.0)
    skip = set(filter(None, os.environ.get(ENV + "SKIP", "").split(",")))
    rng = random.Random(23 if ROUND == "A" else 2323)
    real_load = loader.load
    for shp in SHAPES:
        case = case_of(*shp)
        names = [n for n in CANDS if n not in skip]
        if BASE not in names:
            continue
        if time.time() - T0 > PHASES["time"] - 2:
            emit("time", case.name, "-", "-", None, "skipped: the phase's time is short")
            continue
        try:
            n_sets = 1 if CPU else max(3, 1 + -(-timing._FLUSH_BYTES // set_bytes(case)))
            cc = CaseContext(case, dev, n_sets)
            ent, mods = {}, {}
            for n in names:
                try:
                    loader.load = lambda spec, n=n: mods.setdefault(n, module(n, spec))
                    ent[n] = impls.prepare_fagen(case, cc)
                finally:
                    loader.load = real_load
            if not CPU and PEER not in skip and case.peers:
                ent[PEER] = peers.sdpa_preparer(PEER)(case, cc)
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
                vs = [d / x for d, x in zip(got[BASE], got[n])]
                pr = [d / x for d, x in zip(got[PEER], got[n])] if PEER in got else []
                mod = mods.get(n)
                splits = f"{splits_at(mod, *shp)} sp n{mod.BLOCK_N}" if mod else "-"
                emit("time", case.name, n, f"{nb / statistics.median(got[n]) / 1e6:.0f}", statistics.median(got[n]),
                     json.dumps({"splits": splits, "copy": [round(x, 4) for x in r], "vs": [round(x, 4) for x in vs],
                                 "peer": [round(x, 4) for x in pr]}))
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
    PTR = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "Dst": "*fp32", "DstLse": "*fp32", "Out": "*bf16",
           "Lse": "*fp32", "Counter": "*i32", "SeqlensK": "*i32"}
    bad = 0
    for name in CANDS:
        m = module(name)
        fn = m._decode_split
        print(f"{name:14s} splits at " + ", ".join(f"b{s[0]} kv{s[1] // 1024}k: {splits_at(m, *s)}"
                                                   for s in SHAPES if len(s) == 2), flush=True)
        bn, nw, ns = m.BLOCK_N, m.NUM_WARPS, m.NUM_STAGES
        for direct, rows in ((True, G), (False, G), (False, 32)):  # 32 rows: the Hq 128 Sq 2 row's tiles
            consts = dict(HEAD_DIM=HD, BLOCK_D=256, HEAD_DIM_V=HDV, BLOCK_DV=128, ROWS=rows,
                          BLOCK_N=bn, GQA=G, DOT=True, DIRECT=direct, SPLITS_PER_SEQ=0, UPCAST=False)
            sig, cx, attrs = {}, {}, {}
            for i, p in enumerate(fn.params):
                n = p.name
                if p.is_constexpr:
                    sig[n], cx[n] = "constexpr", consts[n]
                elif n == "seq_q":
                    sig[n], cx[n] = "constexpr", 1
                elif n in ("SeqlensQ", "TreeMask", "SeqlensK", "KScale", "VScale", "KTok", "VTok"):
                    sig[n], cx[n] = "constexpr", None
                elif n in PTR:
                    sig[n] = PTR[n]
                    attrs[(i,)] = [["tt.divisibility", 16]]
                elif n in ("qk_scale", "k_scale", "v_scale"):
                    sig[n] = "fp32"
                else:
                    sig[n] = "i32"
                    if n.startswith("stride_") and n not in ("stride_qm", "stride_om", "stride_dm", "stride_tb",
                                                              "stride_tm") or n in ("seq_k", "chunk"):
                        attrs[(i,)] = [["tt.divisibility", 16]]
            try:
                ck = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=cx, attrs=attrs),
                                    target=GPUTarget("cuda", 90, 128), options=dict(num_warps=nw, num_stages=ns))
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
                    if "--ops" in sys.argv and got:
                        loops += "\n    ops " + json.dumps(got[0]["top"])
                except Exception as e:  # noqa: BLE001
                    loops = f"(no SASS: {type(e).__name__})"
                print(f"{name:14s} direct={int(direct)} rows {rows} n{bn} w{nw} s{ns}: "
                      f"{r.registers} regs, {r.spill_stores + r.spill_loads} spill bytes, {smem // 1024} KB smem; "
                      f"an SM by regs {by_regs}, by smem {by_smem}; {loops}", flush=True)
            except Exception as e:  # noqa: BLE001
                bad += 1
                print(f"{name:14s} direct={int(direct)}: ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)
    return bad


def summary(rows):
    """The compact table: checks and errors, then a line a shape and candidate: GB/s, share of copy, speed against
    the product and against cuDNN (per-pass ratios: median [quartiles]), its splits."""
    lines = [f"| {r[0]} | {r[1]} | {r[2]} | {r[5][:200]} |" for r in rows if r[0] != "time" or "ERROR" in r[5]
             or r[1] == "(left out)" or "skipped" in r[5]]
    by = {}
    for r in rows:
        if r[0] == "time" and r[5].startswith("{"):
            by.setdefault(r[1], {})[r[2]] = (r[3], json.loads(r[5]))
    for shape, got in by.items():
        lines += ["", f"{shape}: copy {got.get('copy', ('-',))[0]} GB/s" + (
            f", cuDNN {got[PEER][0]} GB/s {statistics.median(got[PEER][1]['copy']):.3f} copy" if PEER in got else "")]
        for n, (gbs, d) in got.items():
            if n in (PEER, "copy"):
                continue
            cell = f"  {n:14s} {gbs:>5s} GB/s {statistics.median(d['copy']):.3f} copy {d['splits']:>6s}"
            if n != BASE:
                cell += f"; x{q3(d['vs'])} base"
            if d["peer"]:
                cell += f"; x{q3(d['peer'])} cuDNN"
            lines.append(cell)
    return "\n".join(lines)


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
        if a.which == PEER:
            peer_phase()
        else:
            warm_phase(a.which)
        return
    if a.phase == "time":
        time_phase()
        return
    t0 = time.time()
    env = child_env("/tmp/fagen-cache-gpu-mla192dec-s23", ROOT)
    env[ENV + "ROUND"] = ROUND
    if CPU:
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
    ths = [threading.Thread(target=one, args=(n,)) for n in [*CANDS, PEER]]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    ok = {r[2] for r in rows if r[0] == "check" and r[5].startswith("ok")}
    bad = [n for n in [*CANDS, PEER] if n not in ok]
    if BASE in bad:
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
        with open(os.path.join(out, "gpu_mla192dec_s23.md"), "w") as f:
            f.write(text + "\n\n" + "".join(logs))
    print("\n" + summary(rows), flush=True)
    failed = [r for r in rows if "ERROR" in r[5]]
    print(f"done in {time.time() - t0:.0f} s; {len(failed)} failures", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
