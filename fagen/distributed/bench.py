"""Context-parallel benchmark: one GPU against N GPUs of a ring, TF/s per GPU and scaling efficiency.

Launch on every rank (torchrun starts them):

    torchrun --nproc-per-node 2 -m fagen.distributed.bench --seq 131072 --heads 32 --head-dim 128 \
        --dtype bf16 --mask causal --layout zigzag --check-seq 32768 --json cp.json

Every rank first times the whole problem on its own GPU with the same fagen kernels (the one-GPU baseline; all
GPUs run it at once, so both configurations run with every GPU busy), then the ring over the group on its shard.
FLOPs follow fagen bench's convention: forward 4 * B * Hq * S * S * D (halved for causal), the backward alone 2.5x
that. TF/s per GPU = FLOPs / time / GPUs; efficiency = TF/s per GPU on N GPUs / TF/s on one; speedup = t1 / tN.
With --check-seq, the ring's output and gradients are first compared with the one-GPU kernel's (and the output of
one head with a float64 reference) at that length.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

import fagen
from fagen.distributed.ring import _DTYPES, ring_attention
from fagen.distributed.shard import ContextParallelError, check_layout, gather, shard_for_group

_TORCH_DTYPES = {name: dtype for dtype, name in _DTYPES.items()}
BWD_FACTOR = 2.5  # the backward alone does 2.5x the forward's FLOPs (five matmuls against two)


def fwd_flops(batch, heads, seq, head_dim, mask) -> float:
    return 4.0 * batch * heads * seq * seq * head_dim * (0.5 if mask == "causal" else 1.0)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device, warmup, iters, group=None) -> float:
    """Seconds per call of fn(), the slowest rank's (every rank of `group` calls it together)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    dist.barrier(group=group)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    elapsed = torch.tensor([(time.perf_counter() - start) / max(iters, 1)], dtype=torch.float64,
                           device=device if dist.get_backend(group) != "gloo" else "cpu")
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return float(elapsed)


def _inputs(batch, heads, kv_heads, seq, head_dim, dtype, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(batch, heads, seq, head_dim, generator=g, device=device, dtype=torch.float32).to(dtype)
    k = torch.randn(batch, kv_heads, seq, head_dim, generator=g, device=device, dtype=torch.float32).to(dtype)
    v = torch.randn(batch, kv_heads, seq, head_dim, generator=g, device=device, dtype=torch.float32).to(dtype)
    do = torch.randn(batch, heads, seq, head_dim, generator=g, device=device, dtype=torch.float32).to(dtype)
    return q, k, v, do


def _module(head_dim, gqa, dtype, mask):
    return fagen.load(fagen.KernelSpec(head_dim=head_dim, mask=mask, gqa=gqa, dtype=_DTYPES[dtype], direction="bwd"))


def _peak(device):
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def _reset_peak(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def check_against_one_gpu(*, seq, heads, kv_heads, head_dim, dtype, mask, layout, batch=1, group=None,
                          device=None) -> dict:
    """The ring against the one-GPU kernel on the same full problem: max |difference| of out, dq, dk, dv, and the
    output error of both against float64 on the first head of the first batch entry."""
    device = device or torch.device("cpu")
    mod = _module(head_dim, heads // kv_heads, dtype, mask)
    q, k, v, do = _inputs(batch, heads, kv_heads, seq, head_dim, dtype, device, seed=1)
    out1, lse1 = mod.forward(q, k, v)
    grads1 = mod.backward(do, q, k, v, out1, lse1)
    qs, ks, vs = (shard_for_group(t, group=group, layout=layout).requires_grad_() for t in (q, k, v))
    out = ring_attention(qs, ks, vs, group=group, mask=mask, layout=layout)
    out.backward(shard_for_group(do, group=group, layout=layout))
    ring = [gather(t.detach(), group=group, layout=layout) for t in (out, qs.grad, ks.grad, vs.grad)]
    diff = {name: float((a.float() - b.float()).abs().max()) for name, a, b in
            zip(("out", "dq", "dk", "dv"), ring, (out1, *grads1))}
    scale = {name: float(b.float().abs().max()) for name, b in zip(("out", "dq", "dk", "dv"), (out1, *grads1))}
    # float64 output of head 0 of batch 0, by query chunks (the [S, S] float64 scores of a chunk fit in memory)
    ref = torch.empty(seq, head_dim, dtype=torch.float64, device=device)
    k0, v0 = k[0, 0].double(), v[0, 0].double()
    step = max(1, min(seq, (1 << 28) // max(seq, 1)))
    for i in range(0, seq, step):
        s = q[0, 0, i:i + step].double() @ k0.T / head_dim ** 0.5
        if mask == "causal":
            rows = torch.arange(i, min(i + step, seq), device=device)[:, None]
            s = s.masked_fill(torch.arange(seq, device=device)[None, :] > rows, float("-inf"))
        ref[i:i + step] = torch.softmax(s, -1) @ v0
    err64 = {"ring": float((ring[0][0, 0].double() - ref).abs().max()),
             "one_gpu": float((out1[0, 0].double() - ref).abs().max())}
    return {"kind": "check", "seq": seq, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
            "dtype": _DTYPES[dtype], "mask": mask, "layout": layout, "gpus": dist.get_world_size(group),
            "max_abs_diff_vs_one_gpu": diff, "max_abs_of_one_gpu": scale, "head0_out_max_abs_err_vs_float64": err64}


def run_cp_bench(*, seq: int = 131072, heads: int = 32, kv_heads: int | None = None, head_dim: int = 128,
                 dtype: str = "bf16", mask: str = "causal", layout: str = "zigzag", batch: int = 1,
                 directions=("fwd", "bwd"), warmup: int = 2, iters: int = 5, group=None,
                 device: torch.device | None = None) -> list[dict]:
    """Time attention on one GPU and on the ring over `group`; call on every rank. Returns one row per
    (direction, configuration): ms, TF/s per GPU, speedup and efficiency against one GPU, K/V bytes per GPU, and
    the peak memory allocated during the call (CUDA)."""
    kv_heads = kv_heads or heads
    check_layout(layout)
    if dtype not in _TORCH_DTYPES:
        raise ContextParallelError(f"dtype: got {dtype!r}; use one of {', '.join(_TORCH_DTYPES)}")
    dtype_t = _TORCH_DTYPES[dtype]
    device = device or torch.device("cpu")
    world = dist.get_world_size(group)
    if heads % kv_heads:
        raise ContextParallelError(f"heads: {heads} query heads is no multiple of {kv_heads} K/V heads")
    mod = _module(head_dim, heads // kv_heads, dtype_t, mask)
    flops = fwd_flops(batch, heads, seq, head_dim, mask)
    rows = []
    q, k, v, do = _inputs(batch, heads, kv_heads, seq, head_dim, dtype_t, device, seed=0)
    one = {}
    _reset_peak(device)
    out, lse = mod.forward(q, k, v)
    one["fwd"] = (_timed(lambda: mod.forward(q, k, v), device, warmup, iters, group), _peak(device))
    if "bwd" in directions:
        _reset_peak(device)
        one["bwd"] = (_timed(lambda: mod.backward(do, q, k, v, out, lse), device, warmup, iters, group),
                      _peak(device))
    kv_full = k.nbytes + v.nbytes
    del q, k, v, do, out, lse
    q, k, v, do = (shard_for_group(t, group=group, layout=layout) for t in
                   _inputs(batch, heads, kv_heads, seq, head_dim, dtype_t, device, seed=0))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    ring = {}
    _reset_peak(device)
    with torch.no_grad():
        ring["fwd"] = (_timed(lambda: ring_attention(q, k, v, group=group, mask=mask, layout=layout), device,
                              warmup, iters, group), _peak(device))
    if "bwd" in directions:
        out = ring_attention(q, k, v, group=group, mask=mask, layout=layout)
        _reset_peak(device)
        ring["bwd"] = (_timed(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True), device, warmup,
                              iters, group), _peak(device))
    kv_shard = k.nbytes + v.nbytes
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    common = dict(kind="bench", seq=seq, batch=batch, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                  dtype=dtype, mask=mask, layout=layout, device=name, torch=torch.__version__,
                  triton=_triton_version())
    for direction in directions:
        f = flops * (BWD_FACTOR if direction == "bwd" else 1.0)
        t1, peak1 = one[direction]
        tn, peakn = ring[direction]
        tf1, tfn = f / t1 / 1e12, f / tn / world / 1e12
        rows.append(dict(common, direction=direction, gpus=1, ms=t1 * 1e3, tflops_per_gpu=tf1, speedup=1.0,
                         efficiency=1.0, kv_bytes_per_gpu=kv_full, kv_ring_buffer_bytes=0, peak_bytes_per_gpu=peak1))
        rows.append(dict(common, direction=direction, gpus=world, ms=tn * 1e3, tflops_per_gpu=tfn, speedup=t1 / tn,
                         efficiency=tfn / tf1, kv_bytes_per_gpu=kv_shard,
                         kv_ring_buffer_bytes=kv_shard * min(2, world - 1), peak_bytes_per_gpu=peakn))
    return rows


def _triton_version():
    try:
        import triton
        return triton.__version__
    except ImportError:
        return None


def format_table(rows: list[dict]) -> str:
    lines = ["| direction | GPUs | ms | TF/s per GPU | speedup | efficiency | K/V per GPU (MiB) | ring buffer (MiB) "
             "| peak per GPU (MiB) |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r["kind"] != "bench":
            continue
        peak = "n/a" if r["peak_bytes_per_gpu"] is None else f"{r['peak_bytes_per_gpu'] / 2**20:.0f}"
        lines.append(f"| {r['direction']} | {r['gpus']} | {r['ms']:.2f} | {r['tflops_per_gpu']:.1f} | "
                     f"{r['speedup']:.2f}x | {100 * r['efficiency']:.1f}% | {r['kv_bytes_per_gpu'] / 2**20:.0f} | "
                     f"{r['kv_ring_buffer_bytes'] / 2**20:.0f} | {peak} |")
    return "\n".join(lines)


# Defaults of the flags that --quick shrinks: (full run, --quick). A flag given explicitly wins over both.
_SIZES = {"seq": (131072, 64), "heads": (32, 2), "head_dim": (128, 16), "warmup": (2, 0), "iters": (5, 1)}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fagen.distributed.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=None, help="full sequence length (all ranks together; default 131072)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=None, help="query heads (default 32)")
    p.add_argument("--kv-heads", type=int, default=None, help="K/V heads (default: --heads, MHA)")
    p.add_argument("--head-dim", type=int, default=None, help="default 128")
    p.add_argument("--dtype", default="bf16", choices=list(_TORCH_DTYPES))
    p.add_argument("--mask", default="causal", choices=["none", "causal"])
    p.add_argument("--layout", default="zigzag", choices=["contiguous", "zigzag"])
    p.add_argument("--directions", default="fwd,bwd", help="comma-separated: fwd, bwd")
    p.add_argument("--warmup", type=int, default=None, help="default 2")
    p.add_argument("--iters", type=int, default=None, help="default 5")
    p.add_argument("--check-seq", type=int, default=0, help="first compare the ring with one GPU at this length")
    p.add_argument("--json", default=None, help="write the rows here (rank 0)")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"],
                   help="cuda (NCCL), or cpu: gloo, kernels through Triton's interpreter (default: cuda if present)")
    p.add_argument("--quick", action="store_true", help="a smoke run: tiny shapes, one timed call (flags given win)")
    return p


def _parse(argv) -> argparse.Namespace:
    """The flags, with --quick's sizes or the full run's filled in where none was given."""
    args = _parser().parse_args(argv)
    for name, sizes in _SIZES.items():
        if getattr(args, name) is None:
            setattr(args, name, sizes[args.quick])
    return args


def _validate(args, world: int) -> None:
    """The user errors a rank would hit, found before any process starts; raises ContextParallelError."""
    directions = [d for d in args.directions.split(",") if d]
    if not directions or any(d not in ("fwd", "bwd") for d in directions):
        raise ContextParallelError(f"--directions: got {args.directions!r}; use fwd, bwd or fwd,bwd")
    kv_heads = args.kv_heads or args.heads
    if args.heads < 1 or kv_heads < 1 or args.heads % kv_heads:
        raise ContextParallelError(f"--heads {args.heads} must be a positive multiple of --kv-heads {kv_heads}")
    try:
        fagen.KernelSpec(head_dim=args.head_dim, mask=args.mask, gqa=args.heads // kv_heads, dtype=args.dtype,
                         direction="bwd")
    except fagen.SpecError as e:
        raise ContextParallelError(str(e)) from None
    chunks = world * (2 if args.layout == "zigzag" else 1)
    for flag, seq in (("--seq", args.seq), ("--check-seq", args.check_seq)):
        if seq < 0 or (seq and seq % chunks) or (flag == "--seq" and seq == 0):
            raise ContextParallelError(f"{flag} {seq}: the {args.layout} layout over {world} ranks cuts the sequence "
                                       f"into {chunks} equal chunks; use a positive multiple of {chunks}")


def launch_cp_bench(args: list[str], nproc: int | None = None) -> int:
    """Run this benchmark on `nproc` local processes (cp_command's default) through torchrun
    (torch.distributed.run, standalone rendezvous on this host); returns its exit status. `args` are main()'s
    flags, e.g. ["--seq", "131072", "--json", "cp.json"]. Under torchrun already (RANK set), it runs main(args).
    Bad flags get one line on stderr and status 2 before any process starts."""
    import subprocess

    if "RANK" in os.environ:
        return main(args)
    try:
        cmd, env = cp_command(args, nproc)
    except ContextParallelError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return subprocess.call(cmd, env=env)


def cp_command(args: list[str], nproc: int | None = None) -> tuple[list[str], dict[str, str]]:
    """The torchrun command line and environment of launch_cp_bench: `nproc` ranks (default: one per visible GPU,
    at least 2; 2 on the CPU), and on the CPU TRITON_INTERPRET=1 for every rank ([Note] in fagen/runtime/device.py:
    the mode is read when a kernel is defined). Raises ContextParallelError for bad flags."""
    parsed = _parse(args)
    cpu = _device_type(parsed.device) == "cpu"
    nproc = nproc or (2 if cpu else max(2, torch.cuda.device_count()))
    _validate(parsed, nproc)
    env = dict(os.environ)
    if cpu:
        env["TRITON_INTERPRET"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "fagen.distributed.bench", *args]
    return cmd, env


def _device_type(device: str) -> str:
    """--device auto|cuda|cpu as "cuda" or "cpu"; cuda without a CUDA device is a ContextParallelError."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ContextParallelError(f"--device cuda: torch sees no CUDA device (torch {torch.__version__}); use "
                                   "--device cpu (gloo, kernels through Triton's interpreter)")
    return device


def main(argv=None) -> int:
    args = _parse(argv)
    directions = tuple(d for d in args.directions.split(",") if d)
    if "RANK" not in os.environ:
        _parser().error("run it under torchrun (it reads RANK, WORLD_SIZE, LOCAL_RANK), e.g. "
                        "torchrun --nproc-per-node 2 -m fagen.distributed.bench")
    try:
        _validate(args, int(os.environ.get("WORLD_SIZE", 1)))
        cuda = _device_type(args.device) == "cuda"
    except ContextParallelError as e:
        if os.environ.get("RANK") == "0":
            print(f"error: {e}", file=sys.stderr)
        return 2
    if not cuda:
        from fagen.runtime.device import prepare_device

        prepare_device("cpu")  # TRITON_INTERPRET=1 before any kernel is defined, also under a plain torchrun
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    rank = dist.get_rank()
    shape = dict(heads=args.heads, kv_heads=args.kv_heads or args.heads, head_dim=args.head_dim,
                 mask=args.mask, layout=args.layout, batch=args.batch)
    rows = []
    try:
        if args.check_seq:
            rows.append(check_against_one_gpu(seq=args.check_seq, dtype=_TORCH_DTYPES[args.dtype], device=device,
                                              **shape))
            if rank == 0:
                print(json.dumps(rows[-1]), flush=True)
        rows += run_cp_bench(seq=args.seq, dtype=args.dtype, directions=directions, warmup=args.warmup,
                             iters=args.iters, device=device, **shape)
    except (ContextParallelError, fagen.SpecError) as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr)
        dist.destroy_process_group()
        return 2
    if rank == 0:
        print(format_table(rows), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
