"""Sweep launch configs of the paged decode kernel on the layouts suite's shapes (H100), against dense decode.

    python scripts/paged_sweep.py [--json OUT]
"""
import argparse
import itertools
import json

import torch

from fagen.bench.layouts import PAGED, _paged_inputs, paged_bytes
from fagen.bench.timing import measure
from fagen.runtime.loader import load
from fagen.spec.kernel import KernelSpec, SpecError

ap = argparse.ArgumentParser()
ap.add_argument("--json")
args = ap.parse_args()
rows = []
for c in PAGED:
    q, k, v, kc, vc, table, lens = _paged_inputs(c, "cuda", torch.bfloat16)
    nbytes = paged_bytes(q, k, v, table)
    dense = load(KernelSpec(head_dim=128, gqa=4, dtype="bf16", kind="decode"))
    ms = measure(lambda i: dense.forward(q, k, v), 1, torch.device("cuda"), 25, 200)
    print(f"{c.name} dense default {nbytes / ms / 1e6:.0f} GB/s", flush=True)
    want, _ = dense.forward(q, k, v)
    for bn, w, st in itertools.product((32, 64, 128), (4, 8), (2, 3, 4)):
        try:
            spec = KernelSpec(head_dim=128, gqa=4, dtype="bf16", kind="decode", layout="paged", block_n=bn,
                              num_warps=w, num_stages=st)
            m = load(spec)
            got, _ = m.forward(q, kc, vc, block_table=table, seqlens_k=lens)
            err = (got.float() - want.float()).abs().max().item()
            ms = measure(lambda i: m.forward(q, kc, vc, block_table=table, seqlens_k=lens), 1,
                         torch.device("cuda"), 25, 200)
        except (SpecError, RuntimeError, Exception) as e:  # out of resources and the like: recorded
            print(f"{c.name} n{bn} w{w} s{st}: {type(e).__name__} {str(e)[:100]}", flush=True)
            continue
        rows.append(dict(case=c.name, block_n=bn, num_warps=w, num_stages=st, gbs=nbytes / ms / 1e6, err=err))
        print(f"{c.name} n{bn} w{w} s{st}: {nbytes / ms / 1e6:.0f} GB/s err {err:.1e}", flush=True)
if args.json:
    json.dump(rows, open(args.json, "w"), indent=1)
