"""Tiles and split counts of MLA's absorbed decode (spec shared_kv: d 576 = 512 latent + 64 rope, d_v 512, one
latent cache; README "MLA absorbed decode", issue 27), to set the defaults ([Note] Latent decode tiles).

    PYTHONPATH=$PWD python3 scripts/gpu_mla_sweep.py           # H100, under ~150 s; one table; $OUT/gpu_mla_sweep.md
    GPU_MLA_DRY=1 PYTHONPATH=$PWD python3 scripts/gpu_mla_sweep.py   # the same code on the CPU interpreter, tiny
    python3 scripts/gpu_mla_sweep.py --ptxas     # no GPU: sm_90 registers / spills / shared KB per tile (ptxas)

1. Every candidate tile is built and checked against the float64 reference (V sliced from K) first, at a small
   paged shape with lengths that are not multiples of the page or block, in each launch form the timings use
   (one split: DIRECT; fixed splits; the batch-invariant rule). The builds run in parallel worker processes (they
   fill Triton's cache, so the timing loop compiles little); a tile that fails its check is not timed.
2. Memory-bound: Hq 16 over one latent cache, Sq 1, page 64, KV 4k / 32k, batch 32 / 128: GB/s of the bytes read
   (the cache once, q, out) as % of a device copy (read + write) timed here. Target >= 90%.
3. Compute-bound: Hq 128, Sq 2, causal, b64 kv4096 (scripts/gpu_mla.py's shape): TF/s of 2 x (576 + 512) flops per
   (query row, key) seen. Target >= 450 (FlashMLA publishes 660 on the H800).
Split forms: `inv` the default (batch-invariant, the module's INVARIANT_MIN_CHUNK), `invN` the same with a minimum
chunk of N keys, `rule` batch_invariant=False (the split heuristic), `sN` N fixed splits (forward_split).
Ends with one table and the best (tile, split form) per regime, overall and among the batch-invariant forms.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

DRY = os.environ.get("GPU_MLA_DRY") == "1"
PTXAS = "--ptxas" in sys.argv
if DRY:
    os.environ.setdefault("TRITON_INTERPRET", "1")

D, DV = (48, 32) if DRY else (576, 512)
PAGE = 16 if DRY else 64
BUDGET_S = 135  # no new timing starts after this
SCALE = 192 ** -0.5  # DeepSeek's softmax scale
T0 = time.time()

# (name, block_m, block_n, num_warps, num_stages). Memory-bound tiles hold 16 rows whatever block_m (>= 16) is.
# The defaults ([Note] Latent decode tiles) first, then the runners-up of the 2026-11-26 sweep and the default before.
MEM_TILES = [(16, 32, 4, 3), (16, 64, 8, 2), (16, 64, 8, 3), (16, 32, 8, 3), (16, 32, 4, 4), (16, 16, 4, 4),
             (64, 32, 8, 2)]
COMP_TILES = [(64, 64, 8, 2), (64, 32, 8, 3), (64, 32, 8, 2)]  # n64 s3 needs 289 KB of shared memory
MEM_SHAPES = [(32, 4096), (128, 4096), (32, 32768), (128, 32768)]  # (batch, kv)
COMP_SHAPE = (64, 4096)
MEM_SPLITS = ["inv", "inv1024", "inv2048", "rule", "s1", "s2", "s4", "s8"]
COMP_SPLITS = ["inv", "inv1024", "inv4096", "rule", "s1", "s2"]
if DRY:
    MEM_TILES, COMP_TILES = MEM_TILES[:2], COMP_TILES[:1]
    MEM_SHAPES, COMP_SHAPE = [(2, 96)], (2, 64)
    MEM_SPLITS, COMP_SPLITS = ["inv", "inv32", "rule", "s1", "s2"], ["inv", "s1", "s2"]


def tname(t):
    return "m{}n{}w{}s{}".format(*t)


def log(msg):
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------- on the GPU (torch)

def _spec(hq, mask, tile):
    import fagen
    bm, bn, w, s = tile
    return fagen.KernelSpec(head_dim=D, head_dim_v=DV, shared_kv=True, kind="decode", gqa=hq, dtype="bf16",
                            mask=mask, layout="paged", block_m=bm, block_n=bn, num_warps=w, num_stages=s)


def _paged(lens, hq, sq, seed, dev):
    """q and a shuffled page cache holding sequences of the given lengths (16-page multiples in all, as the timed
    shapes, so that the kernels' integer specialisations match); pages past a length hold NaN."""
    import torch
    gen = torch.Generator(device="cpu").manual_seed(seed)
    width = max(-(-n // PAGE) for n in lens)
    pages = -(-(len(lens) * width) // 16) * 16
    q = torch.randn(len(lens), hq, sq, D, generator=gen).bfloat16().to(dev)
    cache = torch.randn(pages, PAGE, 1, D, generator=gen).bfloat16()
    table = torch.randperm(pages, generator=gen)[:len(lens) * width].to(torch.int32).view(len(lens), width)
    for b, n in enumerate(lens):
        for p in range(width):
            lo = max(0, n - p * PAGE)
            if lo < PAGE:
                cache[table[b, p], lo:] = float("nan")
    return q, cache.to(dev), table.to(dev), torch.tensor(lens, dtype=torch.int32, device=dev)


def _full(b, kv, hq, sq, seed, dev):
    """The timed inputs, made on the device: b sequences of kv keys each on shuffled pages."""
    import torch
    gen = torch.Generator(device=dev).manual_seed(seed)
    pages = b * (kv // PAGE)
    q = torch.randn(b, hq, sq, D, device=dev, generator=gen).bfloat16()
    cache = torch.randn(pages, PAGE, 1, D, device=dev, generator=gen).bfloat16()
    table = torch.randperm(pages, device=dev, generator=gen).to(torch.int32).view(b, kv // PAGE)
    return q, cache, table, torch.full((b,), kv, dtype=torch.int32, device=dev)


def _call(m, split, q, cache, table, lens):
    """The launch of one split form; returns a no-argument function."""
    kw = dict(block_table=table, seqlens_k=lens, scale=SCALE)
    if split.startswith("s"):
        n = int(split[1:])
        return lambda: m.forward_split(q, cache, None, num_splits=n, **kw)
    if split == "rule":
        return lambda: m.forward(q, cache, None, batch_invariant=False, **kw)
    chunk = m.INVARIANT_MIN_CHUNK if split == "inv" else int(split[3:])

    def run():
        old, m.INVARIANT_MIN_CHUNK = m.INVARIANT_MIN_CHUNK, chunk
        try:
            return m.forward(q, cache, None, **kw)
        finally:
            m.INVARIANT_MIN_CHUNK = old
    return run


def check_tile(hq, sq, mask, tile, splits):
    """Build one tile and check every split form against float64 at a small shape: max abs error, or an error."""
    import torch
    import fagen
    from fagen.verify import reference
    from fagen.spec.axes import DType
    from fagen.verify.tolerances import LSE_TOLERANCE, TOLERANCE, compare
    dev = "cpu" if DRY else "cuda"
    try:
        m = fagen.load(_spec(hq, mask, tile))
        lens = [37, 100, 64] if DRY else [1000, 777, 1024, 513]
        q, cache, table, lens_t = _paged(lens, hq, sq, 7, dev)
        worst = 0.0
        for split in splits:
            if split.startswith("inv") and split != "inv":
                split = "inv" + str(min(int(split[3:]), 256))  # a small shape: chunks that make several splits
            out, lse = _call(m, split, q, cache, table, lens_t)()
            for b, n in enumerate(lens):
                keys = cache[table[b].long()].reshape(-1, 1, D)[:n].transpose(0, 1)[None].cpu()
                want, want_lse = reference.attention(q[b:b + 1].cpu(), keys, None, head_dim_v=DV, mask=mask,
                                                     scale=SCALE)
                worst = max(worst, compare(f"out {split} seq {b}", out[b:b + 1], want, **TOLERANCE[DType.BF16]))
                compare(f"lse {split} seq {b}", lse[b:b + 1], want_lse, **LSE_TOLERANCE)
        return worst
    except Exception as e:  # noqa: BLE001 - a failure is a row
        traceback.print_exc(file=sys.stderr)
        return f"ERROR {type(e).__name__}: {str(e).strip().splitlines()[0][:160]}"


def bench(fn):
    if DRY:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    from triton.testing import do_bench
    return do_bench(fn, warmup=5, rep=25)


def copy_bandwidth():
    import torch
    x = torch.empty(1 << (20 if DRY else 30), dtype=torch.uint8, device="cpu" if DRY else "cuda")
    y = torch.empty_like(x)
    return 2 * x.numel() / bench(lambda: y.copy_(x)) / 1e6


def main():
    import torch
    import fagen
    if not DRY and not torch.cuda.is_available():
        sys.exit("gpu_mla_sweep.py needs a CUDA GPU (GPU_MLA_DRY=1 rehearses it on the CPU; --ptxas needs none)")
    log(f"{'CPU rehearsal' if DRY else torch.cuda.get_device_name()}  torch {torch.__version__}  "
        f"fagen {fagen.__file__}")
    jobs = [(16, 1, "none", t, MEM_SPLITS) for t in MEM_TILES] + [(128, 2, "causal", t, COMP_SPLITS)
                                                                  for t in COMP_TILES]
    if DRY:
        jobs = [(4, 1, "none", t, s) if h == 16 else (8, 2, "causal", t, s) for h, _, _, t, s in jobs]
        errs = [check_tile(*j) for j in jobs]
    else:
        import concurrent.futures as cf
        import multiprocessing as mp
        with cf.ProcessPoolExecutor(max_workers=min(len(jobs), 12), mp_context=mp.get_context("spawn")) as pool:
            errs = list(pool.map(check_tile, *zip(*jobs)))
    checked = {(j[0], j[3]): e for j, e in zip(jobs, errs)}
    log("checks: " + ", ".join(f"h{h} {tname(t)} {e if isinstance(e, str) else f'{e:.1e}'}"
                                for (h, t), e in checked.items()))
    peak = copy_bandwidth()
    log(f"device copy {peak:.1f} GB/s")
    rows = []  # (regime, shape, tile, split, value, pct, ms, err)
    dev = "cpu" if DRY else "cuda"
    hm, hc = (4, 8) if DRY else (16, 128)

    def timed(regime, hq, sq, mask, shape, tiles, splits, seed):
        b, kv = shape
        case = f"h{hq} sq{sq} b{b} kv{kv}" + (" causal" if mask == "causal" else "")
        q, cache, table, lens = _full(b, kv, hq, sq, seed, dev)  # once per shape, for every tile
        for tile in tiles:
            err = checked[(hq, tile)]
            if isinstance(err, str):
                rows.append((regime, case, tname(tile), "-", None, None, None, err))
                continue
            m = fagen.load(_spec(hq, mask, tile))
            for split in splits:
                if time.time() - T0 > BUDGET_S:
                    rows.append((regime, case, tname(tile), split, None, None, None, "skipped: time budget"))
                    continue
                try:
                    ms = bench(_call(m, split, q, cache, table, lens))
                except Exception as e:  # noqa: BLE001
                    rows.append((regime, case, tname(tile), split, None, None, None, f"ERROR {type(e).__name__}: "
                                 + str(e).strip().splitlines()[0][:120]))
                    continue
                if regime == "mem":
                    read = b * kv * D * 2 + q.numel() * 2 * (1 + DV / D)
                    value = read / ms / 1e6
                    rows.append((regime, case, tname(tile), split, value, 100 * value / peak, ms, f"{err:.1e}"))
                else:
                    seen = b * hq * (sq * kv - sq * (sq - 1) // 2)
                    rows.append((regime, case, tname(tile), split, 2 * (D + DV) * seen / ms / 1e9, None, ms,
                                 f"{err:.1e}"))
        del q, cache, table, lens

    # The compute-bound shape first (one shape), then the memory-bound shapes, every tile on each.
    timed("compute", hc, 2, "causal", COMP_SHAPE, COMP_TILES, COMP_SPLITS, 1)
    for shape in MEM_SHAPES:
        timed("mem", hm, 1, "none", shape, MEM_TILES, MEM_SPLITS, 2)
    report(rows, peak)


def report(rows, peak):
    lines = ["| regime | shape | tile | splits | value | % of copy | ms | err / note |", "|---|---|---|---|---|---|---|---|"]
    for reg, case, tile, split, value, pct, ms, note in rows:
        unit = "GB/s" if reg == "mem" else "TF/s"
        lines.append(f"| {reg} | {case} | {tile} | {split} | {'-' if value is None else f'{value:.1f} {unit}'} | "
                     f"{'' if pct is None else f'{pct:.0f}%'} | {'' if ms is None else f'{ms:.4f}'} | {note} |")
    lines.append(f"\ndevice copy (read + write): {peak:.1f} GB/s")
    ok = [r for r in rows if r[4] is not None]
    for reg in ("mem", "compute"):
        shapes = sorted({r[1] for r in ok if r[0] == reg})
        for label, keep in (("any split form", lambda s: True), ("batch-invariant", lambda s: s.startswith("inv"))):
            # per (tile, split form): the geometric mean over the regime's shapes, where it ran at every one
            score = {}
            for r in ok:
                if r[0] == reg and keep(r[3]):
                    score.setdefault((r[2], r[3]), {})[r[1]] = r[4]
            full = {k: v for k, v in score.items() if len(v) == len(shapes)}
            if not full:
                continue
            gm = {k: _gmean(v.values()) for k, v in full.items()}
            best = max(gm, key=gm.get)
            unit = "GB/s" if reg == "mem" else "TF/s"
            extra = f" ({100 * gm[best] / peak:.0f}% of copy)" if reg == "mem" else ""
            lines.append(f"best {reg} ({label}): {best[0]} {best[1]}: {gm[best]:.1f} {unit}{extra} "
                         f"(geometric mean over {len(shapes)} shapes)")
        # the best split form per shape for the best tile of each shape
        for shape in shapes:
            cand = [r for r in ok if r[0] == reg and r[1] == shape]
            r = max(cand, key=lambda r: r[4])
            lines.append(f"  best at {shape}: {r[2]} {r[3]} {r[4]:.1f}" + (f" ({r[5]:.0f}%)" if r[5] else ""))
    text = "\n".join(lines)
    print("\n" + text, flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_mla_sweep.md"), "w") as f:
            f.write(text + "\n")
    log(f"done in {time.time() - T0:.0f} s; {sum(1 for r in rows if r[7].startswith('ERROR'))} errors")


def _gmean(values):
    import math
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values))


# ---------------------------------------------------------------------------------------------- no GPU: ptxas

def ptxas_table():
    """Each candidate tile compiled for sm_90 on this machine (Triton's bundled ptxas): registers, spilled words,
    shared KB, the MMA kind, for the launch forms DIRECT (one split) and merged (the invariant rule)."""
    os.environ["TRITON_INTERPRET"] = "0"
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from fagen.aot.artifacts import _resource_usage, import_for_compile
    ptrs = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "Dst": "*fp32", "DstLse": "*fp32", "Out": "*bf16",
            "Lse": "*fp32", "Counter": "*i32", "SeqlensK": "*i32", "BlockTable": "*i32"}
    odd = {"seq_q", "seq_k", "chunk", "n_tiles", "page_shift", "num_pages", "qk_scale"}
    target = GPUTarget("cuda", 90, 32)
    print("| regime | tile | launch | registers | spilled words | shared KB | mma |\n|---|---|---|---|---|---|---|")
    for regime, hq, sq, mask, tiles in (("mem", 16, 1, "none", MEM_TILES), ("compute", 128, 2, "causal", COMP_TILES)):
        for tile in tiles:
            fn = import_for_compile(_spec(hq, mask, tile))._decode_split
            rows = min(tile[0], max(16, hq * sq))
            for direct in (True, False):
                cval = dict(HEAD_DIM=D, BLOCK_D=64, HEAD_DIM_V=DV, BLOCK_DV=DV, ROWS=rows, BLOCK_N=tile[1],
                            GQA=hq, DOT=True, DIRECT=direct, SPLITS_PER_SEQ=0 if direct else 32, UPCAST=False,
                            stride_tb=0, stride_tm=0, SeqlensQ=None, TreeMask=None, KScale=None, VScale=None)
                sig, consts, attrs = {}, {}, {}
                for i, n in enumerate(fn.arg_names):
                    if fn.params[i].is_constexpr or n in cval:
                        sig[n], consts[n] = "constexpr", cval[n]
                    else:
                        sig[n] = ptrs.get(n, "fp32" if n == "qk_scale" else "i32")
                        if n not in odd:
                            attrs[(i,)] = [["tt.divisibility", 16]]
                try:
                    opts = make_backend(target).parse_options({"num_warps": tile[2], "num_stages": tile[3]})
                    k = triton.compile(ASTSource(fn, sig, consts, attrs), target=target, options=opts.__dict__)
                    regs, stack, shared = _resource_usage(k.asm["cubin"])
                    ptx = k.asm["ptx"]
                    kind = "wgmma" if "wgmma.mma_async" in ptx else "mma.sync" if "mma.sync" in ptx else "none"
                    print(f"| {regime} | {tname(tile)} | {'direct' if direct else 'merged'} | {regs} | "
                          f"{stack // 4} | {(k.metadata.shared + shared) // 1024} | {kind} |", flush=True)
                except Exception as e:  # noqa: BLE001
                    print(f"| {regime} | {tname(tile)} | {'direct' if direct else 'merged'} | ERROR "
                          f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:100]} | | | |", flush=True)


if __name__ == "__main__":
    if PTXAS:
        ptxas_table()
    else:
        main()
