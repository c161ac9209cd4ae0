"""The window backward's host path per call (issue 26's sliding-window row; benchmarks/mods.md "Sixteenth run"):
fagen.attention lowered to causal+window(1024, 0), B1 H16 S8192 d128 bf16, as the mods suite calls it. Prints the
wall time of 50 back-to-back backward calls without a sync between them (host-bound if above the kernels' time),
the host time a call with the GPU kept ahead (a long kernel queued first), and cProfile's top functions.

    PYTHONPATH=$PWD python3 scripts/gpu_window_host_s16.py
"""

from __future__ import annotations

import cProfile
import pstats
import time

import torch

import fagen


def main():
    print(torch.cuda.get_device_name(), flush=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(1, 16, 8192, 128, generator=g, device="cuda").bfloat16() for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def mask_mod(b, h, qi, ki):
        return (qi >= ki) & (qi - ki <= 1024)

    out = fagen.attention(q, k, v, mask_mod=mask_mod)
    from fagen.runtime import modded
    print("lowered to", modded.LOWERED[0], flush=True)

    def bwd():
        return torch.autograd.grad(out, (q, k, v), do, retain_graph=True)

    for _ in range(5):
        bwd()
    torch.cuda.synchronize()
    n = 50
    t0 = time.perf_counter()
    for _ in range(n):
        bwd()
    host = (time.perf_counter() - t0) / n * 1e3
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / n * 1e3
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(n):
        bwd()
    e1.record()
    torch.cuda.synchronize()
    print(f"back to back: host {host:.3f} ms a call (issue time), wall {wall:.3f} ms, events {e0.elapsed_time(e1) / n:.3f} ms")
    big = torch.randn(8192, 8192, device="cuda")
    for _ in range(3):
        big = big @ big.T / 8192  # keep the GPU busy so the host's issue time is measured alone
    t0 = time.perf_counter()
    for _ in range(20):
        bwd()
    print(f"host a call with the GPU ahead: {(time.perf_counter() - t0) / 20 * 1e3:.3f} ms", flush=True)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        bwd()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    pstats.Stats(prof).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
