"""Paged fp8 KV decode, fourteenth session (issue 27; docs/serving.md "Paged fp8 KV decode (fourteenth session)"):
the paged row decode-d128-kv8k-b32-fp8-paged16 (0.92x of a copy of its bytes, thirteenth session) against whole rows
([Note] Paged whole rows: PAGED_ROW_HEADS = h KV heads a program, their rows the key tile's rows).

    PYTHONPATH=$PWD python3 scripts/gpu_pagedfp8_s14.py      # < 70 s on an H100; $OUTX/gpu_pagedfp8_s14.md
    GPU_PAGEDFP8_S14_DRY=1 PYTHONPATH=$PWD python3 scripts/gpu_pagedfp8_s14.py   # the CPU interpreter, tiny shapes

Candidates: text replacements on the paged fp8 render plus tile overrides (CANDS; GPU_PAGEDFP8_S14_CANDS picks a
comma-separated subset). Phases, each a child process with a timeout:
1. check: each candidate at page 16 against float64 on the dequantized cache, 28 sequences of 1..1200 keys (no
   multiple of a page or a key tile), per-head scales, through the split rule and 3 splits; table entries past each
   sequence's pages pointing outside the cache; it must FAIL against the reference on the cache read as bf16 and
   without its scales; the launch's _heads must give the candidate's h. Warms the builds of the time phase.
2. time: the serving bench's paged row (its make_inputs sets, its float64 check, prepare_fagen with the candidate's
   module in place of fagen.load) and its copy reference (prepare_copy), each timed by fagen.bench.timing.measure
   under L2_FLUSH "loop" (the bench's default for this row) and back to back, PASSES passes, order rotated; medians;
   fagen / copy. Then b128 kv8k page 16 and b32 kv8k page 64 (one set each, back to back beside a copy of the
   same bytes; no bench check there: the check phase covers the candidates' values).
"""

from __future__ import annotations

import json
import re
import os
import statistics
import sys
import time
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/, for _phases
from _phases import child_env, run_phase as run_child  # noqa: E402

DRY = os.environ.get("GPU_PAGEDFP8_S14_DRY") == "1"
if DRY:
    os.environ.setdefault("TRITON_INTERPRET", "1")
PHASES = ({"check": 26, "time": 38} if os.environ.get("GPU_PAGEDFP8_S14_ROUND", "B") == "A" else {"check": 20, "time": 44}) \
    if not DRY else {"check": 1800, "time": 1800}
if os.environ.get("GPU_PAGEDFP8_S14_PHASES"):  # "name:seconds,..."
    PHASES = {n: float(t) for n, t in (p.split(":") for p in os.environ["GPU_PAGEDFP8_S14_PHASES"].split(","))}
PASSES = 1 if DRY else (3 if os.environ.get("GPU_PAGEDFP8_S14_ROUND", "B") == "A" else 4)
ORDERED = os.environ.get("GPU_PAGEDFP8_S14_ORDERED", "1") == "1"  # time the default on its pages in order too
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T = lambda n, w, s: dict(block_n=n, num_warps=w, num_stages=s)  # noqa: E731
H = lambda h: [("\nPAGED_ROW_HEADS = 1\n", f"\nPAGED_ROW_HEADS = {h}\n")]  # noqa: E731
ROUND = os.environ.get("GPU_PAGEDFP8_S14_ROUND", "B")
# maxnreg 128 for h > 1 launches (two programs an SM at 8 warps; sm_90 ptxas on the CPU, lab/pagedfp8_sm90.py: h4
# 178 and h8 254 registers, one program an SM, or 128 with 48 / 32 bytes spilled)
R128 = [("\nPAGED_ROW_REGS = 0\n", "\nPAGED_ROW_REGS = 128\n")]
# Diagnostic (not a lever): the grid (splits, batch, Hkv x tiles) instead of (splits, Hkv x tiles, batch), so that a
# sequence's KV heads are batch programs apart instead of consecutive (started together): the same bits
APART = [("    off_hkv = tl.program_id(1) // n_tiles\n    tile = tl.program_id(1) % n_tiles\n    off_b = tl.program_id(2)",
          "    off_hkv = tl.program_id(2) // n_tiles\n    tile = tl.program_id(2) % n_tiles\n    off_b = tl.program_id(1)"),
         ("counter = Counter + off_b * tl.num_programs(1) + tl.program_id(1)",
          "counter = Counter + off_b * tl.num_programs(2) + tl.program_id(2)"),
         ("split_grid = (splits, hkv // heads * n_tiles, b)", "split_grid = (splits, b, hkv // heads * n_tiles)")]
if ROUND == "A":
    CANDS = {"default": ([], {}), "h2": (H(2), {}), "h4": (H(4), {}), "h8": (H(8), {}), "h4 r128": (H(4) + R128, {}),
             "h8 r128": (H(8) + R128, {})}
else:  # round B: round A's closest (h2; h4 at maxnreg 128, two programs an SM) against the default, more shapes
    CANDS = {"default": ([], {}), "h2": (H(2), {}), "h4 r128": (H(4) + R128, {}), "heads apart": (APART, {})}
if os.environ.get("GPU_PAGEDFP8_S14_CANDS"):
    CANDS = {k: CANDS[k] for k in os.environ["GPU_PAGEDFP8_S14_CANDS"].split(",")}


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
        _MODS[key] = load_source(src, f"{spec.name}_s14_{zlib.crc32(name.encode()):08x}")  # stable across phases
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
    width = -(-int(lens.max()) // page) + 1
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
            want_h = int(name.split()[0][1:]) if re.match(r"h\d", name) else 1
            if m._heads(HKV, 1, None, None, kc.permute(0, 2, 1, 3), vc.permute(0, 2, 1, 3)) != want_h:
                raise AssertionError(f"_heads gives {m._heads(HKV, 1, None, None)}, not {want_h}")
            kw = dict(block_table=table, seqlens_k=lens, k_scale=ks, v_scale=vs)
            out, lse = m.forward(q, kc, vc, **kw)
            # 3 splits (h > 1 only: their split rule's build; the default's 3 splits are the earlier sessions')
            out3, lse3 = m.forward_split(q, kc, vc, num_splits=3, **kw) if want_h > 1 else (out, lse)
            worst, far = 0.0, []
            for i in (0, 1, 2, b - 1):
                want, wlse = reference.attention(q[i:i + 1].double(), gathered(kd, i, n := int(lens[i])),
                                                 gathered(vd, i, n))
                terms, _ = reference.attention(q[i:i + 1].double(), gathered(kd, i, n), gathered(vd, i, n).abs())
                unit = terms.clamp(min=1.0)
                worst = max(worst, compare(f"3 splits out {i}", out3[i:i + 1].double() / unit, want / unit,
                                           **TOLERANCE["bf16"]))
                compare(f"3 splits lse {i}", lse3[i:i + 1], wlse, **LSE_TOLERANCE)
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
            emit("check", f"page16 b{b} 1..1200 keys, bad entries, per-head, rule + 3 splits", name, "-", None,
                 f"ok (h {want_h}), err {worst:.1e}; fails as {' and as '.join(far)}{same}")
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
    cp = impls.prepare_copy(row, cc)
    entries["copy"] = ([lambda s=s: cp.fn(s) for s in cc.sets], "copy of the row's bytes", cp)

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
    emit("time", "L2_FLUSH", timing.L2_FLUSH, "-", None, f"{len(cc.sets)} sets; warm-up {opts.warmup_ms} ms, "
         f"{opts.rep_ms} ms of calls")
    with torch.no_grad():
        for p in range(PASSES):
            for name in names[p % len(names):] + names[:p % len(names)]:
                if time.time() - T0 > PHASES["time"] - 3:
                    break
                fns = entries[name][0]
                ms = timing.time_prepared(entries[name][2], cc, opts)["ms"]  # the bench's own timing
                res.setdefault((name, "loop"), []).append(ms)
                res.setdefault((name, "b2b"), []).append(b2b(fns, 60))
    cl = statistics.median(res.get(("copy", "loop"), [float("nan")]))
    cb = statistics.median(res.get(("copy", "b2b"), [float("nan")]))
    for name in names:
        if (name, "loop") not in res:
            continue
        ml, mb = statistics.median(res[(name, "loop")]), statistics.median(res[(name, "b2b")])
        emit("time", row.name, name, f"{nb / ml / 1e6:.0f} GB/s", ml,
             f"loop fagen/copy {cl / ml:.3f} (passes {[round(cl / x, 3) for x in res[(name, 'loop')]]}); "
             f"b2b {mb:.4f} ms {cb / mb:.3f}; {entries[name][1]}")
    # other paged shapes, back to back only (one set; no bench check: the check phase covers the candidates' values)
    from fagen.bench.workloads import make_case
    extra = [("b128 kv8k page16", dict(batch=128, seq_k=8192, page_size=16)),
             ("b32 kv8k page64", dict(batch=32, seq_k=8192, page_size=64))]
    if ROUND != "A":
        extra = extra[:1] + [("b32 kv32k page16", dict(batch=32, seq_k=32768, page_size=16)),
                             ("b64 kv8k page16", dict(batch=64, seq_k=8192, page_size=16))] + extra[1:]
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
                for p in range(2 if ROUND == "A" else 3):
                    for name in list(calls)[p % len(calls):] + list(calls)[:p % len(calls)]:
                        got.setdefault(name, []).append(b2b([calls[name]], 12))
            c = statistics.median(got["copy"])
            for name in CANDS:
                m = statistics.median(got[name])
                emit("time", label, name, f"{eb / m / 1e6:.0f} GB/s", m, f"b2b fagen/copy {c / m:.3f} "
                     f"(copy {c:.4f} ms, {eb / 1e6:.0f} MB)")
            del ec, src, dst, calls
        except Exception as e:  # noqa: BLE001
            emit("time", label, "-", "-", None, f"ERROR {type(e).__name__}: {str(e)[:200]}")


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--phase":
        {"check": check_phase, "time": time_phase}[sys.argv[2]]()
        return
    t0 = time.time()
    env = child_env("/tmp/fagen-cache-gpu-pagedfp8-s14", ROOT)
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
        with open(os.path.join(out, "gpu_pagedfp8_s14.md"), "w") as f:
            f.write(text + "\n\n" + "".join(logs))
    failed = [r for r in rows if "ERROR" in r[5]]
    print(f"done in {time.time() - t0:.0f} s; {len(failed)} failures", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
