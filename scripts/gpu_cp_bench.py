"""Ring vs Ulysses vs hybrid on N GPUs (torchrun), with a correctness check first; writes tables to benchmarks/cp/.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
        torchrun --standalone --nproc-per-node 4 scripts/gpu_cp_bench.py

1. Check (seq 2048 * N, bf16, d128): ring (zigzag), Ulysses and hybrid (when N >= 4) against fagen.attention on the
   whole problem on one GPU, causal GQA 32/8 and full MHA, outputs and gradients; then packed documents (ring with
   the greedy plan, Ulysses) against the varlen kernel on one GPU. Prints max |diff| / max |one GPU| per tensor and
   PASS when every ratio is below 2% (bf16: the blocks' partial dK/dV are rounded to bf16 before they are summed).
2. Bench: the same three at per-GPU lengths 16k and 64k (s128k and s512k on 8 GPUs; s32k/s128k on 2,
   s64k/s256k on 4), masks none and causal, MHA 32/32 and GQA 32/8, d128 bf16, batch 1: forward (no_grad) and
   backward alone (autograd.grad, graph kept), mean of --iters calls after one warm-up, the slowest rank's.
   TF/s per GPU counts fagen bench's FLOPs (forward 4*S^2*H*D, halved for causal; backward 2.5x).
FAGEN_HOPPER=0 is set so every method runs the same Triton kernels (the ring has no Gluon path).
Writes $OUT (default benchmarks/cp) / cp-compare-{N}gpu.json and .md; rank 0 prints the table at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

os.environ.setdefault("FAGEN_HOPPER", "0")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import fagen  # noqa: E402
import fagen.distributed as cp  # noqa: E402

D, DTYPE, DEV = 128, torch.bfloat16, "cuda"
HEADS = ((32, 32), (32, 8))  # MHA, GQA 32/8


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def timed(fn, iters):
    fn()
    sync()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    t = torch.tensor([(time.perf_counter() - start) / iters], device=DEV, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def methods(world, groups):
    """name -> (attention on shards, shard a full [B, H, S, D] tensor, gather one back)."""
    out = {"ring": (lambda q, k, v, mask: cp.ring_attention(q, k, v, mask=mask, layout="zigzag"),
                    lambda t: cp.shard_for_group(t, layout="zigzag"), lambda t: cp.gather(t, layout="zigzag")),
           "ulysses": (lambda q, k, v, mask: cp.ulysses_attention(q, k, v, mask=mask, layout="zigzag"),
                       lambda t: cp.shard_for_group(t, layout="zigzag"), lambda t: cp.gather(t, layout="zigzag"))}
    if groups is not None:
        out[f"hybrid u{groups.ulysses_degree}xr{groups.ring_degree}"] = (
            lambda q, k, v, mask: cp.hybrid_attention(q, k, v, groups=groups, mask=mask, layout="zigzag"),
            lambda t: groups.shard(t, layout="zigzag"), lambda t: groups.gather(t, layout="zigzag"))
    return out


def inputs(hq, hkv, seq, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return [torch.randn(1, h, seq, D, generator=g, device=DEV).to(DTYPE) for h in (hq, hkv, hkv, hq)]


def ratios(got, want):
    return {n: float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6))
            for n, a, b in zip(("out", "dq", "dk", "dv"), got, want)}


def check(world, groups, rank):
    rows = []
    seq = (2048 if DEV == "cuda" else 16) * world
    (mha, gqa) = HEADS
    for mask, hq, hkv in (("causal", *gqa), ("none", *mha)):
        q, k, v, do = inputs(hq, hkv, seq, seed=1)
        ref = [t.detach() for t in (q, k, v)]
        ref = [t.requires_grad_() for t in ref]
        out1 = fagen.attention(*ref, mask=mask)
        want = [out1.detach(), *torch.autograd.grad(out1, ref, do)]
        for name, (fn, shard, gather) in methods(world, groups).items():
            qs, ks, vs = (shard(t).requires_grad_() for t in (q, k, v))
            out = fn(qs, ks, vs, mask)
            grads = torch.autograd.grad(out, (qs, ks, vs), shard(do))
            got = [gather(t.detach()) for t in (out, *grads)]
            rows.append(dict(kind="check", method=name, mask=mask, heads=f"{hq}/{hkv}", seq=seq,
                             ratio=ratios(got, want)))
    # packed documents: lengths 128 .. seq/2, log-uniform, packed to seq
    rng, lengths = random.Random(0), []
    while sum(lengths) < seq:
        low = 7 if DEV == "cuda" else 2
        lengths.append(min(int(2 ** rng.uniform(low, max(low + 1, (seq // 2).bit_length() - 1))), seq - sum(lengths)))
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    g = torch.Generator(device=DEV).manual_seed(2)
    q, k, v, do = (torch.randn(seq, h, D, generator=g, device=DEV).to(DTYPE) for h in (*gqa, gqa[1], gqa[0]))
    cu_t = torch.tensor(cu, dtype=torch.int32, device=DEV)
    ref = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out1 = fagen.attention(*ref, mask="causal", cu_seqlens_q=cu_t, cu_seqlens_k=cu_t, max_seqlen_q=max(lengths),
                           max_seqlen_k=max(lengths))
    want = [out1.detach(), *torch.autograd.grad(out1, ref, do)]
    plan = cp.plan_documents(cu, world, balance="greedy", mask="causal", min_chunk=256 if DEV == "cuda" else 2)
    for name, fn in (("ring packed", cp.ring_attention), ("ulysses packed", cp.ulysses_attention)):
        qs, ks, vs = (plan.shard(t, rank).requires_grad_() for t in (q, k, v))
        out = fn(qs, ks, vs, mask="causal", plan=plan)
        grads = torch.autograd.grad(out, (qs, ks, vs), plan.shard(do, rank))
        got = [plan.gather(t.detach()) for t in (out, *grads)]
        rows.append(dict(kind="check", method=name, mask="causal", heads=f"{gqa[0]}/{gqa[1]}", seq=seq,
                         docs=len(lengths),
                         ratio=ratios(got, want), balance=plan.balance_stats()["ratio"]))
    return rows


def bench(world, groups, per_gpu, iters):
    rows = []
    for seq in (per_gpu[0] * world, per_gpu[1] * world):
        for mask in ("causal", "none"):
            for hq, hkv in HEADS:
                full = inputs(hq, hkv, seq)
                flops = 4.0 * seq * seq * hq * D * (0.5 if mask == "causal" else 1.0)
                for name, (fn, shard, _) in methods(world, groups).items():
                    q, k, v, do = (shard(t) for t in full)
                    q, k, v = (t.requires_grad_() for t in (q, k, v))
                    if DEV == "cuda":
                        torch.cuda.reset_peak_memory_stats()
                    with torch.no_grad():
                        t_fwd = timed(lambda: fn(q, k, v, mask), iters)
                    out = fn(q, k, v, mask)
                    t_bwd = timed(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True), iters)
                    peak = torch.cuda.max_memory_allocated() / 2**30 if DEV == "cuda" else 0.0
                    rows.append(dict(kind="bench", method=name, seq=seq, mask=mask, heads=f"{hq}/{hkv}", gpus=world,
                                     fwd_ms=t_fwd * 1e3, bwd_ms=t_bwd * 1e3, fwd_tflops=flops / t_fwd / world / 1e12,
                                     bwd_tflops=2.5 * flops / t_bwd / world / 1e12, peak_gib=peak))
                    del q, k, v, do, out
                del full
                if DEV == "cuda":
                    torch.cuda.empty_cache()
    return rows


def table(rows):
    lines = ["| seq | mask | heads | method | fwd ms | fwd TF/s/GPU | bwd ms | bwd TF/s/GPU | peak GiB/GPU |",
             "|---|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r["kind"] == "bench":
            seq = f"{r['seq'] // 1024}k" if r["seq"] >= 1024 else str(r["seq"])
            lines.append(f"| {seq} | {r['mask']} | {r['heads']} | {r['method']} | {r['fwd_ms']:.1f} | "
                         f"{r['fwd_tflops']:.0f} | {r['bwd_ms']:.1f} | {r['bwd_tflops']:.0f} | {r['peak_gib']:.1f} |")
    lines += ["", "| check | mask | heads | seq | max diff / max (out, dq, dk, dv) | verdict |",
              "|---|---|---|---|---|---|"]
    for r in rows:
        if r["kind"] == "check":
            worst = max(r["ratio"].values())
            lines.append(f"| {r['method']} | {r['mask']} | {r['heads']} | {r['seq']} | "
                         + ", ".join(f"{x:.1e}" for x in r["ratio"].values())
                         + f" | {'PASS' if worst < 0.02 else 'FAIL'} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--per-gpu", default="16384,65536", help="two per-GPU lengths (the sequence is N times each)")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--ulysses-degree", type=int, default=0, help="hybrid's Ulysses degree (default: 2, N >= 4)")
    p.add_argument("--skip-bench", action="store_true")
    p.add_argument("--cpu-smoke", action="store_true", help="gloo, tiny fp32 shapes, Triton's interpreter: the "
                   "script's code paths on a CPU machine (timings mean nothing)")
    args = p.parse_args()
    global D, DTYPE, DEV, HEADS
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        D, DTYPE, DEV, HEADS = 16, torch.float32, "cpu", ((4, 4), (4, 2))
        dist.init_process_group("gloo")
    else:
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    world, rank = dist.get_world_size(), dist.get_rank()
    u = args.ulysses_degree or (2 if world >= 4 else 0)
    groups = cp.hybrid_groups(ulysses_degree=u) if u and u < world else None
    start = time.time()
    rows = check(world, groups, rank)
    if rank == 0:
        print(table(rows), f"\n(check took {time.time() - start:.0f} s)", flush=True)
    if not args.skip_bench:
        rows += bench(world, groups, [int(x) for x in args.per_gpu.split(",")], args.iters)
    if rank == 0:
        out = os.environ.get("OUT") or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                    "benchmarks", "cp")
        name = f"cp-compare-{world}gpu"
        device = torch.cuda.get_device_name() if DEV == "cuda" else "cpu (smoke)"
        text = (f"# ring vs Ulysses vs hybrid on {world} x {device}\n\ntorch {torch.__version__}, "
                f"{time.strftime('%Y-%m-%d')}, `torchrun --standalone --nproc-per-node {world} "
                f"scripts/gpu_cp_bench.py {' '.join(sys.argv[1:])}` ({time.time() - start:.0f} s)\n\n{table(rows)}\n")
        with open(os.path.join(out, name + ".json"), "w") as f:
            json.dump(rows, f, indent=1)
        with open(os.path.join(out, name + ".md"), "w") as f:
            f.write(text)
        print(text, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
