"""Time the CUDA backend's forward against the Triton backend and torch SDPA flash (FA2) on one GPU.

Default case: d128 bf16, 16 heads, batch 1, seq 16384, full and causal (the issue's FA2 bar: 361 / 324 TFLOP/s).
Every number is checked first: the CUDA output must match SDPA's within the dtype tolerance, or the row says so.

    python scripts/bench_cuda.py                 # the default cases, default CUDA config plus a small sweep
    python scripts/bench_cuda.py --seq 4096 --batch 4 --no-sweep
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

import fagen  # noqa: E402
from fagen import nvcc  # noqa: E402
from fagen.verify import PropertyFailure, TOLERANCE, compare  # noqa: E402

FA2_BAR = {"none": 361.0, "causal": 324.0}  # d128 bf16 s16k, TFLOP/s (PEERS.md)
# (block_m, block_n, num_warps, num_stages): the default first, then a few neighbours worth knowing about.
SWEEP = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 3), (64, 64, 4, 3), (128, 64, 4, 2)]


def tflops(ms: float, b: int, h: int, s: int, d: int, causal: bool) -> float:
    flops = 4 * b * h * s * s * d * (0.5 if causal else 1.0)  # fwd = 4 B H S^2 D, halved for causal
    return flops / (ms * 1e-3) / 1e12


def sdpa_flash(q, k, v, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", choices=["fp16", "bf16"], default="bf16")
    ap.add_argument("--no-sweep", action="store_true", help="time only the default CUDA config")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_cuda.py needs a CUDA GPU")
    b, h, s, d = args.batch, args.heads, args.seq, args.head_dim
    dtype = getattr(torch, {"fp16": "float16", "bf16": "bfloat16"}[args.dtype])
    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}"
    configs = [None] + ([] if args.no_sweep else SWEEP[1:])

    def cuda_spec(mask, cfg):
        fields = dict(zip(("block_m", "block_n", "num_warps", "num_stages"), cfg)) if cfg else {}
        return fagen.KernelSpec(head_dim=d, mask=mask, dtype=args.dtype, backend="cuda", **fields)

    specs = [cuda_spec(m, c) for m in ("none", "causal") for c in configs]
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 4) as pool:  # nvcc in parallel
        built = dict(zip(specs, pool.map(lambda sp: nvcc.compile_spec(sp, arch), specs)))

    print(f"# {torch.cuda.get_device_name()} ({arch}), torch {torch.__version__}, {nvcc.nvcc_version()}")
    print(f"# b{b} h{h} s{s} d{d} {args.dtype}; TFLOP/s from triton.testing.do_bench medians (ms)")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=dtype, generator=gen) for _ in range(3))
    rows = []
    for mask in ("none", "causal"):
        causal = mask == "causal"
        ref = sdpa_flash(q, k, v, causal)  # Sq == Sk: top-left and bottom-right causal coincide
        fa2 = do_bench(lambda: sdpa_flash(q, k, v, causal))
        triton_mod = fagen.load(fagen.KernelSpec(head_dim=d, mask=mask, dtype=args.dtype))
        tri = do_bench(lambda: triton_mod.forward(q, k, v))
        for cfg in configs:
            spec = cuda_spec(mask, cfg)
            mod = fagen.load(spec)
            try:
                compare("out", mod.forward(q, k, v)[0], ref.double(), **TOLERANCE[spec.dtype])
                ok = "ok"
            except PropertyFailure as e:
                ok = f"WRONG ({str(e)[:80]})"
            ms = do_bench(lambda: mod.forward(q, k, v))
            res = built[spec].resources["fagen_attn_fwd"]
            rows.append((mask, f"m{spec.block_m}n{spec.block_n}w{spec.num_warps}s{spec.num_stages}",
                         tflops(ms, b, h, s, d, causal), tflops(tri, b, h, s, d, causal),
                         tflops(fa2, b, h, s, d, causal), res, ok))
    print(f"{'mask':7} {'cuda config':13} {'cuda':>7} {'triton':>7} {'sdpa-FA2':>8} {'FA2 bar':>7}  "
          f"{'regs':>4} {'spill':>5} {'smem':>7}  check")
    for mask, cfg, cu, tri, fa2, res, ok in rows:
        bar = FA2_BAR[mask] if (d, args.dtype, s) == (128, "bf16", 16384) else float("nan")
        print(f"{mask:7} {cfg:13} {cu:7.1f} {tri:7.1f} {fa2:8.1f} {bar:7.0f}  {res.registers:4d} "
              f"{res.spill_stores:5d} {res.smem:7d}  {ok}")


if __name__ == "__main__":
    main()
