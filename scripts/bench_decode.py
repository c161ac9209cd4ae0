#!/usr/bin/env python
"""Time fagen's split-KV decode kernel on the issue's shapes for several configs and print GB/s of K+V read."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

# Decided before any kernel is decorated: without a GPU the smoke shapes run through Triton's interpreter.
if "--smoke" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing
import fagen  # noqa: E402
from triton.errors import TritonError  # noqa: E402
from fagen.verify.tolerances import LSE_TOLERANCE, TOLERANCE, PropertyFailure, compare  # noqa: E402

# The decode shapes: bf16, 32 query heads over 8 KV heads (gqa 4), head_dim 128, one query token.
CASES = {"kv32768_b8": dict(batch=8, seq_k=32768), "kv8192_b32": dict(batch=32, seq_k=8192)}
HEADS_Q, HEADS_KV, HEAD_DIM, SEQ_Q = 32, 8, 128, 1
TARGET_GBS = 2800
PEERS_GBS = "cuDNN 2940 / 2958, FA2 2912 / 2588, FlexAttention 949 / 2611 (32768 x b8 / 8192 x b32)"
SMOKE = dict(cases={"smoke_kv200_b2": dict(batch=2, seq_k=200)}, heads_q=8, heads_kv=2, head_dim=32,
             splits=[None, 1, 3], block_n=[16, 32], warps=[4], stages=[2])


def kv_bytes(batch, heads_kv, seq_k, head_dim, itemsize=2):
    """Bytes of K and V one forward reads: the numerator of the bandwidth."""
    return 2 * batch * heads_kv * seq_k * head_dim * itemsize


def make_inputs(batch, heads_q, heads_kv, seq_k, head_dim, device, seed):
    """Fresh normal q, k, v in bf16 from one seed."""
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = lambda h, s: (batch, h, s, head_dim)  # noqa: E731
    return tuple(torch.randn(shape(h, s), generator=gen, device=device, dtype=torch.bfloat16)
                 for h, s in ((heads_q, SEQ_Q), (heads_kv, seq_k), (heads_kv, seq_k)))


def reference(q, k, v):
    """(out, lse) in float32 on the device: out from torch SDPA, lse from the scores, both with K/V per group."""
    q32, k32, v32 = q.float(), k.float(), v.float()
    out = F.scaled_dot_product_attention(q32, k32, v32, enable_gqa=True)
    b, hq, sq, d = q.shape
    hkv = k.shape[1]
    grouped = q32.reshape(b, hkv, (hq // hkv) * sq, d)  # query head h reads KV head h // gqa
    lse = torch.logsumexp(grouped @ k32.transpose(-1, -2) * d ** -0.5, -1).reshape(b, hq, sq)
    return out, lse


def timed_ms(fn, on_gpu):
    """Median milliseconds of fn(): triton.testing.do_bench on the GPU, a couple of wall-clock calls otherwise."""
    if on_gpu:
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()
    samples = []
    for _ in range(2):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def peer_rows(case, sets, nbytes, on_gpu):
    """torch SDPA with each backend forced, on the same inputs, as points of comparison (GPU only)."""
    if not on_gpu:
        return []
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = []
    for impl, backend in (("sdpa-flash", SDPBackend.FLASH_ATTENTION), ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("sdpa-efficient", SDPBackend.EFFICIENT_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                ms = statistics.median(timed_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                                                on_gpu) for q, k, v in sets)
        except RuntimeError as e:  # backend refuses GQA or these shapes
            print(f"  {impl:<44} n/a ({str(e).splitlines()[0][:60]})")
            continue
        rows.append(dict(case=case, impl=impl, ms=ms, tflops=None, gbs=nbytes / ms / 1e6, config=None))
        print(f"  {impl:<44} {ms:8.4f} ms {rows[-1]['gbs']:8.0f} GB/s")
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes and a small sweep (CPU interpreter works)")
    ap.add_argument("--cases", nargs="*", choices=list(CASES), help="subset of the target shapes")
    ap.add_argument("--splits", nargs="*", help="num_splits values to try ('auto' = the module's choice)")
    ap.add_argument("--block-n", nargs="*", type=int, help="block_n values to try")
    ap.add_argument("--warps", nargs="*", type=int, help="num_warps values to try")
    ap.add_argument("--stages", nargs="*", type=int, help="num_stages values to try")
    ap.add_argument("--sets", type=int, default=2, help="fresh random input sets per case (median over them)")
    ap.add_argument("--json", type=Path, help="write {case, impl, ms, tflops, gbs, config} records here")
    args = ap.parse_args(argv)

    on_gpu = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
    if not on_gpu and not args.smoke:
        ap.error("no CUDA device: run with --smoke (tiny shapes through TRITON_INTERPRET=1)")
    device = "cuda" if on_gpu else "cpu"
    if args.smoke:
        cases, hq, hkv, d = SMOKE["cases"], SMOKE["heads_q"], SMOKE["heads_kv"], SMOKE["head_dim"]
        splits, block_ns, warps, stages = SMOKE["splits"], SMOKE["block_n"], SMOKE["warps"], SMOKE["stages"]
    else:
        cases = {c: CASES[c] for c in (args.cases or CASES)}
        hq, hkv, d = HEADS_Q, HEADS_KV, HEAD_DIM
        splits, block_ns, warps, stages = [None, 1, 2, 4, 8, 16], [64, 128], [4, 8], [2, 3, 4]
    if args.splits:
        splits = [None if s == "auto" else int(s) for s in args.splits]
    block_ns, warps, stages = args.block_n or block_ns, args.warps or warps, args.stages or stages
    if on_gpu:
        props = torch.cuda.get_device_properties(0)
        print(f"device: {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}")
    print(f"bf16, {hq} query heads / {hkv} KV heads, head_dim {d}, Sq {SEQ_Q}; target >= {TARGET_GBS} GB/s; "
          f"peers: {PEERS_GBS}")

    records, failures = [], 0
    for case, shape in cases.items():
        b, sk = shape["batch"], shape["seq_k"]
        nbytes = kv_bytes(b, hkv, sk, d)
        sets = [make_inputs(b, hq, hkv, sk, d, device, seed) for seed in range(args.sets)]
        refs = [reference(*s) for s in sets]
        print(f"\n{case}: batch {b}, KV length {sk}, K+V {nbytes / 1e9:.3f} GB")
        records += peer_rows(case, sets, nbytes, on_gpu)
        for block_n, nw, ns in itertools.product(block_ns, warps, stages):
            spec = fagen.KernelSpec(head_dim=d, gqa=hq // hkv, dtype="bf16", kind="decode", block_n=block_n,
                                    num_warps=nw, num_stages=ns)
            mod = fagen.load(spec)
            for n in splits:
                used = n if n is not None else mod.num_splits_for(b * hkv, sk, mod.sm_count(0))
                label = f"fagen n{'auto=' if n is None else ''}{used} bn{block_n} w{nw} s{ns}"
                run = lambda q, k, v: mod.forward_split(q, k, v, num_splits=n)  # noqa: E731
                try:
                    for (q, k, v), (ref_out, ref_lse) in zip(sets, refs):  # correct before it is timed
                        out, lse = run(q, k, v)
                        compare("out", out, ref_out, **TOLERANCE[spec.dtype])
                        compare("lse", lse, ref_lse, **LSE_TOLERANCE)
                    ms = statistics.median(timed_ms(lambda: run(q, k, v), on_gpu) for q, k, v in sets)
                except (PropertyFailure, RuntimeError, TritonError) as e:  # wrong, or out of shared memory
                    failures += isinstance(e, PropertyFailure)
                    print(f"  {label:<44} FAILED: {str(e).splitlines()[0][:100]}")
                    continue
                gbs = nbytes / ms / 1e6
                config = dict(block_n=block_n, num_warps=nw, num_stages=ns, num_splits=used, auto=n is None)
                records.append(dict(case=case, impl="fagen", ms=ms, tflops=None, gbs=gbs, config=config))
                print(f"  {label:<44} {ms:8.4f} ms {gbs:8.4g} GB/s")

    print("\nbest fagen config per case:")
    for case in cases:
        mine = [r for r in records if r["case"] == case and r["impl"] == "fagen"]
        if not mine:
            print(f"  {case}: no config ran")
            continue
        best = max(mine, key=lambda r: r["gbs"])
        auto = max((r for r in mine if r["config"]["auto"]), key=lambda r: r["gbs"], default=None)
        verdict = "meets" if best["gbs"] >= TARGET_GBS else f"misses by {TARGET_GBS - best['gbs']:.0f} GB/s"
        print(f"  {case}: {best['gbs']:.0f} GB/s with {best['config']} ({verdict} the {TARGET_GBS} target)")
        if auto:
            print(f"  {case}: with the module's own num_splits at best {auto['gbs']:.0f} GB/s ({auto['config']})")
    if args.json:
        args.json.write_text(json.dumps(records, indent=1))
        print(f"wrote {len(records)} records to {args.json}")
    if failures:
        print(f"{failures} config(s) gave wrong output")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
