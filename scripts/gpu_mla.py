"""GPU check and timings of MLA's absorbed decode (spec shared_kv: d 576 = 512 latent + 64 rope, d_v 512, one
latent cache read once; README "MLA absorbed decode", issue 27) at the issue's shapes.

    PYTHONPATH=$PWD python3 scripts/gpu_mla.py           # under ~150 s on an H100; one table; $OUT/gpu_mla.md if set
    GPU_MLA_DRY=1 PYTHONPATH=$PWD python3 scripts/gpu_mla.py   # the same code on the CPU interpreter, tiny shapes

- Memory-bound: Hq 16 over one latent cache (gqa 16), Sq 1, paged (64-key pages), KV 4k and 32k, batch 32 and 128.
  GB/s counts the bytes actually read (the cache rows once: 576 x 2 bytes a key, plus q and out) against a
  device-to-device copy (read + write) timed here. Target: >= 90% of copy.
- Compute-bound: Hq 128, Sq 2 (MTP), causal. TF/s counts 2 x (576 + 512) flops per (query row, key) seen.
  Target: >= 450 (FlashMLA publishes 660 on the H800, same compute; it cannot travel to this machine, so its
  published figures are quoted, not run).
- The cost of batch invariance (the default since issue 27's run): the default against batch_invariant=False.
- (The fp8 latent cache rows are gone with the feature: the spec refuses it, docs/serving.md.)
- A few tiles beside the defaults (Hq 16: m16n32w4s3, Hq 128: m64n64w8s2 on sm_90; [Note] Latent decode tiles),
  while the time budget lasts.
Every timed kernel is first checked against the float64 reference (V sliced from K) on one sequence.
"""

from __future__ import annotations

import os
import sys
import time

DRY = os.environ.get("GPU_MLA_DRY") == "1"
if DRY:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from gpu_rows import ROWS, T0, guarded, log, row  # noqa: E402
from gpu_rows import bench as _bench  # noqa: E402

import fagen  # noqa: E402
from fagen.spec.axes import DType  # noqa: E402
from fagen.verify import reference  # noqa: E402
from fagen.verify.tolerances import TOLERANCE, compare  # noqa: E402

DEV = "cpu" if DRY else "cuda"
D, DV = (48, 32) if DRY else (576, 512)
PAGE = 16 if DRY else 64
KV = (lambda n: max(40, n // 256)) if DRY else (lambda n: n)
B = (lambda n: min(n, 2)) if DRY else (lambda n: n)
H = (lambda n: min(n, 4)) if DRY else (lambda n: n)
BUDGET_S = 120  # the optional rows (tiles, the dense cache) start only before this
SCALE = 192 ** -0.5  # DeepSeek's softmax scale (qk_nope + qk_rope head dims)


def bench(fn) -> float:
    return _bench(fn, DRY, warmup=10, rep=60)  # ms, median


def tiles_name(tiles):
    return "m{block_m}n{block_n}w{num_warps}s{num_stages}".format(**tiles)


def spec(gqa, mask, layout="paged", **tiles):
    return fagen.KernelSpec(head_dim=D, head_dim_v=DV, shared_kv=True, kind="decode", gqa=gqa, dtype="bf16",
                            mask=mask, layout=layout, **tiles)


def paged_inputs(b, hq, sq, kv, seed=0):
    """q [b, hq, sq, D] and a shuffled page cache holding b sequences of kv keys each."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    pages = kv // PAGE
    q = torch.randn(b, hq, sq, D, device=DEV, generator=gen).bfloat16()
    cache = torch.randn(b * pages, PAGE, 1, D, device=DEV, generator=gen).bfloat16()
    table = torch.randperm(b * pages, device=DEV, generator=gen).to(torch.int32).view(b, pages)
    lens = torch.full((b,), kv, dtype=torch.int32, device=DEV)
    return q, cache, table, lens


def check(m, q, cache, table, lens, mask, dense=False) -> float:
    """The last sequence against the float64 reference on its own keys, V its cache's first DV columns."""
    if dense:
        out, _ = m.forward(q, cache, None, scale=SCALE)
        keys = cache[-1:]
    else:
        out, _ = m.forward(q, cache, None, block_table=table, seqlens_k=lens, scale=SCALE)
        keys = cache[table[-1].long()].reshape(-1, 1, D)[:int(lens[-1])].transpose(0, 1)[None]
    want, _ = reference.attention(q[-1:], keys, None, head_dim_v=DV, mask=mask, scale=SCALE)
    return compare("out", out[-1:], want, **TOLERANCE[DType.BF16])


def copy_bandwidth() -> float:
    x = torch.empty(1 << (20 if DRY else 30), dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x))
    return 2 * x.numel() / ms / 1e6


def memory_bound(peak):
    for b, kv in ((32, 4096), (128, 4096), (32, 32768), (128, 32768)):
        b, kv, hq = B(b), KV(kv), H(16)
        case = f"h{hq} sq1 b{b} kv{kv} page{PAGE}"

        def run():
            m = fagen.load(spec(hq, "none"))
            q, cache, table, lens = paged_inputs(b, hq, 1, kv)
            err = check(m, q, cache, table, lens, "none")
            read = b * kv * D * 2 + q.numel() * 2 * (1 + DV / D)  # the cache once, q, out
            ms = bench(lambda: m.forward(q, cache, None, block_table=table, seqlens_k=lens, scale=SCALE))
            row("mem", case, "fagen", read / ms / 1e6, "GB/s", ms,
                f"{100 * read / ms / 1e6 / peak:.0f}% of copy; err {err:.1e}")
            if (b, kv) in ((B(32), KV(4096)), (B(128), KV(32768))):
                rule = bench(lambda: m.forward(q, cache, None, block_table=table, seqlens_k=lens, scale=SCALE,
                                               batch_invariant=False))
                row("mem", case, "fagen split rule", read / rule / 1e6, "GB/s", rule,
                    f"batch_invariant=False; invariance costs {100 * (ms / rule - 1):+.1f}%")
        guarded("mem", case, "fagen", run)


def compute_bound():
    b, kv, hq, sq = B(64), KV(4096), H(128), 2
    case = f"h{hq} sq{sq} b{b} kv{kv} causal page{PAGE}"
    seen = b * hq * (sq * kv - sq * (sq - 1) // 2)  # (row, key) pairs a causal step sees
    flops = 2 * (D + DV) * seen

    def run():
        m = fagen.load(spec(hq, "causal"))
        q, cache, table, lens = paged_inputs(b, hq, sq, kv, seed=1)
        err = check(m, q, cache, table, lens, "causal")
        ms = bench(lambda: m.forward(q, cache, None, block_table=table, seqlens_k=lens, scale=SCALE))
        row("compute", case, "fagen", flops / ms / 1e9, "TF/s", ms, f"err {err:.1e}")
        rule = bench(lambda: m.forward(q, cache, None, block_table=table, seqlens_k=lens, scale=SCALE,
                                       batch_invariant=False))
        row("compute", case, "fagen split rule", flops / rule / 1e9, "TF/s", rule,
            f"batch_invariant=False; invariance costs {100 * (ms / rule - 1):+.1f}%")
    guarded("compute", case, "fagen", run)
    return case, flops


def tile_sweep(compute_case, flops):
    """Tiles beside the default, on one memory-bound and the compute-bound shape, while the budget lasts."""
    mem = (B(32), KV(32768), H(16), 1, "none")
    comp = (B(64), KV(4096), H(128), 2, "causal")
    # ([Note] Latent decode tiles; scripts/gpu_mla_sweep.py times many more) the defaults before (m64n32w8s2) and
    # the runners-up of the H100 sweep
    for tiles, shapes in ((dict(block_m=64, block_n=32, num_warps=8, num_stages=2), (mem, comp)),
                          (dict(block_m=16, block_n=64, num_warps=8, num_stages=2), (mem,)),
                          (dict(block_m=16, block_n=32, num_warps=8, num_stages=3), (mem,)),
                          (dict(block_m=64, block_n=32, num_warps=8, num_stages=3), (comp,))):
        for b, kv, hq, sq, mask in shapes:
            if time.time() - T0 > BUDGET_S:
                row("tiles", "-", tiles_name(tiles), None, "", None, "skipped: time budget")
                return
            case = compute_case if sq == 2 else f"h{hq} sq1 b{b} kv{kv} page{PAGE}"

            def run():
                m = fagen.load(spec(hq, mask, **tiles))
                q, cache, table, lens = paged_inputs(b, hq, sq, kv, seed=2)
                err = check(m, q, cache, table, lens, mask)
                ms = bench(lambda: m.forward(q, cache, None, block_table=table, seqlens_k=lens, scale=SCALE))
                if sq == 2:
                    row("tiles", case, "fagen " + tiles_name(tiles), flops / ms / 1e9, "TF/s", ms, f"err {err:.1e}")
                else:
                    read = b * kv * D * 2
                    row("tiles", case, "fagen " + tiles_name(tiles), read / ms / 1e6, "GB/s", ms, f"err {err:.1e}")
            guarded("tiles", case, tiles_name(tiles), run)


def dense_cache(peak):
    b, kv, hq = B(32), KV(4096), H(16)
    case = f"h{hq} sq1 b{b} kv{kv} dense"
    if time.time() - T0 > BUDGET_S:
        row("mem", case, "fagen dense", None, "", None, "skipped: time budget")
        return

    def run():
        m = fagen.load(spec(hq, "none", layout="dense"))
        gen = torch.Generator(device=DEV).manual_seed(3)
        q = torch.randn(b, hq, 1, D, device=DEV, generator=gen).bfloat16()
        cache = torch.randn(b, 1, kv, D, device=DEV, generator=gen).bfloat16()
        err = check(m, q, cache, None, None, "none", dense=True)
        read = cache.numel() * 2
        ms = bench(lambda: m.forward(q, cache, None, scale=SCALE))
        row("mem", case, "fagen dense", read / ms / 1e6, "GB/s", ms,
            f"{100 * read / ms / 1e6 / peak:.0f}% of copy; err {err:.1e}")
    guarded("mem", case, "fagen dense", run)


def main() -> None:
    if not torch.cuda.is_available() and not DRY:
        sys.exit("gpu_mla.py needs a CUDA GPU (GPU_MLA_DRY=1 rehearses it on the CPU)")
    log(f"{'CPU rehearsal' if DRY else torch.cuda.get_device_name()}  torch {torch.__version__}  "
        f"fagen {fagen.__file__}")
    peak = copy_bandwidth()
    row("mem", "device copy (read + write)", "torch copy_", peak, "GB/s", None)
    row("mem", "h16 sq1 b32-128 kv4k-32k", "FlashMLA (published)", 3000.0, "GB/s", None,
        "H800 figure from its README, not run here")
    memory_bound(peak)
    row("compute", "h128 sq2", "FlashMLA (published)", 660.0, "TF/s", None, "H800 figure, not run here")
    case, flops = compute_bound()
    dense_cache(peak)
    tile_sweep(case, flops)
    lines = ["| section | case | impl | value | ms | note |", "|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join(r) + " |" for r in ROWS]
    text = "\n".join(lines)
    print("\n" + text)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_mla.md"), "w") as f:
            f.write(text + "\n")
    failed = [r for r in ROWS if r[5].startswith("ERROR")]
    log(f"done in {time.time() - T0:.0f} s; {len(failed)} errors")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
