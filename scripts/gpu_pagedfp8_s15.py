"""Paged fp8 KV decode, fifteenth session (issue 27; docs/serving.md "Paged fp8 KV decode (fifteenth session)"):
the paged row decode-d128-kv8k-b32-fp8-paged16 (0.92-0.93x of a copy of its bytes, fourteenth session) against
candidates that put more programs (and so more loads in flight) on each SM: smaller tiles whose registers and shared
memory let 3-4 programs share an SM, with the split rule's PROGRAMS_PER_SM raised to match (so b32 takes 2-3 splits),
and the default tile with forced splits.

    PYTHONPATH=$PWD python3 scripts/gpu_pagedfp8_s15.py      # < 60 s on an H100; $OUTX/table.txt
    GPU_PAGEDFP8_S15_DRY=1 PYTHONPATH=$PWD python3 scripts/gpu_pagedfp8_s15.py   # the CPU interpreter, tiny shapes

sm_90 builds on the CPU (lab/pagedfp8_s15_sm90.py, triton 3.6, e4m3 per-head scales): n128w8s3 (the default) 128
registers, 104 KB (2 programs an SM); n64w4s4 128, 70 KB (3); n64w4s3 128, 54 KB (4); n32w4s6 96, 53 KB (4).

Candidates: text replacements on the paged fp8 render plus tile overrides (CANDS; GPU_PAGEDFP8_S15_CANDS picks a
comma-separated subset). Phases, each a child process with a timeout:
1. check: each candidate at page 16 against float64 on the dequantized cache, 28 sequences of 1..1200 keys (no
   multiple of a page or a key tile), per-head scales, through the candidate's split rule; table entries past each
   sequence's pages pointing outside the cache; it must FAIL against the reference on the cache read as bf16 and
   without its scales. Warms the builds of the time phase.
2. time: the serving bench's paged row (its make_inputs sets, its float64 check, prepare_fagen with the candidate's
   module in place of fagen.load) and its copy reference (prepare_copy), each timed by the bench's time_prepared
   under L2_FLUSH "loop" and back to back, PASSES passes, the order shuffled each pass (copy included); per pass
   fagen / copy of that pass; the median and the spread (min-max) of the per-pass ratios. Then other paged shapes
   back to back beside a copy of the same bytes, one set, 3 shuffled passes.
Diagnostics in the time phase (not attention; GPU_PAGEDFP8_S15_GATHER / _GLUON=0 drop them): K's pages gathered
whole by index_select (the copy's traffic, random 16 KB pages), in the table's order and sorted; the row's reads
alone by lab/pagedfp8_gather_read.py (Gluon cp.async gathers, the product's grid and 128-byte rows, no dots), at
a few (block_n, stages, warps), checked against torch's sums of the same words.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/, for _phases
from _phases import child_env, run_phase as run_child  # noqa: E402

DRY = os.environ.get("GPU_PAGEDFP8_S15_DRY") == "1"
if DRY:
    os.environ.setdefault("TRITON_INTERPRET", "1")
PHASES = {"check": 22, "time": 32} if not DRY else {"check": 1800, "time": 1800}
if os.environ.get("GPU_PAGEDFP8_S15_PHASES"):  # "name:seconds,..."
    PHASES = {n: float(t) for n, t in (p.split(":") for p in os.environ["GPU_PAGEDFP8_S15_PHASES"].split(","))}
ROUND = os.environ.get("GPU_PAGEDFP8_S15_ROUND", "B")
PASSES = 1 if DRY else (5 if ROUND == "A" else 6)
ORDERED = os.environ.get("GPU_PAGEDFP8_S15_ORDERED", "0") == "1"  # time the default on its pages in order too
SPLIT_CHECKS = (3,)  # forward_split counts checked beside the rule (a non-DIRECT build: the merge path)
GLUON_READ = [] if os.environ.get("GPU_PAGEDFP8_S15_GLUON", "1") != "1" else [  # (block_n, stages, warps, heads a
    # program, splits, pages sorted): one head's 128-byte rows as the product; all 8 heads' 1 KB rows, 8 splits
    (64, 4, 4, 1, 1, False), (128, 3, 8, 1, 1, False), (16, 3, 4, 8, 8, False), (64, 4, 4, 1, 1, True)]
if GLUON_READ and ROUND != "A":  # round B: how deep a ring the reads need (bytes in flight a program: (s - 1) x 2n x
    # 128): 48, 16, 16, 32 KB; the head of round A again
    GLUON_READ = [(64, 4, 4, 1, 1, False), (64, 2, 4, 1, 1, False), (32, 3, 4, 1, 1, False),
                  (128, 2, 8, 1, 1, False)]
GATHER = os.environ.get("GPU_PAGEDFP8_S15_GATHER", "1") == "1"  # the index_select diagnostics
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PPS = lambda n: [("\nPROGRAMS_PER_SM = 2\n", f"\nPROGRAMS_PER_SM = {n}\n")]  # noqa: E731
FORCE = lambda n: [("    if groups >= 0.8 * slots or blocks <= 1:\n        return 1\n",  # noqa: E731
                    f"    if blocks <= 1:\n        return 1\n    return min({n}, blocks)\n")]
T = lambda n, w, s: dict(block_n=n, num_warps=w, num_stages=s)  # noqa: E731
if ROUND == "A":
    CANDS = {"default": ([], {}), "n64w4s3 pps4": (PPS(4), T(64, 4, 3)), "splits 2": (FORCE(2), {}),
             "n32w4s6 pps4": (PPS(4), T(32, 4, 6)), "n64w4s4 pps3": (PPS(3), T(64, 4, 4)),
             "splits 4": (FORCE(4), {})}
else:  # round B: the default and round A's best candidate (which lost 3 points there), b128 beside
    CANDS = {"default": ([], {}), "n64w4s3 pps4": (PPS(4), T(64, 4, 3))}
if os.environ.get("GPU_PAGEDFP8_S15_CANDS"):
    CANDS = {k: CANDS[k] for k in os.environ["GPU_PAGEDFP8_S15_CANDS"].split(",")}


def emit(section, case, impl, value, ms, note=""):
    print("ROW " + json.dumps([section, case, impl, value, "" if ms is None else f"{ms:.4f}", note]), flush=True)


_MODS = {}


def module(name, spec=None):
    """The candidate's module: the paged fp8 spec (or `spec`, the bench row's) with its tiles and text replacements."""
    import dataclasses

    import fagen
    from fagen.runtime.loader import load_source

    text, tiles = CANDS[name]
    if spec is None:
        spec = fagen.KernelSpec(head_dim=32 if DRY else 128, gqa=4, dtype="bf16", kind="decode",
                                kv_dtype="fp8_e4m3", layout="paged", **(dict(block_n=16) if DRY else {}))
    if tiles and not DRY:
        spec = dataclasses.replace(spec, **tiles)
    key = (name, spec)
    if key not in _MODS:
        src = fagen.generate(spec)
        for old, new in text:
            if old not in src:
                raise RuntimeError(f"{old!r} not in the render")
            src = src.replace(old, new)
        _MODS[key] = load_source(src, f"{spec.name}_s15_{zlib.crc32(name.encode()):08x}")  # stable across phases
    return _MODS[key]


def check_phase():
    import torch

    from fagen.verify import reference
    from fagen.verify.tolerances import LSE_TOLERANCE, TOLERANCE, compare

    T0 = time.time()
    dev = "cpu" if DRY else "cuda"
    HD, HKV, G = (32, 4, 4) if DRY else (128, 8, 4)
    page = 16
    b = 3 if DRY else 28
    gen = torch.Generator(device=dev).manual_seed(13)
    lens = torch.randint(1, (100 if DRY else 1200) + 1, (b,), device=dev, generator=gen, dtype=torch.int32)
    lens[0], lens[1] = (100, 7) if DRY else (1000, 77)
    width = -(-(-(-int(lens.max()) // page) + 1) // 16) * 16  # a multiple of 16 as the bench rows' (Triton's
    # specialisation of the table's stride: the time phase's builds are this phase's)
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
    base = None
    for name in CANDS:
        if time.time() - T0 > PHASES["check"] - 4:
            emit("check", "page16 28 lengths", name, "-", None, "skipped: time budget")
            continue
        try:
            m = module(name)
            kw = dict(block_table=table, seqlens_k=lens, k_scale=ks, v_scale=vs)
            runs = [("rule", m.forward(q, kc, vc, **kw))] + [
                (f"{n} splits", m.forward_split(q, kc, vc, num_splits=n, **kw)) for n in SPLIT_CHECKS]
            out, lse = runs[0][1]
            worst, far = 0.0, []
            for i, (how, (o2, l2)) in ((i, r) for i in (0, 1, 2, b - 1) for r in runs[1:]):
                n = int(lens[i])
                want, wlse = reference.attention(q[i:i + 1].double(), gathered(kd, i, n), gathered(vd, i, n))
                terms, _ = reference.attention(q[i:i + 1].double(), gathered(kd, i, n), gathered(vd, i, n).abs())
                unit = terms.clamp(min=1.0)
                worst = max(worst, compare(f"out {i} {how}", o2[i:i + 1].double() / unit, want / unit,
                                           **TOLERANCE["bf16"]))
                compare(f"lse {i} {how}", l2[i:i + 1], wlse, **LSE_TOLERANCE)
            for i in (0, 1, 2, b - 1):
                n = int(lens[i])
                want, wlse = reference.attention(q[i:i + 1].double(), gathered(kd, i, n), gathered(vd, i, n))
                terms, _ = reference.attention(q[i:i + 1].double(), gathered(kd, i, n), gathered(vd, i, n).abs())
                unit = terms.clamp(min=1.0)
                got = out[i:i + 1].double() / unit
                worst = max(worst, compare(f"out {i}", got, want / unit, **TOLERANCE["bf16"]))
                compare(f"lse {i}", lse[i:i + 1], wlse, **LSE_TOLERANCE)
                if i == 0:
                    for what, k2, v2 in (("read as bf16", gathered(misread(kc), i, n), gathered(misread(vc), i, n)),
                                         ("no scales", gathered(kc.double(), i, n), gathered(vc.double(), i, n))):
                        wrong, _ = reference.attention(q[i:i + 1].double(), k2, v2)
                        try:
                            compare(what, got, wrong / unit, **TOLERANCE["bf16"])
                        except AssertionError:
                            far.append(what)
                        else:
                            raise AssertionError(f"the result also matches the reference on the cache {what}")
            same = ""
            if base is None:
                base = (out, lse)
            else:
                same = f"; bitwise as default: {torch.equal(out, base[0]) and torch.equal(lse, base[1])}"
            emit("check", f"page16 b{b} 1..1200 keys, bad entries, per-head", name, "-", None,
                 f"ok (rule {m._geometry(b, HKV, 1, width * page, None, q.device.index or 0)[3]} splits; "
                 f"{', '.join(map(str, SPLIT_CHECKS))}), "
                 f"err {worst:.1e}; fails as {' and as '.join(far)}{same}")
        except Exception as e:  # noqa: BLE001
            emit("check", "page16 28 lengths", name, "-", None, f"ERROR {type(e).__name__}: {str(e)[:200]}")


def time_phase():  # noqa: C901 - one phase
    import torch

    from fagen.bench import timing
    from fagen.bench.cases import BenchOptions, CaseContext
    from fagen.bench.check import check
    from fagen.bench import impls
    from fagen.bench.serving import serving_rows
    from fagen.bench.workloads import kv_bytes
    from fagen.runtime import loader

    T0 = time.time()
    dev = torch.device("cpu" if DRY else "cuda")
    row = {c.name: c for c in serving_rows(quick=DRY)}["decode-d128-kv8k-b32-fp8-paged16"]
    opts = BenchOptions(device=str(dev), **(dict(rep_ms=1, warmup_ms=1) if DRY else {}))
    cc = CaseContext(row, dev, opts.sets)
    nb = kv_bytes(row)
    entries = {}
    real_load = loader.load
    for name in CANDS:
        if time.time() - T0 > PHASES["time"] - 12:
            emit("time", row.name, name, "-", None, "skipped: time budget")
            continue
        try:
            loader.load = lambda spec, name=name: module(name, spec)
            prep = impls.prepare_fagen(row, cc)
            status, message, err = check("fagen", prep, cc)
            if status != "ok":
                raise AssertionError(f"check {status}: {message}")
            entries[name] = ([lambda s=s, p=prep: p.fn(s) for s in cc.sets], f"bench check ok, err {err:.1e}", prep)
        except Exception as e:  # noqa: BLE001
            emit("time", row.name, name, "-", None, f"ERROR {type(e).__name__}: {str(e)[:200]}")
        finally:
            loader.load = real_load
    if "default" in entries and ORDERED:  # the same pages read in order: each table row sorted (no check: other keys)
        import dataclasses
        srt = [dataclasses.replace(s, paged={**s.paged, "block_table": s.paged["block_table"].sort(1)[0].contiguous()})
               for s in cc.sets]
        p0 = entries["default"][2]
        entries["default, pages in order"] = ([lambda s=s: p0.fn(s) for s in srt], "not checked (other keys)",
                                              dataclasses.replace(p0, fn=lambda s, m={id(a): b for a, b in
                                                                                     zip(cc.sets, srt)}: p0.fn(m[id(s)])))
    if GLUON_READ:  # diagnostic: the row's reads alone, Gluon cp.async gathers into a STAGES-deep ring
        # (lab/pagedfp8_gather_read.py), checked against torch's sums of the same words
        import dataclasses
        sys.path.insert(0, os.path.join(ROOT, "lab"))
        import pagedfp8_gather_read as gr
        for bn, st, w, hh, sp, srt in GLUON_READ:
            label = f"Gluon reads only n{bn}s{st}w{w}" + (f", {hh} heads' rows, {sp} splits" if hh > 1 else "") \
                + (", pages ascending" if srt else "")
            if time.time() - T0 > PHASES["time"] - 20:
                emit("time", row.name, label, "-", None, "skipped: time budget")
                continue
            try:
                g = {}
                for s in cc.sets:
                    t = s.paged["block_table"].sort(1)[0].contiguous() if srt else s.paged["block_table"]
                    nk = t.shape[1] * s.paged["k_cache"].shape[1] if DRY else row.seq_k
                    g[id(s)] = (s.paged["k_cache"], s.paged["v_cache"], t, nk)
                s0 = cc.sets[0]
                kv = dict(block_n=bn, stages=st, num_warps=w, heads=hh, splits=sp)
                got = gr.sums(gr.gather_read(*g[id(s0)], **kv), s0.paged["k_cache"].shape[2])
                want = gr.reference(*g[id(s0)])
                if not torch.equal(got, want):
                    raise AssertionError(f"sums differ in {int((got != want).sum())} of {want.numel()} programs")
                fn = lambda s, g=g, kv=kv: gr.gather_read(*g[id(s)], **kv)  # noqa: E731
                entries[label] = ([lambda s=s, fn=fn: fn(s) for s in cc.sets],
                                  "diagnostic: not attention; sums checked against torch", dataclasses.replace(
                                      impls.prepare_copy(row, cc), fn=fn))
            except Exception as e:  # noqa: BLE001
                emit("time", row.name, label, "-", None, f"ERROR {type(e).__name__}: {str(e)[:200]}")
    cp = impls.prepare_copy(row, cc)
    entries["copy"] = ([lambda s=s: cp.fn(s) for s in cc.sets], "copy of the row's bytes", cp)
    if GATHER:  # diagnostic: K's pages gathered whole (16 KB: 16 keys x 8 heads) by index_select in the table's
        # order into a contiguous buffer: half the row's bytes read, half written, the copy's traffic; and sorted
        import dataclasses
        for label, srt in (("K pages gathered (index_select, table order)", False),
                           ("K pages gathered, each row's pages ascending", True)):
            g = {}
            for s in cc.sets:
                kk = s.paged["k_cache"].view(torch.uint8).reshape(s.paged["k_cache"].shape[0], -1)
                t = s.paged["block_table"]
                idx = (t.sort(1)[0] if srt else t).flatten().long().contiguous()
                g[id(s)] = (kk, idx, torch.empty(idx.numel(), kk.shape[1], dtype=torch.uint8, device=dev))
            fn = lambda s, g=g: torch.index_select(g[id(s)][0], 0, g[id(s)][1], out=g[id(s)][2])  # noqa: E731
            entries[label] = ([lambda s=s, fn=fn: fn(s) for s in cc.sets], "diagnostic: not attention",
                              dataclasses.replace(cp, fn=fn))

    def b2b(fns, n):
        if DRY:
            t = time.perf_counter()
            fns[0]()
            return (time.perf_counter() - t) * 1e3
        for f in fns:
            f()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for i in range(n):
            fns[i % len(fns)]()
        e.record()
        torch.cuda.synchronize()
        return s.elapsed_time(e) / n

    res = {}
    names = list(entries)
    rng = random.Random(15)
    emit("time", "L2_FLUSH", timing.L2_FLUSH, "-", None, f"{len(cc.sets)} sets; warm-up {opts.warmup_ms} ms, "
         f"{opts.rep_ms} ms of calls; {PASSES} passes, order shuffled")
    with torch.no_grad():
        for p in range(PASSES):
            order = names[:]
            rng.shuffle(order)
            if time.time() - T0 > PHASES["time"] - 9:
                break
            for name in order:
                ms = timing.time_prepared(entries[name][2], cc, opts)["ms"]  # the bench's own timing
                res.setdefault((name, "loop"), []).append(ms)
                res.setdefault((name, "b2b"), []).append(b2b(entries[name][0], 60))
    npass = min(len(v) for v in res.values()) if res else 0
    for name in names:
        if (name, "loop") not in res or ("copy", "loop") not in res:
            continue
        rl = [c / x for c, x in zip(res[("copy", "loop")][:npass], res[(name, "loop")][:npass])]
        rb = [c / x for c, x in zip(res[("copy", "b2b")][:npass], res[(name, "b2b")][:npass])]
        ml = statistics.median(res[(name, "loop")][:npass])
        emit("time", row.name, name, f"{nb / ml / 1e6:.0f} GB/s", ml,
             f"loop fagen/copy median {statistics.median(rl):.3f} spread {min(rl):.3f}-{max(rl):.3f} "
             f"(passes {[round(x, 3) for x in rl]}); b2b median {statistics.median(rb):.3f} "
             f"spread {min(rb):.3f}-{max(rb):.3f}; {entries[name][1]}")
    # other paged shapes, back to back only (one set; no bench check: the check phase covers the candidates' values)
    from fagen.bench.workloads import make_case
    extra = [("b32 kv32k page16", dict(batch=32, seq_k=32768, page_size=16))]  # the split rule's builds only
    if ROUND != "A":
        extra.insert(0, ("b128 kv8k page16", dict(batch=128, seq_k=8192, page_size=16)))
    if DRY:
        extra = [(label, dict(kw, batch=2, seq_k=256)) for label, kw in extra]
    for label, kw in extra:
        if time.time() - T0 > PHASES["time"] - 8:
            emit("time", label, "-", "-", None, "skipped: time budget")
            continue
        try:
            case = make_case(f"paged-{label.replace(' ', '-')}", head_dim=128, mask="none", heads_q=32, heads_kv=8,
                             seq_q=1, kv_dtype="fp8_e4m3", peers=False, **kw)
            ec = CaseContext(case, dev, 1)
            eb = kv_bytes(case)
            src, dst = torch.empty(eb // 2, dtype=torch.uint8, device=dev), torch.empty(eb // 2, dtype=torch.uint8,
                                                                                        device=dev)
            calls = {"copy": lambda: dst.copy_(src)}
            for name in CANDS:
                loader.load = lambda spec, name=name: module(name, spec)
                try:
                    pe = impls.prepare_fagen(case, ec)
                finally:
                    loader.load = real_load
                calls[name] = lambda pe=pe: pe.fn(ec.sets[0])
            got = {}
            with torch.no_grad():
                for name in calls:  # warm (builds come from the check phase's cache)
                    calls[name]()
                for p in range(3):
                    order = list(calls)
                    rng.shuffle(order)
                    for name in order:
                        got.setdefault(name, []).append(b2b([calls[name]], 12))
            for name in CANDS:
                r = [c / x for c, x in zip(got["copy"], got[name])]
                m = statistics.median(got[name])
                emit("time", label, name, f"{eb / m / 1e6:.0f} GB/s", m, f"b2b fagen/copy median "
                     f"{statistics.median(r):.3f} spread {min(r):.3f}-{max(r):.3f} "
                     f"(copy {statistics.median(got['copy']):.4f} ms, {eb / 1e6:.0f} MB)")
            del ec, src, dst, calls
        except Exception as e:  # noqa: BLE001
            emit("time", label, "-", "-", None, f"ERROR {type(e).__name__}: {str(e)[:200]}")


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--phase":
        {"check": check_phase, "time": time_phase}[sys.argv[2]]()
        return
    t0 = time.time()
    env = child_env("/tmp/fagen-cache-gpu-pagedfp8-s15", ROOT)
    if "TRITON_INTERPRET" in os.environ:
        env["TRITON_INTERPRET"] = os.environ["TRITON_INTERPRET"]
    rows, logs = [], []
    for name, limit in PHASES.items():
        print(f"[{time.time() - t0:6.1f}s] #### phase {name} (timeout {limit}s)", flush=True)
        rc, lines = run_child(os.path.abspath(__file__), name, limit, env,
                              lambda line: line.startswith("ROW ") or print(line, end="", flush=True))
        rows += [json.loads(line[4:]) for line in lines if line.startswith("ROW ")]
        logs += lines
        print(f"[{time.time() - t0:6.1f}s] #### phase {name}: rc={rc}", flush=True)
        if rc != 0:
            rows.append([name, "(phase)", "-", "-", "", f"ERROR rc={rc}"])
    text = "\n".join(["| section | case | impl | value | ms | note |", "|---|---|---|---|---|---|"]
                     + ["| " + " | ".join(r) + " |" for r in rows])
    print("\n" + text, flush=True)
    out = os.environ.get("OUTX") or os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "gpu_pagedfp8_s15.md"), "w") as f:
            f.write(text + "\n\n" + "".join(logs))
        with open(os.path.join(out, "table.txt"), "w") as f:
            f.write(text + "\n")
    failed = [r for r in rows if "ERROR" in r[5]]
    print(f"done in {time.time() - t0:.0f} s; {len(failed)} failures", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
