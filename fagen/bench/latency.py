"""`fagen bench --suite latency`: host time per call of small problems, fagen against SDPA in one run.

[Note] Host time. For a decode step or a short prompt the GPU finishes each kernel in microseconds, so a loop of
calls runs at the speed of the host code that launches them. Each case makes `calls` back-to-back calls on one
input set (no L2 flush, no synchronisation inside the loop) and reports wall time / calls: the per-call cost a
serving loop pays. The same loop runs fagen.attention (the public path), the generated module's forward (one
layer of indirection less), the same with caller-owned out/lse (no output allocation) and torch's SDPA,
interleaved over `rounds` rounds, median reported.

[Note] A growing KV cache. transformers' DynamicCache appends one key per decode step (torch.cat: a new contiguous k
and v whose Sk and strides change every step), so no two calls of a generation share a shape. The growing case
gives every call, of every implementation and round, the next length (Sk0, Sk0 + 1, ...): views of one buffer laid
out as the concatenation would leave them, made before timing, so that a length never repeats (as in a generation)
and the timed loop makes no tensor. Each round runs GROW_CALLS calls per implementation, so the cache stays short
enough (Sk0 + rounds x implementations x (GROW_CALLS + warm-up)) for the GPU to keep up with the host.
"""

from __future__ import annotations

import cProfile
import dataclasses
import io
import pstats
import statistics
import time
from typing import Callable

import torch


@dataclasses.dataclass(frozen=True)
class LatencyCase:
    name: str
    batch: int
    heads_q: int
    heads_kv: int
    seq_q: int
    seq_k: int
    head_dim: int = 128
    mask: str = "causal"
    grow: bool = False  # a KV cache that grows by one key per call, from seq_k ([Note] A growing KV cache)


CASES = (
    LatencyCase("decode-b1-h32/8-kv1024-d128", 1, 32, 8, 1, 1024, mask="none"),
    LatencyCase("decode-growing-b1-h32/8-kv1024+-d128", 1, 32, 8, 1, 1024, mask="none", grow=True),
    LatencyCase("prefill-causal-b1-h32/8-s128-d128", 1, 32, 8, 128, 128),
)
GROW_CALLS = 128  # timed calls per round and implementation of a growing case
WARMUP_CALLS = 20


def _inputs(case: LatencyCase, device: str, dtype: torch.dtype):
    g = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(case.batch, case.heads_q, case.seq_q, case.head_dim, generator=g).to(device, dtype)
    k = torch.randn(case.batch, case.heads_kv, case.seq_k, case.head_dim, generator=g).to(device, dtype)
    return q, k, torch.randn_like(k)


class Growing:
    """The k and v of a cache that grows by one key per call: next() gives the next length's pair, views of one
    buffer shaped as a concatenation leaves them (contiguous, [B, Hkv, Sk, D]), all made up front."""

    def __init__(self, case: LatencyCase, device: str, dtype: torch.dtype, calls: int):
        hkv, d = case.heads_kv, case.head_dim
        last = case.seq_k + calls
        g = torch.Generator(device="cpu").manual_seed(1)
        flat = [torch.randn(case.batch * hkv * last * d, generator=g).to(device, dtype) for _ in range(2)]
        self.pairs = iter([tuple(t[:case.batch * hkv * n * d].view(case.batch, hkv, n, d) for t in flat)
                           for n in range(case.seq_k, last)])

    def __next__(self):
        return next(self.pairs)


def implementations(case: LatencyCase, q, k, v, grow: Growing | None = None
                    ) -> dict[str, tuple[Callable[[], object], str]]:
    """name -> (call, the generated module it runs). "module.forward" is the module fagen.attention resolves for
    these inputs without gradients (on an H100/H200 that may be the Gluon forward for problems of hopper.MIN_WORK
    pairs and more, [Note] Hopper selection); where that is not the Triton module, "triton module.forward" times
    the Triton one too. With `grow`, each call takes the next k and v from it (the out=/lse= variant is left out:
    it shares module.forward's path)."""
    import fagen
    from fagen.runtime.kinds import prefers_decode
    from fagen.runtime.resolve import resolve

    causal = case.mask == "causal" and case.seq_q > 1
    decode = prefers_decode(case.seq_q, case.seq_k)  # fagen.attention's rule
    from fagen.runtime.hopper import MIN_WORK

    big = q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] >= MIN_WORK  # fagen.attention's Gluon size rule
    module = resolve(q, k, v, case.mask, decode, forward_only=not decode and big)  # what fagen.attention runs
    triton_module = resolve(q, k, v, case.mask, decode)
    out, lse = module.forward(q, k, v)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    gqa = case.heads_q != case.heads_kv
    if grow is not None:
        def growing(call):
            def step():
                kg, vg = next(grow)
                return call(kg, vg)
            return step

        return {"fagen.attention": (growing(lambda kg, vg: fagen.attention(q, kg, vg, mask=case.mask)), module.NAME),
                "fagen module.forward": (growing(lambda kg, vg: module.forward(q, kg, vg)), module.NAME),
                "sdpa": (growing(lambda kg, vg: sdpa(q, kg, vg, is_causal=causal, enable_gqa=gqa)), "")}
    impls = {
        "fagen.attention": (lambda: fagen.attention(q, k, v, mask=case.mask), module.NAME),
        "fagen module.forward": (lambda: module.forward(q, k, v), module.NAME),
        "module.forward(out=, lse=)": (lambda: module.forward(q, k, v, out=out, lse=lse), module.NAME),
    }
    if triton_module is not module:
        impls["triton module.forward"] = (lambda: triton_module.forward(q, k, v), triton_module.NAME)
    impls["sdpa"] = (lambda: sdpa(q, k, v, is_causal=causal, enable_gqa=gqa), "")
    return impls


def per_call_us(fn: Callable[[], object], calls: int, device: str) -> float:
    for _ in range(min(WARMUP_CALLS, calls)):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def run(device: str, dtype: torch.dtype = torch.bfloat16, calls: int = 2000, rounds: int = 9,
        log: Callable[[str], None] = print, profile: bool = False, cases=CASES) -> list[dict]:
    records = []
    for case in cases:
        q, k, v = _inputs(case, device, dtype)
        n = min(calls, GROW_CALLS) if case.grow else calls
        grow = Growing(case, device, dtype, (rounds * 3 + 1) * (n + min(WARMUP_CALLS, n))) if case.grow else None
        impls = implementations(case, q, k, v, grow)
        with torch.no_grad():
            times = {name: [] for name in impls}
            for _ in range(rounds):  # interleaved rounds: drift in clocks or load hits every implementation alike
                for name, (fn, _) in impls.items():
                    times[name].append(per_call_us(fn, n, device))
            prof = _profile(impls["fagen.attention"][0], n) if profile else ""
        # Median and best round: a shared host's noise only ever adds time, so the best round is the cleaner
        # estimate of what a call costs; both are recorded, each against SDPA's of the same statistic.
        base, base_best = statistics.median(times["sdpa"]), min(times["sdpa"])
        for name, ts in times.items():
            us, best = statistics.median(ts), min(ts)
            records.append({"case": case.name, "impl": name, "module": impls[name][1], "us_per_call": round(us, 2),
                            "vs_sdpa": round(us / base, 3), "best_us": round(best, 2),
                            "best_vs_sdpa": round(best / base_best, 3), "rounds_us": [round(t, 2) for t in ts]})
            log(f"  {case.name:<36} {name:<28} {us:8.2f} us/call  {us / base:5.2f}x sdpa   best {best:8.2f} us "
                f"{best / base_best:5.2f}x  {impls[name][1]}")
        if prof:
            records.append({"case": case.name, "impl": "profile", "text": prof})
    for line in summary(records):
        log(line)
    return records


def summary(records: list[dict]) -> list[str]:
    """One table of every case: us per call (median round) of each implementation, and fagen.attention / SDPA."""
    rows = [r for r in records if "us_per_call" in r]
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    cases = list(dict.fromkeys(r["case"] for r in rows))
    cell = {(r["case"], r["impl"]): r for r in rows}
    width = max(len(c) for c in cases) if cases else 4
    lines = ["us per call (median of the rounds); the last columns: fagen.attention / sdpa on the same calls, and on "
             "a growing row / sdpa's fixed-shape row (what a step costs SDPA when its shape repeats)",
             f"{'case':<{width}}  " + "  ".join(f"{i:>{max(10, len(i))}}" for i in impls)
             + "  attention/sdpa  attention/fixed-shape sdpa"]
    for case in cases:
        values = [f"{cell[case, i]['us_per_call']:>{max(10, len(i))}.2f}" if (case, i) in cell
                  else f"{'-':>{max(10, len(i))}}" for i in impls]
        mine = cell.get((case, "fagen.attention"))
        ratio = mine["vs_sdpa"] if mine else float("nan")
        fixed = cell.get((case.replace("-growing", "").replace("+", ""), "sdpa"))  # the growing case's fixed twin
        vs_fixed = mine["us_per_call"] / fixed["us_per_call"] if mine and fixed else float("nan")
        lines.append(f"{case:<{width}}  " + "  ".join(values) + f"  {ratio:13.2f}x  {vs_fixed:25.2f}x")
    return lines


def _profile(fn: Callable[[], object], calls: int) -> str:
    """cProfile of the fagen.attention loop: where the host time per call goes (cumulative, top 25)."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(25)
    return out.getvalue()
