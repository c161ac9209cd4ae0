"""Timing: CUDA events through triton.testing.do_bench (median, L2 flushed, input sets rotated), wall clock on the CPU."""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import time
from typing import Any, Callable

import torch

from fagen.bench.cases import BenchOptions, CaseContext, Prepared, out_of
from fagen.spec.axes import Direction


def measure(call: Callable[[int], Any], n_sets: int, device: torch.device, warmup_ms: float, rep_ms: float) -> float:
    """Median milliseconds of call(i), rotating i over the input sets.

    CUDA: triton.testing.do_bench (CUDA events around each call, the L2 cache flushed between calls,
    warm-up first); the rotation means no two consecutive calls read the same tensors either. CPU: wall clock.
    """
    counter = itertools.count()

    def fn():
        return call(next(counter) % n_sets)

    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    fn()  # warm-up (compiles, fills caches)
    times, start = [], time.perf_counter()  # at least one timed call, then until rep_ms is spent (at most 50)
    while not times or (time.perf_counter() - start) * 1e3 < rep_ms and len(times) < 50:
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def time_prepared(prepared: Prepared, cc: CaseContext, opts: BenchOptions) -> dict:
    """{ms} of the forward, or {ms (backward alone), fwdbwd_ms} of a backward case."""
    c, sets = cc.case, cc.sets
    if c.direction is Direction.FWD:
        with torch.no_grad():
            return {"ms": measure(lambda i: prepared.fn(sets[i]), len(sets), cc.device, opts.warmup_ms, opts.rep_ms)}
    leaves = [[t.detach().clone().requires_grad_() for t in (s.q, s.k, s.v)] for s in sets]
    views = [dataclasses.replace(s, q=lv[0], k=lv[1], v=lv[2]) for s, lv in zip(sets, leaves)]
    outs = [out_of(prepared.fn(vw)) for vw in views]  # graphs kept alive: backward alone is timed
    bwd = measure(lambda i: torch.autograd.grad(outs[i], leaves[i], sets[i].dout, retain_graph=True),
                  len(sets), cc.device, opts.warmup_ms, opts.rep_ms)
    outs.clear()  # free the kept graphs before timing forward + backward
    both = measure(lambda i: torch.autograd.grad(out_of(prepared.fn(views[i])), leaves[i], sets[i].dout),
                   len(sets), cc.device, opts.warmup_ms, opts.rep_ms)
    return {"ms": bwd, "fwdbwd_ms": both}
