"""Timing: CUDA events through triton.testing.do_bench (median, L2 flushed, input sets rotated), wall clock on the CPU."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import statistics
import time
from typing import Any, Callable

import torch

from fagen.bench.cases import BenchOptions, CaseContext, Prepared, out_of
from fagen.bench.inputs import set_bytes
from fagen.bench.workloads import copy_relative
from fagen.spec.axes import Direction


# [Note] L2 flush
# triton.testing.do_bench empties the L2 before each timed call by zeroing a 256 MB buffer. That leaves the L2 full of
# dirty lines, and the call's first reads evict them: a read-only call (a decode step) pays their write-back inside
# its timed window, while a copy, which leaves as many dirty lines of its own for the next flush, nearly breaks even.
# H100 (scripts/gpu_fp8kv_s12.py round A, 537 MB a call, against the same calls back to back): the fp8 decode call
# +11.8 us (0.1974 against 0.1852 ms), a read-only kernel +10.8, a copy of the same bytes +2.0. "read" empties the L2
# by reading a 256 MB buffer instead: no line for a reader to write back, but a writer (a copy) then leaves its own
# last writes dirty past its end event, unpaid (-4.3 us). "loop" times a row back to back over its rotated input sets
# (batches of calls between two events, the median batch's time a call), where the other sets' bytes between two
# calls on one set are at least the flush's 256 MB (no call finds its inputs in the L2 without a flush): each call
# pays the write-backs of the call before it, reader or writer alike, as in a decode loop (round A: within 0.7 us of
# back to back for the decode call, the read-only kernel and the copy). It applies to the rows that divide by the
# copy reference (workloads.copy_relative: time_prepared passes their set bytes); every other row keeps do_bench's
# (and its history). "zero": do_bench's everywhere. Default "loop" (round A, fagen over the copy of the same bytes
# under the same measure: decode-d128-kv8k-b32-fp8 92.6% under "zero" -> 97.5% under "loop" (97.2% back to back),
# decode-d128-kv32k-b8-fp8 91.2 -> 95.9 (95.6), decode-d128-kv8k-b32-fp8-paged16 86.2 -> 91.3 (90.6)).
L2_FLUSH = "loop"
_FLUSH_BYTES = 256 << 20
LOOP_BATCH = 4  # rounds of the input sets a timed batch holds under "loop"


def _estimate(fn: Callable[[], Any], step: Callable[[], Any], n: int, event, sync, memo: dict | None) -> float:
    """ms a step from one warm call of fn and n steps between two events; memo["ms"] where an earlier round of the
    row left it ([Note] Interleaved rounds in fagen/bench/rounds.py), kept there otherwise."""
    if memo is not None and "ms" in memo:
        return memo["ms"]
    fn()
    sync()
    start, end = event(), event()
    start.record()
    for _ in range(n):
        step()
    end.record()
    sync()
    estimate = max(start.elapsed_time(end) / n, 1e-6)
    if memo is not None:
        memo["ms"] = estimate
    return estimate


def looped_calls(fn: Callable[[], Any], batch: int, warmup_ms: float, rep_ms: float, event, sync,
                 memo: dict | None = None) -> list[float]:
    """ms a call of `batch` calls back to back between two events, for each of the batches that fill rep_ms (after
    warm-up calls for warmup_ms; the estimate from one batch, or memo["ms"] where an earlier round left it)."""
    estimate = _estimate(fn, fn, batch, event, sync, memo)
    for _ in range(max(1, int(warmup_ms / estimate))):
        fn()
    marks = [(event(), event()) for _ in range(max(1, int(rep_ms / (estimate * batch))))]
    for s, e in marks:
        s.record()
        for _ in range(batch):
            fn()
        e.record()
    sync()
    return [s.elapsed_time(e) / batch for s, e in marks]


def timed_calls(fn: Callable[[], Any], flush: Callable[[], Any], warmup_ms: float, rep_ms: float, event, sync,
                memo: dict | None = None) -> list[float]:
    """do_bench's loop with its flush given: an estimate from 5 calls, warm-up calls for warmup_ms, then calls for
    rep_ms, each after flush() and timed alone (event() makes a CUDA event; sync waits for the device). With a
    `memo` (a row's interleaved rounds, [Note] Interleaved rounds in fagen/bench/rounds.py) the first round's
    estimate is kept in memo["ms"] and the later rounds start at the warm-up."""
    estimate = _estimate(fn, lambda: (flush(), fn()), 5, event, sync, memo)
    for _ in range(max(1, int(warmup_ms / estimate))):
        fn()
    marks = [(event(), event()) for _ in range(max(1, int(rep_ms / estimate)))]
    for s, e in marks:
        flush()
        s.record()
        fn()
        e.record()
    sync()
    return [s.elapsed_time(e) for s, e in marks]


@functools.cache
def _read_flush(device: torch.device) -> Callable[[], Any]:
    buf = torch.ones(_FLUSH_BYTES // 4, dtype=torch.int32, device=device)
    return lambda: buf.sum()  # reads the 256 MB; writes one number


def streams(n_sets: int, stream_bytes: int | None) -> bool:
    """Whether L2_FLUSH "loop" times a row back to back: a decode row whose other input sets hold at least the
    flush's bytes between two calls on one set ([Note] L2 flush)."""
    return bool(stream_bytes) and (n_sets - 1) * stream_bytes >= _FLUSH_BYTES


@functools.cache
def _zero_flush(device: torch.device) -> Callable[[], Any]:
    import triton

    driver = triton.runtime.driver.active
    cache = driver.get_empty_cache_for_benchmark()  # do_bench's 256 MB buffer, zeroed before each timed call
    return lambda: driver.clear_cache(cache)


def measure(call: Callable[[int], Any], n_sets: int, device: torch.device, warmup_ms: float, rep_ms: float,
            stream_bytes: int | None = None, memo: dict | None = None) -> float:
    """Median milliseconds of call(i), rotating i over the input sets.

    CUDA: triton.testing.do_bench's loop (CUDA events around each call, the L2 cache flushed between calls as
    L2_FLUSH says, warm-up first); the rotation means no two consecutive calls read the same tensors either.
    stream_bytes: a decode row's bytes a set (L2_FLUSH "loop" times such rows back to back where the other sets
    hold at least the flush's bytes). memo: one round of a row's interleaved rounds (the estimate of the first round
    kept there; do_bench's loop and flush run as timed_calls then). CPU: wall clock.
    """
    counter = itertools.count()

    def fn():
        return call(next(counter) % n_sets)

    if device.type == "cuda":
        import triton.testing

        event = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
        if L2_FLUSH == "read":  # [Note] L2 flush
            return float(statistics.median(timed_calls(fn, _read_flush(device), warmup_ms, rep_ms, event,
                                                       torch.cuda.synchronize, memo)))
        if L2_FLUSH == "loop" and streams(n_sets, stream_bytes):
            return float(statistics.median(looped_calls(fn, LOOP_BATCH * n_sets, warmup_ms, rep_ms, event,
                                                        torch.cuda.synchronize, memo)))
        if memo is not None:
            return float(statistics.median(timed_calls(fn, _zero_flush(device), warmup_ms, rep_ms, event,
                                                       torch.cuda.synchronize, memo)))
        return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    fn()  # warm-up (compiles, fills caches)
    times, start = [], time.perf_counter()  # at least one timed call, then until rep_ms is spent (at most 50)
    while not times or (time.perf_counter() - start) * 1e3 < rep_ms and len(times) < 50:
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def time_prepared(prepared: Prepared, cc: CaseContext, opts: BenchOptions, memo: dict | None = None) -> dict:
    """{ms} of the forward, or {ms (backward alone), fwdbwd_ms} of a backward case. memo: one of the row's
    interleaved rounds ([Note] Interleaved rounds in fagen/bench/rounds.py), a 1/opts.rounds share of the warm-up
    and the repetitions, the estimates kept in memo from the first round."""
    c, sets = cc.case, cc.sets
    share = opts.rounds if memo is not None else 1
    warm, rep = opts.warmup_ms / share, opts.rep_ms / share

    def part(key: str) -> dict:  # the measure's memo for `key`, in a round only (the earlier call stays as it was)
        return {} if memo is None else {"memo": memo.setdefault(key, {})}

    if c.direction is Direction.FWD:
        stream = set_bytes(c) if c.decode and copy_relative(c) else None  # [Note] L2 flush ("loop")
        with torch.no_grad():
            return {"ms": measure(lambda i: prepared.fn(sets[i]), len(sets), cc.device, warm, rep, stream,
                                  **part("ms"))}
    leaves = [[t.detach().clone().requires_grad_() for t in (s.q, s.k, s.v)] for s in sets]
    views = [dataclasses.replace(s, q=lv[0], k=lv[1], v=lv[2]) for s, lv in zip(sets, leaves)]
    outs = [out_of(prepared.fn(vw)) for vw in views]  # graphs kept alive: backward alone is timed
    bwd = measure(lambda i: torch.autograd.grad(outs[i], leaves[i], sets[i].dout, retain_graph=True),
                  len(sets), cc.device, warm, rep, **part("ms"))
    outs.clear()  # free the kept graphs before timing forward + backward
    both = measure(lambda i: torch.autograd.grad(out_of(prepared.fn(views[i])), leaves[i], sets[i].dout),
                   len(sets), cc.device, warm, rep, **part("fwdbwd_ms"))
    return {"ms": bwd, "fwdbwd_ms": both}
