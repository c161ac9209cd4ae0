"""MLA absorbed decode (issue 27; docs/serving.md "MLA absorbed decode"): the compute-bound shape (Hq 128, Sq 2) with
split scores ([Note] Split scores in the decode template) against the kernel of before, and the memory-bound shape
(Hq 16, Sq 1, page 64; bf16 and an fp8 e4m3 latent cache with per-token scales), in one table.

    PYTHONPATH=$PWD python3 scripts/gpu_mla_decode_s6.py       # under ~90 s on an H100; $OUT/gpu_mla_decode_s6.md
    GPU_MLA_DECODE_S6_DRY=1 PYTHONPATH=$PWD python3 scripts/gpu_mla_decode_s6.py   # the CPU interpreter, tiny

Phases, each a child process with a timeout (a kernel that faults or hangs costs its phase, not the table):
1. check: every variant built in parallel worker processes, checked against the float64 reference (the dequantized
   cache) at a small paged shape with ragged lengths (pages past a length hold NaN), one split (DIRECT) and three
   splits (merged), then launched once at each timed shape (Triton's cache then holds every kernel the timing takes).
   A variant that fails its check is a row with ERROR and is not timed.
2. compute: Hq 128, Sq 2, causal (MTP steps aligned to the cache's end), KV 4k / 8k, batch 32 / 64 / 128, the
   split rule (forward's default): TF/s of 2 x (576 + 512) flops per (query row, key seen). Target >= 450.
3. memory: Hq 16, Sq 1, KV 4k / 32k, batch 32 / 128: GB/s of the bytes read (the cache once, per-token scales, q,
   out) as % of a device copy (read + write) timed in the same phase. Target >= 90%.
Variants are the module's render with SPLIT_SCORES set (text replaced) at a given tile; "narrow" turns the wide merge
off; a name ending in " sN" launches N fixed splits (forward_split) instead of the split rule, one ending in " inv"
the batch-invariant rule.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
import zlib

DRY = os.environ.get("GPU_MLA_DECODE_S6_DRY") == "1"
if DRY:
    os.environ.setdefault("TRITON_INTERPRET", "1")
T0 = time.time()
D, DV = (48, 32) if DRY else (576, 512)
PAGE = 16 if DRY else 64
HC, HM = (8, 4) if DRY else (128, 16)  # query heads: compute-bound, memory-bound
SCALE = 192 ** -0.5
FP8 = "fp8_e4m3"
# Text edits of the render a variant's last word names ([Note] Wide merge)
EDITS = {"narrow": (("MERGE_WIDE_ROWS = tl.constexpr(16)", "MERGE_WIDE_ROWS = tl.constexpr(0)"),)}

# (name, regime, kv dtype, split scores, (block_m, block_n, num_warps, num_stages)); sm_90 ptxas (triton 3.6, direct):
# m64n64w8s2 255 registers, 102 spilled words, 217 KB; with split scores m64n64w8s2 255 / 32 / 217 KB (merged launch
# 98 words), m64n32w8s3 255 / 2 / 181 KB, m64n16w8s4 255 / 0 / 145 KB.
VARIANTS = [
    ("m64n64w8s2 (default: split scores)", "comp", None, True, (64, 64, 8, 2)),
    ("m64n64w8s2 joint (before)", "comp", None, False, (64, 64, 8, 2)),
    ("m64n32w8s3 split", "comp", None, True, (64, 32, 8, 3)),
    ("m64n64w8s2 split, 1 split s1", "comp", None, True, (64, 64, 8, 2)),
    ("m64n64w8s2 split, 2 splits s2", "comp", None, True, (64, 64, 8, 2)),
    ("m64n64w8s2 split, batch-invariant inv", "comp", None, True, (64, 64, 8, 2)),
    ("bf16 m16n32w4s3 (default: wide merge)", "mem", None, True, (16, 32, 4, 3)),
    ("e4m3 tok m16n32w4s3 (default: wide merge)", "mem", FP8, True, (16, 32, 4, 3)),
    ("bf16 m16n32w4s3 narrow", "mem", None, True, (16, 32, 4, 3)),
    ("e4m3 tok m16n32w4s3 narrow", "mem", FP8, True, (16, 32, 4, 3)),
]
COMP_SHAPES = [(64, 4096), (32, 4096), (128, 4096), (64, 8192)]  # (batch, kv)
MEM_SHAPES = [(32, 4096), (128, 4096), (32, 32768), (128, 32768)]
CHECK_LENS = [1000, 77, 1024, 513]
if DRY:
    VARIANTS = [(n, r, kv, s, (16, 16, 4, 2)) for n, r, kv, s, _ in VARIANTS]
    COMP_SHAPES, MEM_SHAPES, CHECK_LENS = [(2, 64)], [(2, 96)], [37, 100, 64]
TIMEOUTS = dict(check=80, comp=35, mem=40) if not DRY else dict(check=900, comp=600, mem=600)


def log(msg):
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def emit(section, case, impl, value, ms, note):
    """One table row, as a line the parent collects."""
    print("ROW\t" + "\t".join([section, case, impl, value, "" if ms is None else f"{ms:.4f}", note]), flush=True)


def dev():
    return "cpu" if DRY else "cuda"


def module(v):
    import fagen
    from fagen.runtime.loader import load_source
    name, regime, kv, split, (bm, bn, w, s) = v
    spec = fagen.KernelSpec(head_dim=D, head_dim_v=DV, shared_kv=True, kind="decode", gqa=HC if regime == "comp" else HM,
                            dtype="bf16", mask="causal", layout="paged", kv_dtype=kv, block_m=bm, block_n=bn,
                            num_warps=w, num_stages=s)
    source, n = re.subn(r"SPLIT_SCORES = tl\.constexpr\((True|False)\)", f"SPLIT_SCORES = tl.constexpr({split})",
                        fagen.generate(spec))
    if n != 1:
        raise RuntimeError("SPLIT_SCORES not in the render")
    for old, new in EDITS.get(name.split(" ")[-1], ()):
        if old not in source:
            raise RuntimeError(f"{old!r} not in the render")
        source = source.replace(old, new)
    return load_source(source, f"{spec.name}_{zlib.crc32(name.encode())}")


def inputs(regime, kv, lens, seed, nan=True):
    """q, a shuffled paged latent cache (NaN past each length), per-token scales in [1/8, 8] (fp8), the layout's
    keywords, and sequence i's float64 keys [1, 1, n, D] (dequantized)."""
    import torch
    hq, sq = (HC, 2) if regime == "comp" else (HM, 1)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    width = max(-(-n // PAGE) for n in lens)
    pages = -(-(len(lens) * width) // 16) * 16
    q = torch.randn(len(lens), hq, sq, D, generator=gen).bfloat16()
    cache = torch.randn(pages, PAGE, 1, D, generator=gen)
    scales = torch.exp2(torch.rand((pages, PAGE, 1), generator=gen) * 6 - 3)
    table = torch.randperm(pages, generator=gen)[:len(lens) * width].to(torch.int32).view(len(lens), width)
    cache = cache.to(torch.float8_e4m3fn) if kv else cache.bfloat16()
    if nan and not kv:
        for b, n in enumerate(lens):
            for p in range(width):
                if n - p * PAGE < PAGE:
                    cache[table[b, p], max(0, n - p * PAGE):] = float("nan")

    def keys(i):
        rows = cache[table[i].long()].double()
        if kv:
            rows = rows * scales[table[i].long()].double()[..., None]
        return rows.reshape(-1, 1, D)[:lens[i]].transpose(0, 1)[None]
    kw = dict(block_table=table.to(dev()), seqlens_k=torch.tensor(lens, dtype=torch.int32, device=dev()), scale=SCALE)
    if kv:
        kw["k_scale"] = scales.to(dev())
    return q.to(dev()), cache.to(dev()), kw, keys


def check_one(v):
    """Build, check against float64 (one split and three), launch at the timed shapes; None or the error."""
    import torch
    from fagen.verify import reference
    from fagen.verify.tolerances import LSE_TOLERANCE, TOLERANCE, compare
    try:
        m = module(v)
        q, cache, kw, keys = inputs(v[1], v[2], CHECK_LENS, 7)
        worst = 0.0
        for splits in (1, 3):
            out, lse = m.forward_split(q, cache, None, num_splits=splits, **kw)
            for b in range(len(CHECK_LENS)):
                k = keys(b)
                want, want_lse = reference.attention(q[b:b + 1].cpu().double(), k, None, head_dim_v=DV,
                                                     mask="causal", scale=SCALE)
                terms, _ = reference.attention(q[b:b + 1].cpu().double(), k, k[..., :DV].abs(), mask="causal",
                                               scale=SCALE)
                unit = terms.clamp(min=1.0)
                got = out[b:b + 1].cpu().double()
                compare(f"out s{splits} seq {b}", got / unit, want / unit, **TOLERANCE["bf16"])
                compare(f"lse s{splits} seq {b}", lse[b:b + 1].cpu(), want_lse, **LSE_TOLERANCE)
                worst = max(worst, (got - want).abs().max().item())
        for b, n in (COMP_SHAPES if v[1] == "comp" else MEM_SHAPES):  # warm: the timed launches' kernels
            q, cache, kw = timed_inputs(v[1], v[2], b, n, empty=True)
            launch(m, v, q, cache, kw)
            del q, cache, kw
        if not DRY:
            torch.cuda.synchronize()
        return f"{worst:.1e}"
    except Exception as e:  # noqa: BLE001
        import traceback
        traceback.print_exc(file=sys.stderr)
        return f"ERROR {type(e).__name__}: {str(e).strip().splitlines()[0][:150]}"


def launch(m, v, q, cache, kw):
    """The variant's timed launch: a fixed split count (a name ending in " sN"), the batch-invariant rule (" inv")
    or the split rule."""
    fixed = re.search(r" s(\d+)$", v[0])
    if fixed:
        return m.forward_split(q, cache, None, num_splits=int(fixed.group(1)), **kw)
    if v[0].endswith(" inv"):  # [Note] Batch-invariant splits
        return m.forward(q, cache, None, batch_invariant=True, **kw)
    return m.forward(q, cache, None, **kw)


def timed_inputs(regime, kv, b, n, seed=5, empty=False):
    """The timed inputs, made on the device (empty: a cache of uninitialised values, for the warm launches, whose
    values do not change what compiles)."""
    import torch
    hq, sq = (HC, 2) if regime == "comp" else (HM, 1)
    gen = torch.Generator(device=dev()).manual_seed(seed)
    pages = b * (n // PAGE)
    q = torch.randn(b, hq, sq, D, device=dev(), generator=gen).bfloat16()
    if empty:
        cache = torch.empty(pages, PAGE, 1, D, device=dev(), dtype=torch.uint8 if kv else torch.bfloat16)
        cache = cache.view(torch.float8_e4m3fn) if kv else cache
    else:
        cache = torch.randn(pages, PAGE, 1, D, device=dev(), generator=gen)
        cache = cache.to(torch.float8_e4m3fn) if kv else cache.bfloat16()
    table = torch.randperm(pages, device=dev(), generator=gen).to(torch.int32).view(b, n // PAGE)
    kw = dict(block_table=table, seqlens_k=torch.full((b,), n, dtype=torch.int32, device=dev()), scale=SCALE)
    if kv:
        kw["k_scale"] = torch.exp2(torch.rand((pages, PAGE, 1), device=dev(), generator=gen) * 6 - 3)
    return q, cache, kw


def bench(fn):
    if DRY:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    from triton.testing import do_bench
    return do_bench(fn, warmup=10, rep=40)


def phase_check(state):
    import concurrent.futures as cf
    import multiprocessing as mp
    if DRY:
        errs = [check_one(v) for v in VARIANTS]
    else:
        with cf.ProcessPoolExecutor(max_workers=len(VARIANTS), mp_context=mp.get_context("spawn")) as pool:
            errs = list(pool.map(check_one, VARIANTS))
    for v, e in zip(VARIANTS, errs):
        emit("check", "h{} sq{} lens {}".format(HC if v[1] == "comp" else HM, 2 if v[1] == "comp" else 1,
                                                "/".join(map(str, CHECK_LENS))), v[0], "-", None,
             e if e.startswith("ERROR") else f"max err {e} (1 and 3 splits)")
    with open(state, "w") as f:
        json.dump({v[0]: not e.startswith("ERROR") for v, e in zip(VARIANTS, errs)}, f)


def passed(state):
    try:
        with open(state) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def phase_comp(state):
    import torch
    ok = passed(state)
    for b, n in COMP_SHAPES:
        case = f"h{HC} sq2 b{b} kv{n} causal"
        flops = 2 * (D + DV) * HC * b * (2 * n - 1)  # rows i = 0, 1 see n - 1 + i keys
        for v in VARIANTS:
            if v[1] != "comp":
                continue
            if not ok.get(v[0]):
                emit("comp", case, v[0], "-", None, "not timed: no check passed")
                continue
            try:
                m = module(v)
                q, cache, kw = timed_inputs("comp", None, b, n)
                ms = bench(lambda: launch(m, v, q, cache, kw))
                emit("comp", case, v[0], f"{flops / ms / 1e9:.1f} TF/s", ms, "")
                del q, cache, kw
            except Exception as e:  # noqa: BLE001
                emit("comp", case, v[0], "-", None, f"ERROR {type(e).__name__}: {str(e).splitlines()[0][:120]}")
        if not DRY:
            torch.cuda.empty_cache()


def phase_mem(state):
    import torch
    ok = passed(state)
    x = torch.empty(1 << (20 if DRY else 30), dtype=torch.uint8, device=dev())
    y = torch.empty_like(x)
    peak = 2 * x.numel() / bench(lambda: y.copy_(x)) / 1e6
    del x, y
    emit("mem", "device copy (read + write)", "torch copy_", f"{peak:.1f} GB/s", None, "")
    for b, n in MEM_SHAPES:
        case = f"h{HM} sq1 b{b} kv{n} page{PAGE}"
        for v in VARIANTS:
            if v[1] != "mem":
                continue
            if not ok.get(v[0]):
                emit("mem", case, v[0], "-", None, "not timed: no check passed")
                continue
            try:
                m = module(v)
                q, cache, kw = timed_inputs("mem", v[2], b, n)
                ms = bench(lambda: m.forward(q, cache, None, **kw))
                read = b * n * D * cache.element_size() + 2 * q.numel() + b * HM * DV * 2 + (b * n * 4 if v[2] else 0)
                emit("mem", case, v[0], f"{read / ms / 1e6:.1f} GB/s", ms,
                     f"{100 * read / ms / 1e6 / peak:.0f}% of copy")
                del q, cache, kw
            except Exception as e:  # noqa: BLE001
                emit("mem", case, v[0], "-", None, f"ERROR {type(e).__name__}: {str(e).splitlines()[0][:120]}")
        if not DRY:
            torch.cuda.empty_cache()


def run_phase(name, state):
    """The phase in a child process with its timeout; its ROW lines, or a row saying how it ended."""
    log(f"#### phase {name} (timeout {TIMEOUTS[name]} s)")
    proc = subprocess.Popen([sys.executable, __file__, "--phase", name, state], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=os.environ.copy())
    rows, lines = [], []
    try:
        out, _ = proc.communicate(timeout=TIMEOUTS[name])
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        rows.append((name, "phase", "-", "-", "", f"ERROR timed out after {TIMEOUTS[name]} s"))
    for line in out.splitlines():
        if line.startswith("ROW\t"):
            rows.append(tuple(line.split("\t")[1:]))
        lines.append(line)
    print("\n".join(f"    {x}" for x in lines[-40:] if not x.startswith("ROW\t")), flush=True)
    if proc.returncode not in (0, None) and not any("timed out" in r[5] for r in rows):
        rows.append((name, "phase", "-", "-", "", f"ERROR exit {proc.returncode}"))
    for r in rows:
        log(" | ".join(r))
    return rows


def main():
    if "--phase" in sys.argv:
        i = sys.argv.index("--phase")
        {"check": phase_check, "comp": phase_comp, "mem": phase_mem}[sys.argv[i + 1]](sys.argv[i + 2])
        return
    import torch
    import triton
    import fagen
    if not DRY and not torch.cuda.is_available():
        sys.exit("gpu_mla_decode_s6.py needs a CUDA GPU (GPU_MLA_DECODE_S6_DRY=1 rehearses it on the CPU)")
    log(f"{'CPU rehearsal' if DRY else torch.cuda.get_device_name()}  torch {torch.__version__}  "
        f"triton {triton.__version__}  fagen {fagen.__file__}")
    with tempfile.TemporaryDirectory() as tmp:
        state = os.path.join(tmp, "checked.json")
        rows = []
        for name in ("check", "comp", "mem"):
            rows += run_phase(name, state)
    lines = ["| section | case | impl | value | ms | note |", "|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    text = "\n".join(lines)
    print("\n" + text)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_mla_decode_s6.md"), "w") as f:
            f.write(text + "\n")
    failed = [r for r in rows if "ERROR" in r[5]]
    log(f"done in {time.time() - T0:.0f} s; {len(failed)} failures")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
