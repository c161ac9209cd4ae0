"""Forward config sweep on a GPU: correctness against SDPA, then TFLOP/s per (block_m, block_n, warps, stages).

Usage: python scripts/gpu_forward_sweep.py [--quick]. Writes JSON lines to $OUT/sweep.jsonl when OUT is set.
"""

import itertools
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

import fagen

CASES = [  # name, D, mask, gqa, B, Hq, S
    ("fwd d128 full s16k", 128, "none", 1, 1, 16, 16384),
    ("fwd d128 causal s16k", 128, "causal", 1, 1, 16, 16384),
    ("fwd d64 causal s16k", 64, "causal", 1, 1, 32, 16384),
]
quick = "--quick" in sys.argv
grid = list(itertools.product((128,), (64, 128), (4, 8), (2, 3, 4)))
if quick:
    grid = [(128, 64, 8, 3), (128, 128, 8, 3)]
out_path = os.path.join(os.environ.get("OUT", "/tmp"), "sweep.jsonl")
log = open(out_path, "a")


def tflops(ms, b, h, s, d, causal):
    return 4 * b * h * s * s * d / (2 if causal else 1) / ms / 1e9


for name, d, mask, gqa, b, hq, s in CASES:
    causal = mask == "causal"
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, hq, s, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    for backend, label in ((SDPBackend.FLASH_ATTENTION, "sdpa-flash"), (SDPBackend.CUDNN_ATTENTION, "sdpa-cudnn")):
        try:
            with sdpa_kernel(backend):
                ms = do_bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), return_mode="median")
            print(f"{name:24s} {label:12s} {ms:8.3f} ms {tflops(ms, b, hq, s, d, causal):6.0f} TF/s", flush=True)
        except Exception as e:  # a peer that refuses the case is recorded, not fatal
            print(f"{name:24s} {label:12s} failed: {str(e)[:80]}", flush=True)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    for bm, bn, w, st in grid:
        spec = fagen.KernelSpec(head_dim=d, mask=mask, gqa=gqa, dtype="bf16", block_m=bm, block_n=bn,
                                num_warps=w, num_stages=st)
        t0 = time.time()
        try:
            mod = fagen.load(spec)
            out, lse = mod.forward(q, k, v)
            err = (out.float() - ref.float()).abs().max().item()
            ms = do_bench(lambda: mod.forward(q, k, v), return_mode="median")
        except Exception as e:
            print(f"{name:24s} m{bm}n{bn}w{w}s{st} failed: {type(e).__name__}: {str(e)[:100]}", flush=True)
            continue
        tf = tflops(ms, b, hq, s, d, causal)
        print(f"{name:24s} m{bm}n{bn}w{w}s{st:<3d} {ms:8.3f} ms {tf:6.0f} TF/s  err {err:.1e}  "
              f"({time.time() - t0:.1f}s)", flush=True)
        log.write(json.dumps(dict(case=name, spec=spec.to_dict(), ms=ms, tflops=tf, err=err)) + "\n")
        log.flush()
