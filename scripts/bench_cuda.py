"""Time the CUDA backend's forward against the Triton backend and torch SDPA (flash = FA2, cuDNN) on one GPU.

Default case: d128 bf16, 16 heads, batch 1, seq 16384, full and causal (the issue's FA2 bar: 361 / 324 TFLOP/s).
Every CUDA number is checked first: its output must match SDPA's within the dtype tolerance, or the row says so.

    python scripts/bench_cuda.py                          # default CUDA config, a sweep of others, the peers
    python scripts/bench_cuda.py --no-sweep               # default config and the peers only
    python scripts/bench_cuda.py --configs m128n64w4s2,m128n32w4s3 --masks causal
    python scripts/bench_cuda.py --seq 4096 --batch 4 --json out.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

import fagen  # noqa: E402
from fagen.aot import nvcc  # noqa: E402
from fagen.verify.tolerances import TOLERANCE, PropertyFailure, compare  # noqa: E402

FA2_BAR = {"none": 361.0, "causal": 324.0}  # d128 bf16 s16k, TFLOP/s (PEERS.md)
# Configs worth knowing about next to the default: stages, 32 keys a step, 16 rows per warp (Q in registers),
# 8 warps of 32 rows.
SWEEP = ("m128n64w4s3", "m128n32w4s2", "m128n32w4s3", "m128n64w8s2", "m64n64w4s2", "m256n64w8s2")
_CONFIG = re.compile(r"m(\d+)n(\d+)w(\d+)s(\d+)")


def parse_config(text: str) -> dict:
    """'m128n64w4s2' -> {block_m: 128, block_n: 64, num_warps: 4, num_stages: 2}."""
    m = _CONFIG.fullmatch(text)
    if m is None:
        raise argparse.ArgumentTypeError(f"config {text!r}: spell it like m128n64w4s2")
    return dict(zip(("block_m", "block_n", "num_warps", "num_stages"), map(int, m.groups())))


def config_name(spec) -> str:
    return f"m{spec.block_m}n{spec.block_n}w{spec.num_warps}s{spec.num_stages}"


def tflops(ms: float, b: int, h: int, s: int, d: int, causal: bool) -> float:
    flops = 4 * b * h * s * s * d * (0.5 if causal else 1.0)  # fwd = 4 B H S^2 D, halved for causal
    return flops / (ms * 1e-3) / 1e12


def sdpa(backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    which = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]

    def run(q, k, v, causal):
        with sdpa_kernel(which):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return run


def bench_ms(fn, rep: int) -> float:
    return do_bench(fn, warmup=25, rep=rep)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", choices=["fp16", "bf16"], default="bf16")
    ap.add_argument("--masks", default="none,causal", help="comma-separated: none, causal")
    ap.add_argument("--configs", default=None, help="comma-separated CUDA configs (m128n64w4s2 ...) after the default")
    ap.add_argument("--no-sweep", action="store_true", help="time only the default CUDA config")
    ap.add_argument("--no-peers", action="store_true", help="skip SDPA and the Triton backend")
    ap.add_argument("--rep", type=int, default=200, help="do_bench milliseconds per measurement")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_cuda.py needs a CUDA GPU")
    b, h, s, d = args.batch, args.heads, args.seq, args.head_dim
    dtype = getattr(torch, {"fp16": "float16", "bf16": "bfloat16"}[args.dtype])
    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}"
    masks = args.masks.split(",")
    if args.configs:
        extra = args.configs.split(",")
    else:
        extra = [] if args.no_sweep else list(SWEEP)
    configs = [{}] + [parse_config(c) for c in extra]

    specs = []
    for mask in masks:
        for cfg in configs:
            try:
                spec = fagen.KernelSpec(head_dim=d, mask=mask, dtype=args.dtype, backend="cuda", **cfg)
            except fagen.SpecError as e:
                print(f"# skipped {cfg}: {e}")
                continue
            if spec not in specs:
                specs.append(spec)
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 4) as pool:  # nvcc in parallel
        built = dict(zip(specs, pool.map(lambda sp: nvcc.compile_spec(sp, arch), specs)))

    print(f"# {torch.cuda.get_device_name()} ({arch}), torch {torch.__version__}, {nvcc.nvcc_version()}")
    print(f"# b{b} h{h} s{s} d{d} {args.dtype}; TFLOP/s from triton.testing.do_bench medians (rep {args.rep} ms)")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=dtype, generator=gen) for _ in range(3))
    rows = []
    for mask in masks:
        causal = mask == "causal"
        ref = sdpa("flash")(q, k, v, causal)  # Sq == Sk: top-left and bottom-right causal coincide

        def row(kind, name, ms, res=None, ok=""):
            rows.append({"mask": mask, "kind": kind, "config": name, "ms": ms,
                         "tflops": tflops(ms, b, h, s, d, causal),
                         "registers": res.registers if res else None, "spill_bytes": res.spill_stores if res else None,
                         "smem": res.smem if res else None, "check": ok})

        if not args.no_peers:
            for peer in ("flash", "cudnn"):
                try:
                    fn = sdpa(peer)
                    fn(q, k, v, causal)
                    row(f"sdpa-{peer}", "", bench_ms(lambda: fn(q, k, v, causal), args.rep))
                except Exception as e:  # a backend this torch build or GPU lacks
                    print(f"# sdpa {peer}: {type(e).__name__}: {str(e)[:100]}")
            triton_spec = fagen.KernelSpec(head_dim=d, mask=mask, dtype=args.dtype)
            triton_mod = fagen.load(triton_spec)
            row("triton", config_name(triton_spec), bench_ms(lambda: triton_mod.forward(q, k, v), args.rep))
        for spec in (sp for sp in specs if sp.mask.value == mask):
            mod = fagen.load(spec)
            try:
                compare("out", mod.forward(q, k, v)[0], ref.double(), **TOLERANCE[spec.dtype])
                ok = "ok"
            except PropertyFailure as e:
                ok = f"WRONG ({str(e)[:80]})"
            row("cuda", config_name(spec), bench_ms(lambda: mod.forward(q, k, v), args.rep),
                built[spec].resources["fagen_attn_fwd"], ok)
            torch.cuda.synchronize()

    print(f"{'mask':7} {'kernel':12} {'config':13} {'TF/s':>7} {'ms':>8} {'bar':>5}  {'regs':>4} {'spill':>5} "
          f"{'smem':>7}  check")
    for r in rows:
        bar = FA2_BAR.get(r["mask"], float("nan")) if (d, args.dtype, s) == (128, "bf16", 16384) else float("nan")
        res = (f"{r['registers']:4d} {r['spill_bytes']:5d} {r['smem']:7d}" if r["registers"] is not None
               else f"{'':4} {'':5} {'':7}")
        print(f"{r['mask']:7} {r['kind']:12} {r['config']:13} {r['tflops']:7.1f} {r['ms']:8.3f} {bar:5.0f}  {res}  "
              f"{r['check']}")
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "arch": arch, "batch": b,
                                         "heads": h, "seq": s, "head_dim": d, "dtype": args.dtype, "rows": rows},
                                        indent=1))


if __name__ == "__main__":
    main()
